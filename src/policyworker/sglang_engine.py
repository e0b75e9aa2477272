"""InProcessSglangEngine: our RolloutWorkers behind SGLang's ``update_weights_from_tensor``.

The adapter stands where an SGLang engine would: the engine's gather source calls it
once per bucket with the request *object* (no bytes to decode). Entry ``i`` of the
request is for tp rank ``i``, i.e. ``workers[i]``. The adapter opens each trainer
rank's shared buffer from its typed handle (once; the handle is the same every
bucket), rebuilds the bucket's tensors with SGLang's rule (a fixed function:
``flat[start:end].view(dtype).reshape(shape)``) and loads them into the worker's
params in the generation layout. The trainer rank this adapter lives in is one of
those ranks: its own CUDA buffer comes back as the buffer itself (``open_buffer``).

On CUDA the loads are asynchronous, and the answer to a bucket is what allows the
trainer ranks to repack their buffers: so the adapter waits for its copies before it
answers. ``close()`` lets go of the opened buffers (call it before the trainers exit).

Versions go through each worker's :class:`~policyworker.ledger.WeightLedger` — the
one commit path: the first bucket of a refit begins it (``weights()`` refuses while
it is in flight); bytes land in place; the bucket that carries ``weight_version``
commits it, and only when every param of every worker was received (manifest
check). A failed bucket after bytes landed leaves the workers *torn* (``weights()``
raises ``TornWeights``) at their last committed version until a full refit commits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .errors import ConfigError, PolicyWorkerError
from .rollout import RolloutWorker
from .sglang_client import EngineResult, UpdateWeightsFromTensorRequest
from .transports.base import RefitReport
from .transports.sglang_format import BufferHandle, open_buffer, reconstruct

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
    """

    wants_serialized = False

    def __init__(
        self,
        workers: Sequence[RolloutWorker],
        *,
        loader: Loader = direct_loader,
        check_shapes: bool = True,
        require_all: bool = True,
    ) -> None:
        self.workers = list(workers)
        if not self.workers or not all(isinstance(w, RolloutWorker) for w in self.workers):
            raise ConfigError("InProcessSglangEngine needs at least one RolloutWorker (one per tp rank)")
        self.loader = loader
        self.check_shapes = check_shapes
        self.require_all = require_all
        self._buffers: dict[BufferHandle, torch.Tensor] = {}
        self._next_bucket = 0
        self._seen: list[set[str]] = []
        self._touched = False
        self._used: set[BufferHandle] = set()  # handles the current (or last) refit named
        self._bytes = 0
        self._t0 = 0.0
        self.calls = 0
        self.last_request: UpdateWeightsFromTensorRequest | None = None

    def __repr__(self) -> str:
        return f"InProcessSglangEngine(tp={len(self.workers)})"

    def close(self) -> None:
        """Let go of every opened trainer buffer (they are opened again when needed)."""
        self._buffers.clear()

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
            self._next_bucket, self._bytes, self._t0 = 0, 0, time.perf_counter()
            self._seen = [set() for _ in self.workers]
            self._touched = False
            for worker in self.workers:
                if worker.ledger.in_flight:  # the last refit never finished: it touched, or may have
                    worker.ledger.fail(True)
                worker.ledger.begin(worker.ledger.version + 1)
            # A reconnected trainer rank exported new buffers: drop those the last refit did
            # not use either (the trainers alternate between their buffers bucket by bucket).
            for stale in set(self._buffers) - set(request.buffers) - self._used:
                del self._buffers[stale]
            self._used = set()
        self._used.update(request.buffers)
        try:
            self._apply(request)
        except (PolicyWorkerError, RuntimeError, ValueError) as exc:
            self._next_bucket = -1
            for worker in self.workers:
                if worker.ledger.in_flight:
                    worker.ledger.fail(self._touched)
            # SGLang answers (False, message) when a load fails; so do we, and the
            # transport raises it on every trainer rank of this engine.
            return EngineResult(success=False, message=f"{type(exc).__name__}: {exc}")
        return EngineResult(success=True, message="Success")

    def _apply(self, request: UpdateWeightsFromTensorRequest) -> None:
        n = len(self.workers)
        if request.load_format != "flattened_bucket":
            raise ValueError(f"load_format {request.load_format!r} is not supported in process")
        if len(request.buffers) != n:
            raise ValueError(f"request has {len(request.buffers)} entries for an engine of {n} tp ranks")
        if request.bucket != self._next_bucket:
            raise ValueError(f"bucket {request.bucket} arrived, bucket {self._next_bucket} was expected")
        received = [reconstruct(self._buffer(h), request.metadata) for h in request.buffers]
        # Check every tensor of every rank before the first byte lands: a bad bucket
        # then leaves the live weights as they were.
        for worker, tensors in zip(self.workers, received):
            worker._ensure_open()
            for name, t in tensors:
                dst = worker.params.get(name)
                if dst is None:
                    raise ValueError(f"tp rank {worker.rank} has no param {name!r}")
                if self.check_shapes and (dst.shape != t.shape or dst.dtype != t.dtype):
                    raise ValueError(f"{name!r} arrived as {t.dtype}{list(t.shape)}, tp rank {worker.rank} "
                                     f"holds {dst.dtype}{list(dst.shape)}")
        try:
            try:
                with torch.no_grad():
                    for i, (worker, tensors) in enumerate(zip(self.workers, received)):
                        if tensors and not self._touched:
                            # Torn from the first byte until the commit: the trainer side may fail
                            # between buckets without this adapter ever hearing of it.
                            self._touched = True
                            for w in self.workers:
                                w.ledger.mark_torn()
                        for name, t in tensors:
                            self.loader(worker, name, t)
                            self._seen[i].add(name)
                            self._bytes += t.numel() * t.element_size()
            finally:
                _wait_for_copies(received, self.workers)  # also after a failed load: the buffer is reused
            self._next_bucket += 1
            if request.weight_version is not None:
                self._commit(request)
        except BaseException:
            self._next_bucket = -1  # a failed refit: only a new one (bucket 0) is accepted
            for worker in self.workers:
                if worker.ledger.in_flight:
                    worker.ledger.fail(self._touched)
            raise

    def _commit(self, request: UpdateWeightsFromTensorRequest) -> None:
        version = int(request.weight_version)  # ValueError: not one of our versions
        if self.require_all:
            for worker, seen in zip(self.workers, self._seen):
                missing = set(worker.params) - seen
                if missing:
                    raise ValueError(f"refit {version} never sent {len(missing)} param(s) of tp rank "
                                     f"{worker.rank}, e.g. {sorted(missing)[0]!r}; not committed")
        seconds = time.perf_counter() - self._t0
        for worker in self.workers:
            worker.ledger.commit(version)
            worker.last_report = RefitReport(
                transport="sglang_ipc", role="receive", version=version, bytes=self._bytes // len(self.workers),
                seconds=seconds, buckets=request.num_buckets,
            )


def _wait_for_copies(received: list[list[tuple[str, torch.Tensor]]], workers: Sequence[RolloutWorker]) -> None:
    """Block until the CUDA copies out of the trainers' buffers are done (no-op on CPU)."""
    # Sources and this bucket's destinations only: a per-bucket walk over every param costs ~1 us each.
    devices = {t.device for tensors in received for _, t in tensors[:1]}
    devices |= {w.params[name].device for w, tensors in zip(workers, received) for name, _ in tensors
                if name in w.params}
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
