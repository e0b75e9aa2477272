"""sglang_ipc: colocated refit into SGLang engines, in SGLang's own request format.

Groups: one gloo group per engine over the trainer ranks colocated with its GPUs, in
GPU order (group rank i = engine tp rank i); group rank 0 is the engine's *gather
source* and the only rank that talks to the engine. Built by
``SglangIpcMixin.connect_sglang_rollout_engines``; kept in ``ctx.state["group"]``.
Only small CPU tensors travel on it: the bulk never leaves the device.

``connect`` (every rank of the engine group, in this order):
  1. all-gather (manifest digest, bucket_bytes, buckets): every rank must hold the
     same names, shapes and dtypes (``PlanMismatch``) and options (``ConfigError``);
  2. allocate this rank's flattened buffer once (largest bucket; CUDA memory or CPU
     shared memory) and gather its typed handle to the source (msgpack, not pickle).

One refit of version v (every rank, in this order):
  0. start: all-gather (v, digest, connected); the source adds whether it has an engine
     and whether the engine wants SGLang's pickled blobs. Any rank not connected (or a
     changed model) makes every rank run ``connect`` again, so collectives stay paired;
  per bucket k:
  1. pack k into the buffer (the previous bucket was acknowledged: the buffer is free);
  2. all-reduce (failed, blob length); if the engine wants blobs, gather them to the
     source (each rank's ``MultiprocessingSerializer`` blob of its own buffer);
  3. the source calls ``engine.update_weights_from_tensor`` with one entry per tp rank
     (``weight_version`` on the last bucket only), bounded by the refit deadline;
  4. the source broadcasts the verdict (code + message); every rank raises the same
     error class on failure. The broadcast is also the acknowledgement: no rank
     repacks its buffer before the engine has answered for the bucket it holds.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..errors import (
    ConfigError,
    PeerLost,
    PlanMismatch,
    PolicyWorkerError,
    ProtocolError,
    RefitAborted,
    RefitTimeout,
    TransportError,
)
from ..wire import Decoder, Message, encode
from .base import RefitReport, Transport, TransportContext
from .sglang_format import (
    BufferHandle,
    export_buffer,
    manifest_digest,
    pack_bucket,
    plan_buckets,
    serialize_bucket,
    to_base64,
)

__all__ = ["SglangIpcTransport"]

NAME = "sglang_ipc"


class BufferHello(Message, frozen=True, kw_only=True):
    """A rank's buffer handle, sent once per connect to the gather source."""

    handle: BufferHandle


class BucketBlob(Message, frozen=True, kw_only=True):
    """A rank's SGLang blob of one bucket (only when the engine wants blobs)."""

    version: int
    bucket: int
    blob: bytes


_HELLO = Decoder(BufferHello)
_BLOB = Decoder(BucketBlob)

# Verdict codes broadcast by the source: every rank raises the same class.
_VERDICTS: dict[int, type[PolicyWorkerError]] = {
    1: TransportError,  # the engine refused the bucket
    2: PeerLost,
    3: RefitTimeout,
    4: ProtocolError,
    5: ConfigError,
    6: RefitAborted,
}
_CODES = {cls: code for code, cls in _VERDICTS.items()}
_MAX_MESSAGE = 2000


def _code_of(exc: PolicyWorkerError) -> int:
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return 1


