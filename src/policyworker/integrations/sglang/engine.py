"""InProcessSglangEngine: our RolloutWorkers behind SGLang's ``update_weights_from_tensor``.

The adapter stands where an SGLang engine would: the engine's gather source calls it
once per bucket with the request *object* (no bytes to decode). Entry ``i`` of the
request is for tp rank ``i``, i.e. ``workers[i]``. The adapter opens each trainer
rank's shared buffer from its typed handle (once; the handle is the same every
bucket), rebuilds the bucket's tensors with SGLang's rule (a fixed function:
``flat[start:end].view(dtype).reshape(shape)``) and loads them into the worker's
params in the generation layout. The trainer rank this adapter lives in is one of
those ranks: its own CUDA buffer comes back as the buffer itself (``open_buffer``).

Each (trainer buffer, bucket) is checked once — every tensor's name, shape and dtype
against the worker's params — into a plan of copies that later refits reuse while
the workers hold the same destination tensors (checked by identity). With the
default loader, tensors adjacent in the bucket whose destinations are adjacent in one
storage (a flat arena) are loaded as one byte copy; other loaders get one call per
tensor. On CUDA the copies run on the adapter's own stream, which waits (on the
device) for the current stream at a refit's first bucket; the answer to a bucket is
what allows the trainer ranks to repack their buffers, so the adapter waits for an
event after its copies (not a stream or device sync) before it answers — except with
``answer_queued`` (default), when a bucket's copies all run on one device: it then
answers once they are queued, handing the event over (``EngineResult.reading``), and
the trainer orders its repack of that buffer after the event on the device, so no
host waits for a load (the GPU never idles between buckets for it). The bucket that
carries ``weight_version`` always waits (its commit needs every byte landed), as does
a failed one. ``close()`` lets go of the opened buffers (call it before the trainers
exit).

Versions go through each worker's :class:`~policyworker.ledger.WeightLedger` — the
one commit path, one ledger transaction per worker and refit: the first bucket of a
refit opens it (``weights()`` refuses while it is in flight); bytes land in place; the
bucket that carries ``weight_version`` commits it, and only when every param of every
worker was received (manifest check). A failed bucket after bytes landed leaves the
workers *torn* (``weights()`` raises ``TornWeights``) at their last committed version
until a full refit commits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from policyworker.errors import ConfigError, PolicyWorkerError
from policyworker.ledger import Transaction
from policyworker.workers.rollout import RolloutWorker
from policyworker.transports.sglang_ipc.client import EngineResult, UpdateWeightsFromTensorRequest
from policyworker.transports.base import RefitReport
from policyworker.transports.sglang_ipc.format import (
    BufferHandle,
    FlattenedTensorMetadata,
    copy_tensors,
    open_buffer,
    reconstruct,
)

__all__ = ["InProcessSglangEngine", "Loader", "direct_loader"]

#: ``loader(worker, name, tensor)`` writes one received tensor into ``worker.params``.
Loader = Callable[[RolloutWorker, str, torch.Tensor], None]


def direct_loader(worker: RolloutWorker, name: str, tensor: torch.Tensor) -> None:
    """SGLang's ``load_format="direct"`` rule: same name, same shape, copy."""
    worker.params[name].copy_(tensor)


