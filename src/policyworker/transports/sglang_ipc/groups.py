"""sglang_ipc's engine groups: which trainer ranks each engine covers, building (and
rebuilding) this rank's group on the update group's store, the small collectives the
transport runs on an engine's group (gathers, a text broadcast), plus the manifest
digest it checks every refit. Only small CPU tensors travel here."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from policyworker.runtime.comm import CommGroup, group_on_store
from policyworker.errors import ConfigError, ProtocolError, TransportError
from policyworker.transports.sglang_ipc.engine_call import error_class
from policyworker.transports.sglang_ipc.format import manifest_digest

__all__ = ["EngineLayout", "broadcast_text", "bucket_round", "digest", "engine_group", "ensure_engine_group", "gather", "gather_all"]

NAME = "sglang_ipc"
_MAX_MESSAGE = 2000  # bytes of a failure message broadcast to the engine group


def _int(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """Which trainer ranks (= GPUs) each engine covers: ``[offsets[e], offsets[e] + counts[e])``."""

    counts: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def build(cls, counts: Any, offsets: Any, world_size: int) -> EngineLayout:
        """Validate against the trainer world; ``ConfigError`` names the first problem."""
        if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
            raise ConfigError(f"engine_gpu_counts must be a sequence of ints, got {type(counts).__name__}")
        c = tuple(_int(v, f"engine_gpu_counts[{i}]", 1) for i, v in enumerate(counts))
        if not c:
            raise ConfigError("engine_gpu_counts must name at least one engine")
        if offsets is None:
            o = tuple(sum(c[:i]) for i in range(len(c)))
        else:
            if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence):
                raise ConfigError(f"engine_gpu_offsets must be a sequence of ints, got {type(offsets).__name__}")
            o = tuple(_int(v, f"engine_gpu_offsets[{i}]", 0) for i, v in enumerate(offsets))
            if len(o) != len(c):
                raise ConfigError(f"engine_gpu_offsets has {len(o)} entries, engine_gpu_counts has {len(c)}")
        if sum(c) > world_size:
            raise ConfigError(f"the engines need {sum(c)} GPUs, the trainer world has {world_size} ranks")
        for e, (off, n) in enumerate(zip(o, c)):
            if off + n > world_size:
                raise ConfigError(f"engine {e} covers GPUs [{off}, {off + n}), outside the trainer world "
                                  f"[0, {world_size})")
        spans = sorted((off, off + n, e) for e, (off, n) in enumerate(zip(o, c)))
        for (a0, a1, ea), (b0, b1, eb) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ConfigError(f"engines {ea} [{a0}, {a1}) and {eb} [{b0}, {b1}) overlap")
        return cls(c, o)

    def locate(self, rank: int) -> tuple[int, int] | None:
        """(engine index, tp rank in it) of trainer ``rank``, or None when no engine covers it."""
        for e, (off, n) in enumerate(zip(self.offsets, self.counts)):
            if off <= rank < off + n:
                return e, rank - off
        return None


def engine_group(update_group: CommGroup, prefix: str, rank: int, size: int, name: str, timeout_s: float) -> CommGroup:
    """A gloo group on ``update_group``'s store under ``prefix``; warmed up before use."""
    return group_on_store(dist.PrefixStore(prefix, update_group.store), rank=rank, world_size=size, name=name,
                          backend="gloo", timeout_s=timeout_s, transport=NAME)


def ensure_engine_group(ctx: Any) -> None:
    """Build this rank's engine group into ``ctx.state`` when the layout or the update group
    changed, or a refit lost the group (``broken``); the same layout again keeps it."""
    state = ctx.state
    layout = EngineLayout.build(ctx.setup.engine_gpu_counts, ctx.setup.engine_gpu_offsets, ctx.world_size)
    update_group = ctx.update_group
    if update_group is None:
        raise ConfigError("call init_collective first: the engine groups are built on its store",
                          rank=ctx.rank, transport=NAME)
    same_world = state.get("update_group_ref") is not None and state["update_group_ref"]() is update_group
    old = state.get("group")
    if (state.get("layout") == layout and same_world and not state.get("broken")
            and (old is None or not old.aborted)):
        return
    epoch = (state.get("epoch", 0) if same_world else 0) + 1
    where = layout.locate(ctx.rank)
    group = None
    if where is not None:
        e, tp_rank = where
        group = engine_group(update_group, f"sglang_ipc/{epoch}/engine{e}", tp_rank, layout.counts[e],
                              f"sglang_engine{e}", update_group.timeout_s)
    if old is not None and old is not group:
        old.close()
    # The update group is the worker's: keep a reference, not the group (the worker's
    # deadline aborts the groups in this state, and the update group is not ours to abort).
    state.update(layout=layout, group=group, epoch=epoch, update_group_ref=weakref.ref(update_group),
                 broken=False, engine_index=None if where is None else where[0],
                 group_rank=None if where is None else where[1],
                 gather_src=None if where is None else layout.offsets[where[0]], connected_group=None)