class SglangIpcTransport(Transport):
    """See the module docstring. ``bucket_bytes`` must match on every rank of an engine."""

    name = NAME

    def __init__(self, *, bucket_bytes: int = 256 << 20) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1024:
            raise ConfigError(f"bucket_bytes must be an int >= 1024, got {bucket_bytes!r}", transport=NAME)
        self.bucket_bytes = bucket_bytes
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed", transport=NAME)

    @staticmethod
    def _deadline(ctx: TransportContext) -> float:
        if ctx.deadline is not None:
            return ctx.deadline.at
        return time.monotonic() + ctx.state["group"].timeout_s

    # -- connect ---------------------------------------------------------------------
    async def connect(self, ctx: TransportContext) -> None:
        """Check manifests, allocate this rank's buffer, gather the handles to the source."""
        self._check_open()
        if ctx.state.get("group") is None:
            raise ConfigError("this rank is in no engine group; connect_sglang_rollout_engines first",
                              rank=ctx.rank, transport=NAME)
        await ctx.blocking(self._connect, ctx)

    def _connect(self, ctx: TransportContext) -> None:
        state, group = ctx.state, ctx.state["group"]
        deadline = self._deadline(ctx)
        state["connected_group"] = None
        digest = manifest_digest(ctx.params)
        buckets = plan_buckets(ctx.params, self.bucket_bytes)
        mine = torch.tensor([digest, self.bucket_bytes, len(buckets)], dtype=torch.int64)
        rows = [torch.zeros(3, dtype=torch.int64) for _ in range(group.world_size)]
        group.all_gather(rows, mine, deadline=deadline)
        rows = [r.tolist() for r in rows]
        if any(r[0] != rows[0][0] for r in rows):
            raise PlanMismatch(f"trainer ranks of engine {state.get('engine_index')} hold different tensors "
                               "(names, shapes or dtypes differ)", rank=ctx.rank, transport=NAME)
        if any(r[1] != rows[0][1] for r in rows):
            raise ConfigError(f"ranks of engine {state.get('engine_index')} disagree on bucket_bytes: "
                              f"{sorted({r[1] for r in rows})}", rank=ctx.rank, transport=NAME)
        device = next((t.device for t in ctx.params.values()), torch.device("cpu"))
        need = max((b.nbytes for b in buckets), default=0)
        buf = state.get("buffer")
        if buf is None or buf.numel() < need or buf.device != device:
            # Lives across refits: its handle is exported once and opened once by the engine.
            state["buffer"], state["handle"] = export_buffer(need, device)
        handles = _gather(group, encode(BufferHello(handle=state["handle"])), False, deadline)
        if group.rank == 0:
            state["peer_handles"] = tuple(_HELLO.decode(h).handle for h in handles)
        state["buckets"] = buckets
        state["digest"] = digest
        state["connected_group"] = group

    # -- refit -----------------------------------------------------------------------
    async def send(self, ctx: TransportContext, version: int) -> RefitReport:
        """Move refit ``version`` into the engine; ``ctx.options["engine"]`` on the source."""
        self._check_open()
        if ctx.state.get("group") is None:
            raise ConfigError("this rank is in no engine group", rank=ctx.rank, transport=NAME)
        return await ctx.blocking(self._refit, ctx, version)

    async def receive(self, ctx: TransportContext, version: int) -> RefitReport:
        raise ConfigError("sglang_ipc has no receiving side of ours: the engine is the receiver "
                          "(SglangHttpEngine or InProcessSglangEngine)", transport=NAME)

    def _refit(self, ctx: TransportContext, version: int) -> RefitReport:
        try:
            return self._refit_body(ctx, version)
        except RefitAborted:
            if ctx.deadline is not None:
                ctx.deadline.check()  # a fired deadline is a RefitTimeout
            raise

    def _start(self, ctx: TransportContext, version: int, deadline: float) -> bool:
        """The start round; returns whether the engine wants blobs (raises on disagreement)."""
        state, group = ctx.state, ctx.state["group"]
        engine = ctx.options.get("engine")
        digest = manifest_digest(ctx.params)
        connected = state.get("connected_group") is group and state.get("digest") == digest
        mine = torch.tensor([version, digest, int(connected), int(engine is not None),
                             int(bool(getattr(engine, "wants_serialized", True)))], dtype=torch.int64)
        rows = [torch.zeros(5, dtype=torch.int64) for _ in range(group.world_size)]
        group.all_gather(rows, mine, deadline=deadline)
        rows = [r.tolist() for r in rows]
        if any(r[0] != version for r in rows):
            raise ProtocolError(f"ranks of engine {state.get('engine_index')} are at different refit versions: "
                                f"{[r[0] for r in rows]}", rank=ctx.rank, transport=NAME)
        if not rows[0][3]:
            raise ConfigError(f"the gather source (trainer rank {state.get('gather_src')}) of engine "
                              f"{state.get('engine_index')} was given no engine", rank=ctx.rank, transport=NAME)
        if not all(r[2] for r in rows) or any(r[1] != rows[0][1] for r in rows):
            self._connect(ctx)  # every rank takes this branch: the rows are the same everywhere
        return bool(rows[0][4])

    def _refit_body(self, ctx: TransportContext, version: int) -> RefitReport:
        t0 = time.perf_counter()
        state, group = ctx.state, ctx.state["group"]
        deadline = self._deadline(ctx)
        wants_blobs = self._start(ctx, version, deadline)
        buckets, buf = state["buckets"], state["buffer"]
        is_src = group.rank == 0
        total = 0
        for layout in buckets:
            payload, failure = b"", None
            try:
                pack_bucket(layout, ctx.params, buf)
                if buf.device.type == "cuda":
                    torch.cuda.current_stream(buf.device).synchronize()  # the engine reads it from another process
                if wants_blobs:
                    blob = serialize_bucket(buf.narrow(0, 0, layout.nbytes), layout.metadata)
                    payload = encode(BucketBlob(version=version, bucket=layout.index, blob=blob))
            except (RuntimeError, ValueError, PolicyWorkerError) as exc:
                failure = exc
            gathered = _gather(group, payload, failure is not None, deadline, collect=wants_blobs)
            if failure is not None:
                raise TransportError(f"packing bucket {layout.index} failed: {failure}",
                                     rank=ctx.rank, transport=NAME) from failure
            code, message = 0, ""
            if is_src:
                code, message = self._call_engine(ctx, version, layout, gathered, wants_blobs, deadline)
            code, message = _verdict(group, code, message, deadline)
            if code:
                cls = _VERDICTS.get(code, TransportError)
                raise cls(f"engine {state.get('engine_index')}, refit {version}, bucket {layout.index}: {message}",
                          rank=ctx.rank, transport=NAME)
            total += layout.nbytes
        return RefitReport(transport=NAME, role="send", version=version, bytes=total,
                           seconds=time.perf_counter() - t0, buckets=len(buckets),
                           peak_extra_bytes=int(buf.numel()))

    def _call_engine(self, ctx, version, layout, gathered, wants_blobs, deadline) -> tuple[int, str]:
        from ..sglang_client import UpdateWeightsFromTensorRequest

        state, opts = ctx.state, ctx.options
        try:
            blobs: list[str] = []
            if wants_blobs:
                for rank, raw in enumerate(gathered or []):
                    msg = _BLOB.decode(raw)
                    if msg.version != version or msg.bucket != layout.index:
                        raise ProtocolError(f"tp rank {rank} sent bucket {msg.bucket} of refit {msg.version}")
                    blobs.append(to_base64(msg.blob))
            last = layout.index == len(state["buckets"]) - 1
            request = UpdateWeightsFromTensorRequest(
                serialized_named_tensors=blobs,
                flush_cache=bool(opts.get("flush_cache", True)) and last,
                abort_all_requests=bool(opts.get("abort_all_requests", False)) and layout.index == 0,
                weight_version=str(version) if last else None,
                torch_empty_cache=bool(opts.get("torch_empty_cache", False)) and last,
                buffers=state["peer_handles"], metadata=layout.metadata,
                bucket=layout.index, num_buckets=len(state["buckets"]),
            )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RefitTimeout("no time left for the engine call")
            result = opts["engine"].update_weights_from_tensor(request, timeout_s=remaining)
        except PolicyWorkerError as exc:
            return _code_of(exc), f"{type(exc).__name__}: {exc}"
        if not result.success:
            return 1, f"the engine refused it: {result.message}"
        return 0, ""

    async def aclose(self) -> None:
        self._closed = True


