"""CommGroup: one independent process group whose every operation is bounded and abortable.

Collectives and point-to-point ops are issued asynchronously and completed by
:meth:`CommGroup.wait`, which waits for the work against a deadline and against the
group's abort flag (gloo works through the group's waiter thread,
:mod:`~policyworker.runtime.comm_waiter`; NCCL works are polled). ``abort()`` (any
thread) sets the flag and aborts the backend where it can; ``close()`` releases the
group, and an exit hook releases groups nobody closed. Building groups:
:mod:`~policyworker.runtime.comm_setup`; the import path users know:
:mod:`~policyworker.runtime.comm`.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist

from policyworker.errors import PeerLost, RefitAborted, RefitTimeout, translate_comm_error
from policyworker.runtime.comm_setup import _first_line
from policyworker.runtime.comm_waiter import Waiter, finished

__all__ = ["CommGroup"]

_log = logging.getLogger(__name__)
#: A point-to-point tag no refit uses: the probes that close a dying group's pairs.
_RELEASE_TAG = (1 << 30) + 7
#: How long closing a group waits for its waiter thread to leave gloo.
_RELEASE_JOIN_S = 5.0

# Poll backoff for work handles: start tight (small messages finish in microseconds),
# grow to 1 ms so a long transfer does not burn a core spinning.
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


class CommGroup:
    """One independent process group with bounded, abortable operations.

    Not thread-safe except :meth:`abort`, which any thread may call at any time.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        backend: str,
        name: str,
        timeout_s: float,
        owner_store: dist.TCPStore | None,
        device: torch.device | None = None,
    ) -> None:
        self.pg = pg
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.name = name
        self.timeout_s = timeout_s
        self._owner_store = owner_store  # keep the master store alive as long as the group
        self._aborted = threading.Event()
        self._cond = threading.Condition()
        self._waiter: Waiter | None = None
        self._closed = False
        _LIVE.add(self)
        # NCCL: the worker's own device, fixed at construction — never the current device of
        # whichever thread happens to issue an operation.
        if backend == "nccl":
            self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    # -- state ---------------------------------------------------------------------
    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def abort(self) -> None:
        """Abort every pending and future operation of this group (any thread, non-blocking).

        Waiters raise ``RefitAborted``. For NCCL the communicator is aborted too, so
        kernels blocked on a dead peer return.
        """
        if self._aborted.is_set():
            return
        self._aborted.set()
        self._notify()
        if self.backend == "nccl":
            # NCCL kernels spin on the GPU until the communicator is aborted; gloo waits
            # are already unblocked by our polling and the pair dies with the group.
            abort = getattr(self.pg, "abort", None)
            if abort is not None:
                try:
                    abort()
                except RuntimeError:
                    pass  # already torn down: aborting twice is not an error for us

    def close(self) -> None:
        """Release the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._aborted.set()
        self._notify()
        if self._waiter is not None:
            if self._waiter.busy:
                self._release_pending()
            self._waiter.stop()
            self._waiter.join(_RELEASE_JOIN_S)
        shutdown = getattr(self.pg, "shutdown", None) if self.backend == "nccl" else None
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass  # a dead communicator cannot be shut down twice; nothing to release
        self.pg = None  # type: ignore[assignment]
        self._owner_store = None

    def _release_pending(self) -> None:
        """End this group's pending gloo works (a stale receive whose sender gave up, a send
        nobody will receive), so that the waiter thread returns from C++.

        gloo has no cancel for a posted point-to-point op; its one lever from outside is an
        application-side timeout, which closes the pair it happened on and fails every op
        pending there. So: one probe receive per peer, on a tag nothing else uses, waited
        for 1 ms. Only for a group that is being closed (dead to us already): its peers
        then see the connection closed (``PeerLost``) instead of waiting for a deadline.
        """
        pg = self.pg
        if pg is None or self.backend != "gloo":
            return
        probe = torch.zeros(1, dtype=torch.uint8)
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            try:
                pg.recv([probe], peer, _RELEASE_TAG).wait(_dt.timedelta(milliseconds=1))
            except RuntimeError as exc:  # the timeout that closes the pair (or it is closed already)
                _log.debug("group %r: released pending works with peer %d (%s)", self.name, peer, _first_line(exc))

    # -- waiting -------------------------------------------------------------------
    def _completion(self, work) -> Future:
        """A future that completes with ``work``.

        gloo's point-to-point works only make progress inside ``work.wait()`` (their
        ``is_completed()`` stays False and they have no future), and that wait cannot
        be interrupted. So gloo works are waited on by one waiter thread per group, in
        issue order, and the caller waits on the future, where an abort can reach it.
        NCCL works complete on the GPU; ``is_completed()`` polls their CUDA event.
        """
        if self._waiter is None:
            self._waiter = Waiter(f"policyworker-wait-{self.name}")
        future: Future = Future()
        future.add_done_callback(self._notify)
        self._waiter.submit(work, future)
        return future

    def _notify(self, _future=None) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait(self, work, *, deadline: float | None = None, what: str = "collective") -> None:
        """Complete ``work`` before ``deadline`` (``time.monotonic()`` seconds).

        Raises ``RefitAborted`` when the group is aborted, ``RefitTimeout`` past the
        deadline, ``PeerLost`` when the peer went away; never hangs.
        """
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        if self.backend == "nccl" and not isinstance(work, Future):
            self._poll(work, deadline, what)
            return
        future = work if isinstance(work, Future) else self._completion(work)
        with self._cond:
            while not future.done():
                if self._aborted.is_set():
                    raise RefitAborted(f"{what} on group {self.name!r} was aborted", rank=self.rank)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RefitTimeout(f"{what} on group {self.name!r} did not finish in time", rank=self.rank)
                self._cond.wait(remaining)
        exc = future.exception()
        if exc is not None:
            if self._aborted.is_set():
                raise RefitAborted(f"{what} on group {self.name!r} was aborted", rank=self.rank) from exc
            raise translate_comm_error(exc, rank=self.rank, what=f"{what} on group {self.name!r}") from exc

    def _poll(self, work, deadline: float, what: str) -> None:
        pause = _POLL_MIN_S
        while True:
            if self._aborted.is_set():
                raise RefitAborted(f"{what} on group {self.name!r} was aborted", rank=self.rank)
            try:
                if work.is_completed():
                    work.wait()
                    return
            except Exception as exc:  # torch raises RuntimeError/DistBackendError subclasses
                if self._aborted.is_set():
                    raise RefitAborted(f"{what} on group {self.name!r} was aborted", rank=self.rank) from exc
                raise translate_comm_error(exc, rank=self.rank, what=f"{what} on group {self.name!r}") from exc
            if time.monotonic() >= deadline:
                # Abort the communicator itself: the kernel stuck on a dead peer returns, and
                # NCCL's own watchdog never gets to tear the process down.
                self.abort()
                raise RefitTimeout(f"{what} on group {self.name!r} did not finish in time; its communicator "
                                   f"was aborted", rank=self.rank)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def wait_all(self, works: Sequence, *, deadline: float | None = None, what: str = "collective") -> None:
        for w in works:
            self.wait(w, deadline=deadline, what=what)

    def _guard(self) -> None:
        if self._closed or self.pg is None:
            raise RefitAborted(f"group {self.name!r} is closed", rank=self.rank)
        if self._aborted.is_set():
            raise RefitAborted(f"group {self.name!r} was aborted", rank=self.rank)

    # -- operations (issue + wait) -------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int, *, deadline: float | None = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.wait(self._issue(self.pg.broadcast, [tensor], opts, what="broadcast"), deadline=deadline,
                  what="broadcast")

    def all_reduce(self, tensor: torch.Tensor, *, op=dist.ReduceOp.SUM, deadline: float | None = None) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.wait(self._issue(self.pg.allreduce, [tensor], opts, what="all_reduce"), deadline=deadline,
                  what="all_reduce")

    def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor, *, deadline: float | None = None) -> None:
        self.wait(self._issue(self.pg.allgather, [out], [tensor], what="all_gather"), deadline=deadline,
                  what="all_gather")

    def barrier(self, *, deadline: float | None = None) -> None:
        # A tiny all_reduce instead of pg.barrier(): the same on every backend, and abortable.
        self.all_reduce(torch.zeros(1, dtype=torch.int32, device=self.device), deadline=deadline)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        """Start a point-to-point send; complete it with :meth:`wait`.

        NCCL: a batch of one (:meth:`batch_isend_irecv`), so it runs on the group's own
        communicator; a lone NCCL send would create a 2-rank communicator per pair.
        """
        if self.backend == "nccl":
            return self.batch_isend_irecv([("send", tensor, dst)], tag)[0]
        return self._track(self._issue(self.pg.send, [tensor], dst, tag, what="send"))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0):
        """Start a point-to-point receive; complete it with :meth:`wait` (NCCL: as :meth:`isend`)."""
        if self.backend == "nccl":
            return self.batch_isend_irecv([("recv", tensor, src)], tag)[0]
        return self._track(self._issue(self.pg.recv, [tensor], src, tag, what="recv"))

    def batch_isend_irecv(self, ops: Sequence[tuple], tag: int = 0) -> list:
        """Start several point-to-point ops at once: ``("send" | "recv", tensor, peer[, tag])``.

        Returns one work per op, in order; complete them with :meth:`wait`. NCCL: one
        coalesced group call on the group's own communicator, created eagerly when the
        group formed (no lazy 2-rank communicator per pair inside an issue call that an
        abort cannot reach); every op's work is then the batch's one work (they finish
        together). gloo: the ops one by one, each handed to the waiter thread at once.

        A peer that is already gone does not raise here: its op's work is a future that
        fails with ``PeerLost`` when waited on, like a peer lost mid-transfer — so a
        caller keeps one path for both. An aborted or closed group raises
        ``RefitAborted`` at once.
        """
        self._guard()
        if self.backend != "nccl":
            works = []
            for kind, t, peer, *own in ops:
                op = self.pg.send if kind == "send" else self.pg.recv
                try:
                    works.append(self._track(self._issue(op, [t], peer, own[0] if own else tag, what=kind)))
                except PeerLost as exc:
                    works.append(finished(exc))
            return works
        torch.cuda.set_device(self.device)
        pg = self.pg
        try:
            # On the backend object (our pg) the coalescing calls take no device: the
            # group's own device was set above (checked on an H200, torch 2.11).
            pg._start_coalescing()
            for kind, t, peer, *own in ops:
                (pg.send if kind == "send" else pg.recv)([t], peer, own[0] if own else tag)
            work = pg._end_coalescing()
        except Exception as exc:  # torch raises RuntimeError/DistBackendError subclasses
            if self._aborted.is_set():
                raise RefitAborted(f"batch p2p on group {self.name!r} was aborted", rank=self.rank) from exc
            err = translate_comm_error(exc, rank=self.rank, what=f"batch p2p on group {self.name!r}")
            if not isinstance(err, PeerLost):
                raise err from exc
            work = finished(err)
        if work is None:  # nothing to do (no ops): an already finished work
            work = finished(None)
        return [work] * len(ops)

    def read(self, tensor: torch.Tensor, *, deadline: float | None = None, what: str = "read") -> torch.Tensor:
        """``tensor`` on the host, once the work that filled it (waited on) landed.

        CPU: the tensor itself. CUDA: a copy into pinned memory on the current stream,
        waited for by polling one event against the abort flag and the deadline — no
        device-wide (or blocking stream) synchronize inside a refit's window.
        """
        if tensor.device.type != "cuda":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        self.wait_event(event, deadline=deadline, what=what)
        return host

    def wait_event(self, event, *, deadline: float | None = None, what: str = "GPU work") -> None:
        """Poll a CUDA event until it completed; ``RefitAborted`` / ``RefitTimeout`` otherwise."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        pause = _POLL_MIN_S
        while not event.query():
            if self._aborted.is_set():
                raise RefitAborted(f"{what} on group {self.name!r} was aborted", rank=self.rank)
            if time.monotonic() >= deadline:
                raise RefitTimeout(f"{what} on group {self.name!r} did not finish in time", rank=self.rank)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _issue(self, op, *args, what: str):
        """Start ``op``; a backend error at issue time (gloo raises there when a pair is
        already closed) is translated like one at wait time."""
        self._guard()
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)  # the executor thread's current device is not ours
        try:
            return op(*args)
        except Exception as exc:  # torch raises RuntimeError/DistBackendError subclasses
            if self._aborted.is_set():
                raise RefitAborted(f"{what} on group {self.name!r} was aborted", rank=self.rank) from exc
            raise translate_comm_error(exc, rank=self.rank, what=f"{what} on group {self.name!r}") from exc

    def _track(self, work):
        # gloo: hand the work to the waiter thread now, not at wait time, so it waits on
        # issued works back to back and a caller's wait finds them done (pipelining).
        return work if self.backend == "nccl" else self._completion(work)

    def __repr__(self) -> str:
        state = "aborted" if self.aborted else ("closed" if self._closed else "open")
        return f"CommGroup({self.name!r}, rank={self.rank}/{self.world_size}, {self.backend}, {state})"


#: Every group not yet garbage: the exit hook ends their waiters' pending works.
_LIVE: weakref.WeakSet[CommGroup] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """At interpreter exit, no waiter thread may still be inside gloo (see :class:`~policyworker.runtime.comm_waiter.Waiter`).

    A process that exits without ``shutdown`` (an uncaught ``KeyboardInterrupt`` after a
    cancelled refit, a script that just returns) still has groups whose waiters may be
    blocked on works no peer will finish: abort those groups, end their pending works
    and join their waiters, so the process exits with its own code (0; -SIGINT for an
    uncaught KeyboardInterrupt) rather than SIGABRT. Runs after the interpreter joined
    its non-daemon threads (the refit executors), so nothing else uses the groups.
    """
    for group in list(_LIVE):
        waiter = group._waiter
        if waiter is None or group._closed:
            continue
        if waiter.busy:
            group._aborted.set()
            group._release_pending()
        waiter.stop()
        waiter.join(_RELEASE_JOIN_S)
