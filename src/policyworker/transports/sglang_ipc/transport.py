"""sglang_ipc: colocated refit into SGLang engines, in SGLang's own request format.

Setup: ``engine_gpu_counts`` (tp ranks = GPUs of each engine) and
``engine_gpu_offsets`` (each engine's first GPU = trainer rank; default the running
sum). Colocation: trainer rank r runs on GPU r, so engine e's tp rank i is trainer
rank ``offset_e + i``. Ranks on no engine's GPUs take part in no group; their refit
is a no-op (a 0-byte report that does not advance the version).

Groups: one gloo group per engine over the trainer ranks colocated with its GPUs, in
GPU order (group rank i = engine tp rank i); group rank 0 is the engine's *gather
source* and the only rank that talks to the engine. ``connect`` builds them on the
worker's update group's store (``ctx.update_group``, from ``init_collective``) under
the prefix ``sglang_ipc/<epoch>/engine<e>``, so no extra port is needed; ``epoch``
counts layout rebuilds since the update group was formed (every trainer rank makes
the same calls, so all derive the same prefix). The same layout again is a no-op
unless a refit lost the group (``broken``) or the update group changed. Only small
CPU tensors travel on the groups: the bulk never leaves the device.

``connect`` (every rank of the engine group, in this order):
  1. all-gather (manifest digest, bucket_bytes, buckets): every rank must hold the
     same names, shapes and dtypes (``PlanMismatch``) and options (``ConfigError``);
  2. allocate this rank's flattened buffer once (largest bucket; CUDA memory or CPU
     shared memory) and gather its typed handle to the source (msgpack, not pickle).

One refit of version v (every rank, in this order):
  0. start: all-gather (v, digest, connected); the source adds whether it has an engine
     and whether the engine wants SGLang's pickled blobs. Any rank not connected (or a
     changed model) makes every rank run ``connect`` again, so collectives stay paired.
     The digest is hashed again only when a tensor object, shape or dtype changed;
  per bucket k, into buffer ``k % buffers`` (``buffers`` = 2 by default):
  1. pack k into its buffer (copies into views built once at connect) — on the GPU an
     asynchronous copy on the refit's stream, recorded by an event; the engine may
     still be loading bucket k-1 from the other buffer meanwhile (the overlap that two
     buffers buy). With one buffer the source first waits for the engine's answer to
     k-1 and a round (as in 3, verdict only) tells every rank it may repack;
  2. with two buffers the source now takes the engine's answer to bucket k-1;
  3. wait for bucket k's event (this bucket's copies only: no device-wide sync), then
     one round, an all-reduce of (pack failed, blob length, the source's verdict code
     of bucket k-1): the verdict is also the acknowledgement — no rank repacks a buffer
     before the engine answered for the bucket it held — and a failure raises the same
     error class on every rank (its message follows in a broadcast, failures only). If
     the engine wants blobs they are gathered to the source;
  4. the source calls ``engine.update_weights_from_tensor`` for bucket k (one entry per
     tp rank; ``weight_version`` on the last bucket only), bounded by the refit
     deadline. On the GPU the call is made, on this thread, after bucket k+1's copies
     were queued (the pack is asynchronous there); on the CPU it runs on a helper
     thread while this one packs k+1. No bucket is sent after a refused one.
  After the last bucket: its answer and a last round as in 3.
  An engine group of one rank (tp=1) makes no collective call at all.

An engine in this process may answer a bucket with its copies only queued, handing
over a CUDA event (``EngineResult.reading``; the in-process adapter does). In a
one-rank group the repack of that buffer then waits for the event on the device
(``Stream.wait_event``), so no host waits for a load and the GPU always has the next
load queued while the host packs; with more ranks the source waits for the event
before the round that acknowledges the bucket (the other ranks repack after it).
Events still pending when a refit fails are waited for before it returns.

The engine's side of a bucket (the call, its answer, the verdict codes) is in
:mod:`~policyworker.transports.sglang_ipc.engine_call`; the engine groups in
:mod:`~policyworker.transports.sglang_ipc.groups`.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

import torch

from policyworker.config import positive_int

from policyworker.errors import (
    ConfigError,
    PeerLost,
    PlanMismatch,
    PolicyWorkerError,
    ProtocolError,
    RefitAborted,
    RefitTimeout,
    TransportError,
)
from policyworker.wire import Decoder, Message, encode
from policyworker.transports.base import RefitReport, Transport, TransportContext
from policyworker.transports.sglang_ipc.engine_call import (
    BucketBlob,
    EngineCaller,
    answer_of,
    code_of,
    engine_request,
)
from policyworker.transports.sglang_ipc.groups import (
    EngineLayout,
    bucket_round,
    ensure_engine_group,
    gather,
    gather_all,
)
from policyworker.transports.sglang_ipc.groups import digest as cached_digest
from policyworker.transports.sglang_ipc.format import (
    BufferHandle,
    copy_tensors,
    export_buffer,
    manifest_digest,
    pack_views,
    plan_buckets,
    serialize_bucket,
)

__all__ = ["EngineLayout", "SglangIpcOptions", "SglangIpcSetup", "SglangIpcTransport"]

NAME = "sglang_ipc"


@dataclass(frozen=True, kw_only=True, slots=True)
class SglangIpcSetup:
    """Attach-time setup: the engines' GPU layout and ``bucket_bytes`` (equal on every rank)."""

    engine_gpu_counts: Any
    engine_gpu_offsets: Any = None
    bucket_bytes: int = 256 << 20
    buffers: int = 2

    def __post_init__(self) -> None:
        positive_int(self.bucket_bytes, "bucket_bytes", minimum=1024)
        if self.buffers not in (1, 2):
            raise ConfigError(f"buffers must be 1 or 2, got {self.buffers!r}", transport=NAME)
        EngineLayout.build(self.engine_gpu_counts, self.engine_gpu_offsets, 1 << 30)  # shape checks only


