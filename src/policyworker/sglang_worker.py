"""The trainer side of ``sglang_ipc``: engine groups and refits into colocated SGLang engines.

:class:`SglangIpcMixin` implements ``connect_sglang_rollout_engines`` and
``sglang_refit`` for any ``AbstractPolicyWorker`` that can name the tensors SGLang
should load (hook ``_sglang_named_tensors``; by default a ``TorchPolicyWorker``'s
full model parameters, HF names — SGLang's own ``load_weights`` shards them).

Colocation: trainer rank r runs on GPU r; engine e owns GPUs
``[offset_e, offset_e + count_e)``, so its tp rank i is trainer rank ``offset_e + i``
and its gather source is trainer rank ``offset_e``. Ranks on no engine's GPUs take
part in no group and their refit is a no-op.

Where the groups come from: ``init_collective`` must have run. Each engine's gloo
group is built on the update group's store under its own prefix
(``sglang_ipc/<epoch>/engine<e>``), so no extra port is needed. ``epoch`` counts
layout rebuilds since the update group was formed: every trainer rank makes the same
calls, so every rank derives the same prefix, and a new update group (recovery)
starts over at epoch 1 on every rank alike.

State lives in ``_refit_transport_state("sglang_ipc")``: ``layout``, ``group``,
``engine_index``, ``group_rank``, ``gather_src``, ``epoch``, ``update_group``,
``version`` (the last weight version sent), ``broken`` (a refit lost the group: the
next connect rebuilds even an unchanged layout), and the transport's buffer and handles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .comm import CommGroup, group_on_store
from .errors import ConfigError, PeerLost, RefitAborted
from .sglang_client import SglangEngine
from .transports.base import RefitReport, TransportContext
from .transports.sglang_ipc import NAME, SglangIpcTransport
from .watchdog import process_watchdog

__all__ = ["EngineLayout", "SglangIpcMixin"]


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


def _engine_group(update_group: CommGroup, prefix: str, rank: int, size: int, name: str, timeout_s: float) -> CommGroup:
    """A gloo group on ``update_group``'s store under ``prefix``; warmed up before use."""
    return group_on_store(dist.PrefixStore(prefix, update_group.store), rank=rank, world_size=size, name=name,
                          backend="gloo", timeout_s=timeout_s, transport=NAME)