def digest(state: dict, params) -> int:
    """``manifest_digest(params)``, hashed again only when a tensor object, shape or dtype changed.

    Every refit starts with it and the GPU idles meanwhile: hashing 400 names, shapes and
    dtypes costs ~1 ms of host time, checking that the same tensors are there ~0.1 ms.
    Weak references, so a replaced model is not kept alive here.
    """
    names = tuple(params)
    seen = state.get("digest_of")
    if seen is not None and seen[1] == names and all(
            ref() is t and t.shape == shape and t.dtype == dtype
            for t, (ref, shape, dtype) in zip(params.values(), seen[2])):
        return seen[0]
    digest = manifest_digest(params)
    state["digest_of"] = (digest, names, tuple((weakref.ref(t), t.shape, t.dtype) for t in params.values()))
    return digest


# -- small collectives on the engine group ------------------------------------------
def gather(group, payload: bytes, longest: int, deadline: float) -> list[bytes] | None:
    """Gather every rank's payload (at most ``longest`` bytes) to group rank 0."""
    slot = torch.zeros(8 + longest, dtype=torch.uint8)
    slot[:8].view(torch.int64)[0] = len(payload)
    if payload:
        slot[8:8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    group._guard()
    opts = dist.GatherOptions()
    opts.rootRank = 0
    out = [[torch.empty_like(slot) for _ in range(group.world_size)]] if group.rank == 0 else []
    group.wait(group.pg.gather(out, [slot], opts), deadline=deadline, what="sglang_ipc gather")
    if group.rank != 0:
        return None
    result = []
    for t in out[0]:
        n = int(t[:8].view(torch.int64)[0])
        if not 0 <= n <= longest:
            raise ProtocolError(f"gathered payload claims {n} bytes of {longest}", transport=NAME)
        result.append(t[8:8 + n].numpy().tobytes())
    return result


def gather_all(group, payload: bytes, deadline: float) -> list[bytes] | None:
    """All-reduce the longest length, then gather (connect only: the buffer handles)."""
    flags = torch.tensor([len(payload)], dtype=torch.int64)
    if group.world_size > 1:
        group.all_reduce(flags, op=dist.ReduceOp.MAX, deadline=deadline)
    return gather(group, payload, int(flags.item()), deadline)


def broadcast_text(group, message: str, deadline: float) -> str:
    """Broadcast the source's message to every rank of the engine group (failures only)."""
    text = message.encode("utf-8", "replace")[:_MAX_MESSAGE]
    head = torch.tensor([len(text)], dtype=torch.int64)
    group.broadcast(head, 0, deadline=deadline)
    length = int(head.item())
    body = torch.frombuffer(bytearray(text), dtype=torch.uint8) if group.rank == 0 and length else \
        torch.zeros(length, dtype=torch.uint8)
    if length:
        group.broadcast(body, 0, deadline=deadline)
    return body.numpy().tobytes().decode("utf-8", "replace")


def bucket_round(ctx: Any, version: int, index: int, failed: bool, length: int, answer: tuple[int, str],
                 deadline: float) -> int:
    """One round per bucket of a refit: all-reduce (pack failed, payload length, the source's
    verdict of bucket ``index``).

    Returns the longest payload. A verdict raises its error class on every rank (the
    message follows in a broadcast, only then); a failed pack raises ``TransportError``
    on every other rank (the failing rank raises its own error after this round). With
    one rank in the group nothing is sent.
    """
    group = ctx.state["group"]
    code, message = answer
    if group.world_size > 1:
        flags = torch.tensor([int(failed), length, code], dtype=torch.int64)
        group.all_reduce(flags, op=dist.ReduceOp.MAX, deadline=deadline)
        any_failed, length, code = (int(v) for v in flags.tolist())
        if code:
            message = broadcast_text(group, message, deadline)
    else:
        any_failed = int(failed)
    if code:
        cls = error_class(code)
        raise cls(f"engine {ctx.state.get('engine_index')}, refit {version}, bucket {index}: {message}",
                  rank=ctx.rank, transport=NAME)
    if any_failed and not failed:
        raise TransportError("a peer rank of this engine failed to pack its bucket", rank=ctx.rank,
                             transport=NAME)
    return length
