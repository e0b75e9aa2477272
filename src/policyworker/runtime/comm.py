"""Independent, abortable process groups among arbitrary processes.

A :class:`CommGroup` is a ``TCPStore`` + ``PrefixStore`` + ``ProcessGroupGloo`` (CPU)
or ``ProcessGroupNCCL`` (CUDA), built without ``init_process_group``: the trainer's
own default group (if any) is never touched, and several groups can coexist (the
update group, one group per pipeline stage, one per SGLang engine).

Every operation is bounded. Collectives are issued asynchronously and completed by
:meth:`CommGroup.wait`, which waits for the work against a deadline and against the
group's abort flag (gloo works are waited on by a per-group waiter thread, NCCL works
are polled). So a watchdog on another thread can abort a refit that is
blocked in a collective: ``abort()`` sets the flag (and aborts the backend where it
can), the waiting thread sees it within a millisecond and raises ``RefitAborted``.
An aborted group is dead: build a new one (``init_collective`` again) to recover.

Ranks: rank 0 of a group hosts its store at ``(host, port)``; every other rank
connects to it. All ranks must call collectives in the same order (the usual
deadlock hazard of collectives): a rank that skips one makes its peers wait until
their deadline.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import logging
import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist

from policyworker.runtime.comm_setup import _first_line, _quiet_cpp_stderr, _rendezvous, nccl_device
from policyworker.config import positive_seconds
from policyworker.errors import ConfigError, PeerLost, RefitAborted, RefitTimeout, translate_comm_error

__all__ = ["DEFAULT_TIMEOUT_S", "CommGroup", "backend_for", "group_on_store", "nccl_device", "new_group", "share_token"]

DEFAULT_TIMEOUT_S = 120.0

_log = logging.getLogger(__name__)
#: A point-to-point tag no refit uses: the probes that close a dying group's pairs.
_RELEASE_TAG = (1 << 30) + 7
#: How long closing a group waits for its waiter thread to leave gloo.
_RELEASE_JOIN_S = 5.0

# Poll backoff for work handles: start tight (small messages finish in microseconds),
# grow to 1 ms so a long transfer does not burn a core spinning.
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


def _check_rank(rank: int, world_size: int) -> None:
    for value, name in ((rank, "rank"), (world_size, "world_size")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside [0, {world_size})")


def _failed(exc: BaseException | None) -> Future:
    """An already finished work: failed with ``exc`` (a peer gone at issue), or done."""
    future: Future = Future()
    future.set_running_or_notify_cancel()
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
    return future


class _Waiter:
    """One daemon thread that waits on gloo works in issue order and completes futures.

    While it is inside a gloo ``wait`` (C++) the interpreter must not finalize: a daemon
    thread that comes back from C++ into a finalizing interpreter is unwound through
    C++ frames and the process dies of ``std::terminate`` (SIGABRT, "terminate called
    without an active exception"). :meth:`CommGroup.close` and the exit hook therefore
    end its pending works first and join it (see ``_release_pending``).
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # works submitted and not finished (under _lock)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def submit(self, work, future: Future) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put((work, future))

    def stop(self) -> None:
        self._queue.put(None)

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, future = item
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    work.wait()
                except BaseException as exc:  # handed to the caller through the future
                    future.set_exception(exc)
                else:
                    future.set_result(None)
            finally:
                with self._lock:
                    self._pending -= 1


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
        self._waiter: _Waiter | None = None
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
            self._waiter = _Waiter(f"policyworker-wait-{self.name}")
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
                    works.append(_failed(exc))
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
            work = _failed(err)
        if work is None:  # nothing to do (no ops): an already finished work
            work = _failed(None)
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
    """At interpreter exit, no waiter thread may still be inside gloo (see ``_Waiter``).

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


def backend_for(device: torch.device | int | str | None) -> str:
    """The backend of a worker's groups: nccl on a CUDA device, gloo on the CPU."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if isinstance(device, int) and not isinstance(device, bool):
        return "nccl"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"not a device: {device!r}") from exc
    return "nccl" if kind == "cuda" else "gloo"


def new_group(
    *,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    name: str,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    verify: bool = True,
    device: torch.device | int | str | None = None,
) -> CommGroup:
    """Build an independent group; rank 0 hosts the store at ``(host, port)``.

    ``device``: the worker's own device (pass it: an NCCL group then lives on that GPU,
    never on whichever device is current on the calling thread). ``backend`` defaults
    to :func:`backend_for` ``(device)``: nccl for a CUDA device, gloo for a CPU one, and
    without a device nccl when CUDA is available, else gloo. With ``verify`` a
    warm-up runs: rank 0 broadcasts (magic, world_size, nonce); every rank checks the
    world size matches its own and all-reduces its verdict, so every rank knows every
    rank agreed. Raises ``ConfigError`` (bad arguments, port in use, disagreement) or
    ``PeerLost`` / ``RefitTimeout`` (a peer never came) — never hangs past ``timeout_s``.
    """
    _check_rank(rank, world_size)
    timeout_s = positive_seconds(timeout_s, "timeout_s", optional=False)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"port must be an int in (0, 65536), got {port!r}")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"host must be a non-empty string, got {host!r}")
    if backend is None:
        backend = backend_for(device)
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = _dt.timedelta(seconds=timeout_s)
    is_master = rank == 0
    try:
        with _quiet_cpp_stderr():
            store = dist.TCPStore(
                host, port, world_size, is_master, timeout=timeout, wait_for_workers=False
            )
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError with errno text
        text = _first_line(exc)
        if is_master and ("in use" in text or "EADDRINUSE" in text or "errno: 98" in text):
            raise ConfigError(f"port {port} on {host} is already in use (group {name!r})", rank=rank) from None
        cls = RefitTimeout if any(m in text for m in ("timed out", "Timeout", "timeout")) else PeerLost
        raise cls(f"rank {rank} of group {name!r} could not reach its store at {host}:{port} within "
                  f"{timeout_s:g} s: rank 0 (the store's host) is missing ({text})", rank=rank) from None
    prefixed = dist.PrefixStore(f"policyworker/{name}", store)
    return group_on_store(prefixed, rank=rank, world_size=world_size, name=name, backend=backend,
                          timeout_s=timeout_s, owner_store=store, verify=verify, device=device)