class SglangIpcMixin:
    """Trainer-side ``sglang_ipc``; mix in before an ``AbstractPolicyWorker`` subclass."""

    #: Options of the SglangIpcTransport (``bucket_bytes``); equal on every rank.
    sglang_options: dict[str, Any] = {}

    def _sglang_named_tensors(self) -> Mapping[str, torch.Tensor]:
        """What SGLang loads, by (HF) name: the full tensors, on this rank's GPU.

        Default: ``TorchPolicyWorker``'s unique parameters. A sharded trainer overrides
        this to return full tensors (e.g. gathered DTensors) — every rank of an engine
        must return the same names, shapes and dtypes.
        """
        params = getattr(self, "_params", None)
        if params is None:
            raise NotImplementedError("override _sglang_named_tensors to name the tensors SGLang loads")
        return {name: p.detach() for name, p in params}

    async def connect_sglang_rollout_engines(
        self, *, engine_gpu_counts: Sequence[int], engine_gpu_offsets: Sequence[int] | None = None
    ) -> None:
        """Group trainer ranks per colocated SGLang engine (collective over all trainer ranks).

        ``engine_gpu_counts[e]``: GPUs (tp ranks) of engine e; ``engine_gpu_offsets[e]``
        its first GPU = trainer rank (default: the running sum). Engines must not
        overlap and must fit the trainer world (``ConfigError``, state unchanged).
        The same layout again is a no-op; a changed layout (an engine added, moved or
        recovered on other GPUs) or a new update group rebuilds the groups. Then the
        transport connects: manifests are checked and buffers exchanged, so a bad
        pairing fails here, not in the first refit.
        """
        layout = EngineLayout.build(engine_gpu_counts, engine_gpu_offsets, self.world_size)
        self._ensure_open()
        update_group = self.model_update_group
        if update_group is None:
            raise ConfigError("call init_collective first: the engine groups are built on its store",
                              rank=self.rank, transport=NAME)
        state = self._refit_transport_state(NAME)
        old = state.get("group")
        if (state.get("layout") == layout and state.get("update_group") is update_group
                and not state.get("broken") and (old is None or not old.aborted)):
            return
        epoch = (state.get("epoch", 0) if state.get("update_group") is update_group else 0) + 1
        where = layout.locate(self.rank)
        group = None
        if where is not None:
            e, tp_rank = where
            group = await self._run(_engine_group, update_group, f"sglang_ipc/{epoch}/engine{e}", tp_rank,
                                    layout.counts[e], f"sglang_engine{e}", self.timeout_s)
        if old is not None and old is not group:
            old.close()
        state.update(layout=layout, group=group, epoch=epoch, update_group=update_group, broken=False,
                     engine_index=None if where is None else where[0],
                     group_rank=None if where is None else where[1],
                     gather_src=None if where is None else layout.offsets[where[0]])
        state.setdefault("version", 0)
        state["connected_group"] = None
        if group is not None:
            await self._sglang_transport(state).connect(self._sglang_ctx(state, None, {}))

    def _sglang_transport(self, state: dict) -> SglangIpcTransport:
        transport = state.get("transport")
        if transport is None:
            transport = state["transport"] = SglangIpcTransport(**self.sglang_options)
        return transport

    def _sglang_ctx(self, state: dict, deadline, options: dict) -> TransportContext:
        return TransportContext(worker=self, role="send", rank=self.rank, device=self.device_facts, state=state,
                                params=self._sglang_named_tensors(), options=options, deadline=deadline,
                                executor=self._executor)

    async def sglang_refit(
        self,
        *,
        engine: SglangEngine | None = None,
        refit_timeout_s: float | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        torch_empty_cache: bool = False,
    ) -> RefitReport:
        """Push the current weights into this rank's engine as weight version v+1.

        Collective over the ranks of each engine. ``engine`` (an ``SglangHttpEngine``,
        an ``InProcessSglangEngine`` or anything with ``update_weights_from_tensor``)
        is needed on the gather source only; other ranks pass None. ``flush_cache``,
        ``abort_all_requests`` and ``torch_empty_cache`` are SGLang's flags (sent with
        the last, the first and the last bucket). A refused bucket raises
        ``TransportError`` on every rank of the engine; a passed ``refit_timeout_s``
        aborts the group and raises ``RefitTimeout``. The version advances only on
        success. Ranks on no engine return a report with 0 bytes.
        """
        timeout = self._check_refit_timeout(refit_timeout_s)
        for value, what in ((flush_cache, "flush_cache"), (abort_all_requests, "abort_all_requests"),
                            (torch_empty_cache, "torch_empty_cache")):
            if not isinstance(value, bool):
                raise ConfigError(f"{what} must be a bool, got {value!r}")
        if engine is not None and not callable(getattr(engine, "update_weights_from_tensor", None)):
            raise ConfigError(f"engine {engine!r} has no update_weights_from_tensor")
        self._ensure_open()
        state = self._refit_transport_state(NAME)
        if "layout" not in state:
            raise ConfigError("call connect_sglang_rollout_engines before sglang_refit", rank=self.rank)
        group = state["group"]
        version = state.get("version", 0) + 1
        if group is None:
            return RefitReport(transport=NAME, role="send", version=version - 1, bytes=0, seconds=0.0,
                               notes=("this rank hosts no engine GPU",))
        deadline = None
        if timeout is not None:
            deadline = process_watchdog().arm(timeout, [group.abort], label=f"sglang_ipc rank {self.rank}")
        options = {"engine": engine, "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
                   "torch_empty_cache": torch_empty_cache}
        try:
            report = await self._sglang_transport(state).send(self._sglang_ctx(state, deadline, options), version)
        except (RefitAborted, PeerLost):
            # The group may be out of step or dead: the next connect rebuilds it even
            # for the same layout (every rank of the engine got an error here too).
            state["broken"] = True
            if deadline is not None:
                deadline.check()
            raise
        finally:
            if deadline is not None:
                process_watchdog().disarm(deadline)
        state["version"] = version
        return report