# -- small collectives on the engine group ------------------------------------------
def _gather(group, payload: bytes, failed: bool, deadline: float, *, collect: bool = True) -> list[bytes] | None:
    """All-reduce (failed, length); then gather the payloads to group rank 0 if ``collect``.

    Raises ``TransportError`` on every rank when any rank failed (the failing rank
    raises its own error instead, after this round).
    """
    flags = torch.tensor([int(failed), len(payload)], dtype=torch.int64)
    group.all_reduce(flags, op=dist.ReduceOp.MAX, deadline=deadline)
    any_failed, longest = (int(v) for v in flags.tolist())
    if any_failed:
        if failed:
            return None
        raise TransportError("a peer rank of this engine failed to pack its bucket", rank=group.rank, transport=NAME)
    if not collect:
        return None
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


def _verdict(group, code: int, message: str, deadline: float) -> tuple[int, str]:
    """Broadcast the source's (code, message) to every rank of the engine group."""
    text = message.encode("utf-8", "replace")[:_MAX_MESSAGE]
    head = torch.tensor([code, len(text)], dtype=torch.int64)
    group.broadcast(head, 0, deadline=deadline)
    code, length = (int(v) for v in head.tolist())
    if length:
        body = torch.frombuffer(bytearray(text), dtype=torch.uint8) if group.rank == 0 else \
            torch.zeros(length, dtype=torch.uint8)
        group.broadcast(body, 0, deadline=deadline)
        text = body.numpy().tobytes()
    return code, text.decode("utf-8", "replace")