def group_on_store(
    store: dist.Store,
    *,
    rank: int,
    world_size: int,
    name: str,
    backend: str,
    timeout_s: float,
    owner_store: dist.TCPStore | None = None,
    verify: bool = True,
    transport: str | None = None,
    device: torch.device | int | str | None = None,
) -> CommGroup:
    """A group whose ranks meet on ``store`` (already prefixed for it), warmed up if ``verify``.

    ``new_group`` uses it over a fresh TCPStore; callers that already share a store
    (e.g. the update group's, under a prefix of their own) use it directly.
    """
    timeout = _dt.timedelta(seconds=timeout_s)
    _rendezvous(store, rank=rank, world_size=world_size, name=name, timeout_s=timeout_s, transport=transport)
    try:
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            pg = _nccl_backend(store, rank, world_size, nccl_device(device), timeout_s)
    except Exception as exc:  # torch raises RuntimeError / DistError with backend text
        raise translate_comm_error(exc, rank=rank, transport=transport, what=f"creating group {name!r}") from exc
    group = CommGroup(pg, store, rank=rank, world_size=world_size, backend=backend, name=name,
                      timeout_s=timeout_s, owner_store=owner_store,
                      device=nccl_device(device) if backend == "nccl" else None)
    if verify:
        try:
            _warm_up(group, deadline=time.monotonic() + timeout_s)
        except BaseException:
            group.close()
            raise
    return group


_ENV_LOCK = threading.Lock()


def _nccl_backend(store: dist.Store, rank: int, world_size: int, dev: torch.device, timeout_s: float):
    """A ProcessGroupNCCL bound to ``dev`` whose communicator exists before this returns.

    ``eager_connect_single_device(dev)`` is what ``init_process_group(device_id=dev)``
    does: the group's one communicator is created here, on our device, and every
    point-to-point op (batched, see :meth:`CommGroup.batch_isend_irecv`) runs on it.

    A stuck op is ours to end (deadline → ``abort()`` → ``RefitTimeout``). NCCL reads
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` once per group, at construction: ours is built
    with 2 (CleanUpOnly: its watchdog may abort the communicator, never the process),
    whatever the process's setting, which is restored at once for the user's own
    groups. NCCL's own timeout lies past every deadline of ours.
    """
    torch.cuda.set_device(dev)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _dt.timedelta(seconds=2 * timeout_s + 60)
    with _ENV_LOCK:
        before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        try:
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            if before is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before
    pg.eager_connect_single_device(dev)
    return pg


_MAGIC = 0x50574B31  # "PWK1"


def _warm_up(group: CommGroup, *, deadline: float) -> None:
    """Broadcast from rank 0, check on every rank, all-reduce the verdicts."""
    dev = group.device
    if group.rank == 0:
        hello = torch.tensor([_MAGIC, group.world_size, secrets.randbits(62)], dtype=torch.int64, device=dev)
    else:
        hello = torch.zeros(3, dtype=torch.int64, device=dev)
    group.broadcast(hello, 0, deadline=deadline)
    magic, size, _nonce = (int(v) for v in hello.tolist())
    ok = magic == _MAGIC and size == group.world_size
    verdict = torch.tensor([0 if ok else 1], dtype=torch.int64, device=dev)
    group.all_reduce(verdict, deadline=deadline)
    bad = int(verdict.item())
    if not ok:
        raise ConfigError(
            f"group {group.name!r}: rank 0 says world_size={size}, this rank says {group.world_size}",
            rank=group.rank,
        )
    if bad:
        raise ConfigError(
            f"group {group.name!r}: {bad} rank(s) disagree on the world size", rank=group.rank
        )



def share_token(group: CommGroup) -> str:
    """A fresh secret, made by rank 0 and read by every rank through the group's store.

    Called right after the group formed (every rank), so each ``init_collective``
    yields a new token. Store reads are bounded by the store's timeout.
    """
    if group.rank == 0:
        token = secrets.token_hex(16)
        group.store.set("control_token", token)
        return token
    try:
        return group.store.get("control_token").decode()
    except Exception as exc:  # the store raises DistStoreError/RuntimeError on timeouts
        raise translate_comm_error(exc, rank=group.rank, what="reading the group token") from exc