class InProcessSglangEngine:
    """An engine of ``len(workers)`` tp ranks whose weights live in ``workers``.

    ``loader`` writes a received (full) tensor into a worker (default: exact copy of
    the same name; a sharding loader may narrow it to the worker's shard and then
    ``check_shapes=False``). ``require_all``: commit only when every param was received.
    ``answer_queued``: on CUDA, answer a bucket once its copies are queued (see the module
    docstring); False: once they finished, as SGLang does.
    """

    wants_serialized = False

    def __init__(
        self,
        workers: Sequence[RolloutWorker],
        *,
        loader: Loader = direct_loader,
        check_shapes: bool = True,
        require_all: bool = True,
        answer_queued: bool = True,
    ) -> None:
        self.workers = list(workers)
        if not self.workers or not all(isinstance(w, RolloutWorker) for w in self.workers):
            raise ConfigError("InProcessSglangEngine needs at least one RolloutWorker (one per tp rank)")
        self.loader = loader
        self.check_shapes = check_shapes
        self.require_all = require_all
        self.answer_queued = bool(answer_queued)
        self._buffers: dict[BufferHandle, torch.Tensor] = {}
        self._next_bucket = 0
        self._seen: list[set[str]] = []
        self._touched = False
        self._txs: list[Transaction] = []  # the refit in flight: one ledger transaction per worker
        self._used: set[BufferHandle] = set()  # handles the current (or last) refit named
        self._bytes = 0
        self._plans: dict[tuple[int, BufferHandle, int], _BucketPlan] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._t0 = 0.0
        self.calls = 0
        self.spans: dict[str, float] = {}  # host seconds per step, summed over the current refit's buckets
        self.last_request: UpdateWeightsFromTensorRequest | None = None

    def __repr__(self) -> str:
        return f"InProcessSglangEngine(tp={len(self.workers)})"

    def close(self) -> None:
        """Let go of every opened trainer buffer (they are opened again when needed)."""
        self._buffers.clear()
        self._plans.clear()  # they hold views of the buffers

    def _buffer(self, handle: BufferHandle) -> torch.Tensor:
        buf = self._buffers.get(handle)
        if buf is None:
            buf = self._buffers[handle] = open_buffer(handle)
        return buf

    def update_weights_from_tensor(
        self, request: UpdateWeightsFromTensorRequest, *, timeout_s: float | None = None
    ) -> EngineResult:
        """Apply one bucket; never raises for a bad bucket (answers ``success=False``)."""
        self.calls += 1
        self.last_request = request
        if request.bucket == 0:
            self.spans = {}
            self._next_bucket, self._bytes, self._t0 = 0, 0, time.perf_counter()
            self._seen = [set() for _ in self.workers]
            self.fail_refit(True)  # the last refit never finished: it touched, or may have
            self._touched = False
            self._txs = [w.ledger.transaction(w.ledger.version + 1).open() for w in self.workers]
            # A reconnected trainer rank exported new buffers: drop those the last refit did
            # not use either (the trainers alternate between their buffers bucket by bucket).
            for stale in set(self._buffers) - set(request.buffers) - self._used:
                del self._buffers[stale]
                self._plans = {k: v for k, v in self._plans.items() if k[1] != stale}
            self._used = set()
        self._used.update(request.buffers)
        try:
            reading = self._apply(request)
        except (PolicyWorkerError, RuntimeError, ValueError) as exc:
            self._next_bucket = -1
            self.fail_refit(self._touched)
            # SGLang answers (False, message) when a load fails; so do we, and the
            # transport raises it on every trainer rank of this engine.
            return EngineResult(success=False, message=f"{type(exc).__name__}: {exc}")
        return EngineResult(success=True, message="Success", reading=reading)

    def _apply(self, request: UpdateWeightsFromTensorRequest) -> torch.cuda.Event | None:
        """Load one bucket; returns the event its queued copies end at (None: they finished)."""
        n = len(self.workers)
        if request.load_format != "flattened_bucket":
            raise ValueError(f"load_format {request.load_format!r} is not supported in process")
        if len(request.buffers) != n:
            raise ValueError(f"request has {len(request.buffers)} entries for an engine of {n} tp ranks")
        if request.bucket != self._next_bucket:
            raise ValueError(f"bucket {request.bucket} arrived, bucket {self._next_bucket} was expected")
        tick = time.perf_counter()
        # Every tensor of every rank is checked before the first byte lands: a bad bucket
        # then leaves the live weights as they were. The checks run when a (buffer, bucket)
        # is first seen; later refits only confirm that the same destinations are still there.
        plans = [self._plan(i, h, request) for i, h in enumerate(request.buffers)]
        tick = self._span("check", tick)
        reading = None
        try:
            streams: dict[torch.device, torch.cuda.Stream] = {}
            loaded = False
            try:
                with torch.no_grad():
                    for i, plan in enumerate(plans):
                        if plan.names and not self._touched:
                            # Torn from the first byte until the commit: the trainer side may fail
                            # between buckets without this adapter ever hearing of it.
                            self._touched = True
                            for tx in self._txs:
                                tx.touched = True
                            for w in self.workers:
                                w.ledger.mark_torn()
                        stream = self._stream(plan.device, request.bucket == 0)
                        if stream is not None:
                            streams[plan.device] = stream
                            with torch.cuda.stream(stream):
                                self._load(self.workers[i], plan)
                        else:
                            self._load(self.workers[i], plan)
                        self._seen[i].update(plan.names)
                        self._bytes += plan.nbytes
                loaded = True
            finally:
                tick = self._span("load", tick)
                # Also after a failed load: the trainers repack the buffer once we answer.
                # This bucket's copies only (an event on our own stream), not a stream sync.
                events = []
                for stream in streams.values():
                    event = torch.cuda.Event()
                    event.record(stream)
                    events.append(event)
                if (loaded and self.answer_queued and len(events) == 1
                        and request.weight_version is None):
                    reading = events[0]  # the trainer waits for it on the device
                else:
                    for event in events:
                        event.synchronize()
                self._span("load_wait", tick)
            self._next_bucket += 1
            if request.weight_version is not None:
                self._commit(request)
            return reading
        except BaseException:
            self._next_bucket = -1  # a failed refit: only a new one (bucket 0) is accepted
            self.fail_refit(self._touched)
            raise

    def fail_refit(self, touched: bool | None) -> None:
        """End the refit in flight (if any) as failed; ``touched``: live bytes were (or may
        have been) written. For a refit given up outside this adapter, e.g. its trainer
        stopped waiting for a bucket's answer."""
        txs, self._txs = self._txs, []
        for tx in txs:
            if not tx.done:
                tx.touched = touched
                tx.close()

    def _stream(self, device: torch.device, first: bool) -> torch.cuda.Stream | None:
        """This adapter's copy stream on ``device`` (None on CPU); at a refit's first bucket it
        waits (on the device) for what the device's current stream queued, e.g. generation."""
        if device.type != "cuda":
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
            first = True
        if first:
            stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def _plan(self, i: int, handle: BufferHandle, request: UpdateWeightsFromTensorRequest) -> _BucketPlan:
        worker = self.workers[i]
        worker.ensure_open()
        key = (i, handle, request.bucket)
        plan = self._plans.get(key)
        if plan is not None and (plan.metadata is request.metadata or plan.metadata == request.metadata):
            params = worker.params
            if all(params.get(name) is dst for name, dst in zip(plan.names, plan.dsts)):
                return plan
        plan = self._plans[key] = self._build_plan(worker, self._buffer(handle), tuple(request.metadata))
        return plan

    def _build_plan(self, worker: RolloutWorker, buffer: torch.Tensor,
                    metadata: tuple[FlattenedTensorMetadata, ...]) -> _BucketPlan:
        received = reconstruct(buffer, metadata)
        names, dsts, srcs = [], [], []
        for name, t in received:
            dst = worker.params.get(name)
            if dst is None:
                raise ValueError(f"tp rank {worker.rank} has no param {name!r}")
            if self.check_shapes and (dst.shape != t.shape or dst.dtype != t.dtype):
                raise ValueError(f"{name!r} arrived as {t.dtype}{list(t.shape)}, tp rank {worker.rank} "
                                 f"holds {dst.dtype}{list(dst.shape)}")
            names.append(name)
            dsts.append(dst)
            srcs.append(t)
        nbytes = sum(t.numel() * t.element_size() for t in srcs)
        runs = None
        if self.loader is direct_loader and self.check_shapes:
            runs = _coalesce(metadata, buffer, dsts)
        return _BucketPlan(metadata=metadata, names=tuple(names), dsts=tuple(dsts), srcs=tuple(srcs),
                           runs=runs, nbytes=nbytes, device=buffer.device)

    def _load(self, worker: RolloutWorker, plan: _BucketPlan) -> None:
        if plan.runs is not None:
            copy_tensors(plan.runs[0], plan.runs[1])
            return
        for name, t in zip(plan.names, plan.srcs):
            self.loader(worker, name, t)

    def _span(self, step: str, t: float) -> float:
        now = time.perf_counter()
        self.spans[step] = self.spans.get(step, 0.0) + now - t
        return now

    def _commit(self, request: UpdateWeightsFromTensorRequest) -> None:
        version = int(request.weight_version)  # ValueError: not one of our versions
        if self.require_all:
            for worker, seen in zip(self.workers, self._seen):
                missing = set(worker.params) - seen
                if missing:
                    raise ValueError(f"refit {version} never sent {len(missing)} param(s) of tp rank "
                                     f"{worker.rank}, e.g. {sorted(missing)[0]!r}; not committed")
        seconds = time.perf_counter() - self._t0
        for worker, tx in zip(self.workers, self._txs):
            tx.commit(version)
            worker.last_report = RefitReport(
                transport="sglang_ipc", role="receive", version=version, bytes=self._bytes // len(self.workers),
                seconds=seconds, buckets=request.num_buckets,
            )