@dataclass(frozen=True, kw_only=True, slots=True)
class SglangIpcOptions:
    """Per-refit options. ``engine`` (on the gather source only): an ``SglangHttpEngine``, an
    ``InProcessSglangEngine`` or anything with ``update_weights_from_tensor``. The flags are
    SGLang's own (sent with the last, the first and the last bucket)."""

    engine: Any = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    torch_empty_cache: bool = False

    def __post_init__(self) -> None:
        if self.engine is not None and not callable(getattr(self.engine, "update_weights_from_tensor", None)):
            raise ConfigError(f"engine {self.engine!r} has no update_weights_from_tensor", transport=NAME)


class BufferHello(Message, frozen=True, kw_only=True):
    """A rank's buffer handles (one per pipeline slot), sent once per connect to the source."""

    handles: tuple[BufferHandle, ...]


_HELLO = Decoder(BufferHello)


class Spans:
    """Where a refit's host time went, step by step (``perf_counter`` spans, summed over buckets)."""

    __slots__ = ("seconds", "_t")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, step: str) -> None:
        """Charge the time since the last mark to ``step``."""
        now = time.perf_counter()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - self._t
        self._t = now


class SglangIpcTransport(Transport):
    """See the module docstring. ``bucket_bytes`` must match on every rank of an engine."""

    name = NAME
    Setup = SglangIpcSetup
    Options = SglangIpcOptions

    @classmethod
    def from_setup(cls, setup: SglangIpcSetup) -> SglangIpcTransport:
        return cls(bucket_bytes=setup.bucket_bytes, buffers=setup.buffers)

    def __init__(self, *, bucket_bytes: int = 256 << 20, buffers: int = 2) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1024:
            raise ConfigError(f"bucket_bytes must be an int >= 1024, got {bucket_bytes!r}", transport=NAME)
        if buffers not in (1, 2):
            raise ConfigError(f"buffers must be 1 or 2, got {buffers!r}", transport=NAME)
        self.bucket_bytes = bucket_bytes
        self.buffers = buffers
        self._closed = False
        self._engine = EngineCaller()

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
        """Build this rank's engine group (if the layout or the update group changed), then
        check manifests, allocate this rank's buffer and gather the handles to the source."""
        self._check_open()
        if ctx.setup is not None:
            await ctx.blocking(ensure_engine_group, ctx)
        if "layout" not in ctx.state:
            raise ConfigError("attach sglang_ipc with engine_gpu_counts= first", rank=ctx.rank, transport=NAME)
        if ctx.state.get("group") is not None:
            await ctx.blocking(self._connect, ctx)

    def _connect(self, ctx: TransportContext) -> None:
        state, group = ctx.state, ctx.state["group"]
        deadline = self._deadline(ctx)
        state["connected_group"] = None
        digest = manifest_digest(ctx.params)
        buckets = plan_buckets(ctx.params, self.bucket_bytes)
        mine = torch.tensor([digest, self.bucket_bytes, len(buckets), self.buffers], dtype=torch.int64)
        rows = [torch.zeros(4, dtype=torch.int64) for _ in range(group.world_size)]
        group.all_gather(rows, mine, deadline=deadline)
        rows = [r.tolist() for r in rows]
        if any(r[0] != rows[0][0] for r in rows):
            raise PlanMismatch(f"trainer ranks of engine {state.get('engine_index')} hold different tensors "
                               "(names, shapes or dtypes differ)", rank=ctx.rank, transport=NAME)
        if any(r[1:2] + r[3:] != rows[0][1:2] + rows[0][3:] for r in rows):
            raise ConfigError(f"ranks of engine {state.get('engine_index')} disagree on bucket_bytes/buffers: "
                              f"{sorted({(r[1], r[3]) for r in rows})}", rank=ctx.rank, transport=NAME)
        device = next((t.device for t in ctx.params.values()), torch.device("cpu"))
        need = max((b.nbytes for b in buckets), default=0)
        slots = 1 if len(buckets) < 2 else self.buffers  # one bucket: nothing to overlap
        bufs = state.get("buffers") or []
        if len(bufs) != slots or any(b.numel() < need or b.device != device for b in bufs):
            # They live across refits: each handle is exported once and opened once by the engine.
            made = [export_buffer(need, device) for _ in range(slots)]
            state["buffers"], state["handles"] = [b for b, _ in made], tuple(h for _, h in made)
        # The pack targets of every (slot, bucket): views built once, reused by every refit.
        state["pack_views"] = [[pack_views(b, buf) for b in buckets] for buf in state["buffers"]]
        handles = gather_all(group, encode(BufferHello(handles=state["handles"])), deadline)
        if group.rank == 0:
            # peer_handles[slot][tp rank]: what the engine request of a bucket in that slot names.
            per_rank = [_HELLO.decode(h).handles for h in handles]
            state["peer_handles"] = tuple(tuple(r[slot] for r in per_rank) for slot in range(slots))
        state["buckets"] = buckets
        state["digest"] = digest
        state["connected_group"] = group

    # -- refit -----------------------------------------------------------------------
    async def send(self, ctx: TransportContext, version: int) -> RefitReport:
        """Move refit ``version`` into the engine (``ctx.options.engine`` on the source)."""
        self._check_open()
        if "layout" not in ctx.state:
            raise ConfigError("attach sglang_ipc (connect_sglang_rollout_engines) before a refit",
                              rank=ctx.rank, transport=NAME)
        if ctx.state.get("group") is None:
            return RefitReport(transport=NAME, role="send", version=version - 1, bytes=0, seconds=0.0,
                               notes=("this rank hosts no engine GPU",))
        try:
            return await ctx.blocking(self._refit, ctx, version)
        except (RefitAborted, PeerLost):
            # The group may be out of step or dead: the next connect rebuilds it even for
            # the same layout (every rank of the engine got an error here too).
            ctx.state["broken"] = True
            raise

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

    def _start(self, ctx: TransportContext, version: int, deadline: float, settle: Any = None) -> tuple[bool, bool]:
        """The start round; returns (the engine wants blobs, connected again); raises on disagreement.
        ``settle``: a CUDA event of copies already queued into the buffers, waited for before a
        reconnect may let go of them."""
        state, group = ctx.state, ctx.state["group"]
        engine = ctx.option("engine")
        digest = cached_digest(state, ctx.params)
        connected = state.get("connected_group") is group and state.get("digest") == digest
        mine = torch.tensor([version, digest, int(connected), int(engine is not None),
                             int(bool(getattr(engine, "wants_serialized", True)))], dtype=torch.int64)
        if group.world_size == 1:
            rows = [mine.tolist()]  # nothing to agree on: no collective
        else:
            gathered = [torch.zeros(5, dtype=torch.int64) for _ in range(group.world_size)]
            group.all_gather(gathered, mine, deadline=deadline)
            rows = [r.tolist() for r in gathered]
        if any(r[0] != version for r in rows):
            raise ProtocolError(f"ranks of engine {state.get('engine_index')} are at different refit versions: "
                                f"{[r[0] for r in rows]}", rank=ctx.rank, transport=NAME)
        if not rows[0][3]:
            raise ConfigError(f"the gather source (trainer rank {state.get('gather_src')}) of engine "
                              f"{state.get('engine_index')} was given no engine", rank=ctx.rank, transport=NAME)
        again = not all(r[2] for r in rows) or any(r[1] != rows[0][1] for r in rows)
        if again:
            if settle is not None:
                settle.synchronize()
            self._connect(ctx)  # every rank takes this branch: the rows are the same everywhere
        return bool(rows[0][4]), again

    def _refit_body(self, ctx: TransportContext, version: int) -> RefitReport:
        t0 = time.perf_counter()
        spans = Spans()
        state, group = ctx.state, ctx.state["group"]
        deadline = self._deadline(ctx)
        early = None
        if group.world_size == 1 and state.get("connected_group") is group and state.get("buckets"):
            # One rank: nothing to agree on before the first copy, so bucket 0 is queued before
            # the start checks (their host time would leave the GPU idle). Its copies write only
            # this rank's buffer: a changed model costs a repack, never a wrong byte sent.
            early = self._pack(ctx, 0, 0, self._pack_stream(state), [None])
        wants_blobs, again = self._start(ctx, version, deadline, settle=None if early is None else early[0])
        if early is not None and (again or early[1] is not None):
            if early[0] is not None:
                early[0].synchronize()
            early = None  # packed again below, into the buffers of the new connect
        spans.mark("start")
        buckets, bufs = state["buckets"], state["buffers"]
        is_src = group.rank == 0
        cuda = bufs[0].device.type == "cuda"
        stream = None
        if cuda:
            stream = state["stream"] if early is not None else self._pack_stream(state)
        # On the GPU the pack is asynchronous: bucket k+1's copies are queued before the
        # engine is called for bucket k, on this thread, and the two overlap on the device.
        # On the CPU the pack is this thread's own work, so the engine call goes to a helper.
        inline = cuda
        pending: Any = None  # the engine call of the previous bucket: a Future, or a deferred call (inline)
        # An in-process engine on this device may answer with its copies only queued
        # (EngineResult.reading). With no other rank to tell, the repack of that slot waits
        # for them on the device and no host waits for a load; otherwise the host waits.
        reading: list[Any] = [None] * len(bufs)
        device_acks = cuda and group.world_size == 1
        total = 0
        try:
            for layout in buckets:
                k = layout.index
                slot = k % len(bufs)
                payload, failure, done = b"", None, None
                if len(bufs) == 1 and k > 0:
                    # One buffer: the engine must have answered for bucket k-1 before it is repacked.
                    answer, pending = self._engine.take(pending, deadline, reading, k - 1, device_acks), None
                    spans.mark("engine")
                    bucket_round(ctx, version, k - 1, False, 0, answer, deadline)
                    spans.mark("round")
                if k == 0 and early is not None:
                    done, failure = early
                else:
                    done, failure = self._pack(ctx, k, slot, stream, reading)
                spans.mark("pack")
                answer = (0, "")
                if len(bufs) > 1 and k > 0:
                    # Bucket k's slot was bucket k-2's, answered a round ago; k-1 is answered
                    # now, after k was packed, so the pack overlapped the engine's load of k-1.
                    answer, pending = self._engine.take(pending, deadline, reading, k - 1, device_acks), None
                    spans.mark("engine")
                try:
                    if done is not None:
                        done.synchronize()  # this bucket's copies only: the engine reads it from another process
                    spans.mark("pack_wait")
                    if wants_blobs and failure is None:
                        blob = serialize_bucket(bufs[slot].narrow(0, 0, layout.nbytes), layout.metadata)
                        payload = encode(BucketBlob(version=version, bucket=k, blob=blob))
                except (RuntimeError, ValueError, PolicyWorkerError) as exc:
                    failure = exc
                spans.mark("blobs")
                # One round per bucket: every rank's "bucket k is packed" and the source's
                # verdict of bucket k-1 (the acknowledgement that lets the ranks repack).
                longest = bucket_round(ctx, version, k - 1, failure is not None, len(payload), answer, deadline)
                gathered = gather(group, payload, longest, deadline) if wants_blobs and failure is None else None
                spans.mark("round")
                if failure is not None:
                    raise TransportError(f"packing bucket {k} failed: {failure}",
                                         rank=ctx.rank, transport=NAME) from failure
                if is_src:
                    call = (self._call_engine, ctx, version, layout, gathered, wants_blobs, deadline)
                    pending = call if inline else self._engine.submit(*call)
                spans.mark("submit")
                total += layout.nbytes
            if buckets:
                answer, pending = self._engine.take(pending, deadline, reading, buckets[-1].index, False), None
                spans.mark("engine")
                bucket_round(ctx, version, buckets[-1].index, False, 0, answer, deadline)
                spans.mark("round")
        finally:
            if isinstance(pending, concurrent.futures.Future):
                # An error above: let the engine call finish before the buffers are reused.
                pending.cancel() or concurrent.futures.wait([pending], timeout=max(0.0, deadline - time.monotonic()))
            for event in reading:
                if event is not None:  # an error above: the engine's queued copies end before we leave
                    event.synchronize()
        state["last_spans"] = spans.seconds
        return RefitReport(transport=NAME, role="send", version=version, bytes=total,
                           seconds=time.perf_counter() - t0, buckets=len(buckets),
                           peak_extra_bytes=int(sum(b.numel() for b in bufs)))

    @staticmethod
    def _pack_stream(state: dict) -> torch.cuda.Stream | None:
        """The transport's copy stream (None for CPU buffers), ordered after the current stream."""
        device = state["buffers"][0].device
        if device.type != "cuda":
            return None
        # Packing runs on the transport's own stream, after whatever the trainer queued
        # on its stream (the weights are final there), so it can overlap the engine's
        # load of the previous bucket instead of queueing behind it.
        stream = state.get("stream")
        if stream is None or stream.device != device:
            stream = state["stream"] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    @staticmethod
    def _pack(ctx: TransportContext, k: int, slot: int, stream: Any, reading: list[Any]) -> tuple[Any, Any]:
        """Copy bucket ``k`` into buffer ``slot`` (queued on ``stream`` on the GPU, after the
        engine's copies out of that slot when it handed over their event).

        Returns (the CUDA event after the copies, or None on the CPU; the error, or None).
        """
        names, dsts = ctx.state["pack_views"][slot][k]
        done = failure = None
        try:
            if stream is None:
                copy_tensors(dsts, [ctx.params[n] for n in names])
            else:
                with torch.cuda.stream(stream):
                    if reading[slot] is not None:
                        stream.wait_event(reading[slot])  # the engine's copies out of this slot
                        reading[slot] = None
                    try:
                        copy_tensors(dsts, [ctx.params[n] for n in names])
                    finally:  # also after a failed copy: what was queued ends before the buffer is let go
                        done = torch.cuda.Event()
                        done.record(stream)
        except (RuntimeError, ValueError, KeyError, PolicyWorkerError) as exc:
            failure = exc
        return done, failure

    def _call_engine(self, ctx: TransportContext, version: int, layout: Any, gathered: Any, wants_blobs: bool,
                     deadline: float) -> tuple[int, str, Any]:
        """The source's one ``update_weights_from_tensor`` call for bucket ``layout``, bounded by
        the time left; its answer as (code, message, reading event or None)."""
        try:
            request = engine_request(ctx, version, layout, gathered, wants_blobs)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RefitTimeout("no time left for the engine call")
            result = ctx.option("engine").update_weights_from_tensor(request, timeout_s=remaining)
        except PolicyWorkerError as exc:
            return code_of(exc), f"{type(exc).__name__}: {exc}", None
        return answer_of(result)

    async def aclose(self) -> None:
        self._closed = True
        self._engine.close()