@dataclass(frozen=True, slots=True)
class _BucketPlan:
    """One tp rank's share of one bucket, checked once: destinations, sources, copies."""

    metadata: tuple[FlattenedTensorMetadata, ...]
    names: tuple[str, ...]
    dsts: tuple[torch.Tensor, ...]
    srcs: tuple[torch.Tensor, ...]  # views of the trainer's buffer, SGLang's rebuild rule
    runs: tuple[list[torch.Tensor], list[torch.Tensor]] | None  # (dsts, srcs) of the direct copies
    nbytes: int
    device: torch.device


def _coalesce(metadata: Sequence[FlattenedTensorMetadata], buffer: torch.Tensor,
              dsts: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The direct loader's copies, merged where the bytes are adjacent on both sides.

    Tensors that follow each other in the bucket with no padding and whose destinations
    follow each other in one storage (a flat parameter arena) become one byte copy;
    anything else stays one copy per tensor.
    """
    runs: list[list[int]] = []  # [bucket start, bucket end, dst storage ptr, dst byte end, first index]
    for j, (meta, dst) in enumerate(zip(metadata, dsts)):
        if meta.numel == 0:
            continue
        if not dst.is_contiguous():
            runs.append([meta.start_idx, meta.end_idx, -1, -1, j])
            continue
        base = dst.untyped_storage().data_ptr()
        start = dst.storage_offset() * dst.element_size()
        last = runs[-1] if runs else None
        if last is not None and last[2] == base and last[1] == meta.start_idx and last[3] == start:
            last[1], last[3] = meta.end_idx, start + meta.numel
        else:
            runs.append([meta.start_idx, meta.end_idx, base, start + meta.numel, j])
    out_d, out_s = [], []
    for b0, b1, base, _, j in runs:
        dst = dsts[j]
        if base == -1:  # a strided destination: its own copy, SGLang's view as the source
            out_d.append(dst)
            out_s.append(buffer[b0:b1].view(dst.dtype).reshape(dst.shape))
            continue
        out_d.append(torch.empty(0, dtype=torch.uint8, device=dst.device).set_(
            dst.untyped_storage(), dst.storage_offset() * dst.element_size(), (b1 - b0,)))
        out_s.append(buffer[b0:b1])
    return out_d, out_s
