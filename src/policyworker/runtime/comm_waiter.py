"""The gloo waiter: one daemon thread per group that completes futures for gloo works.

gloo's point-to-point works only make progress inside ``work.wait()`` (C++, not
interruptible); a :class:`~policyworker.runtime.comm_group.CommGroup` hands each work
to its waiter as it is issued and its callers wait on the future instead, where an
abort can reach them.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

__all__ = ["Waiter", "finished"]


def finished(exc: BaseException | None) -> Future:
    """An already finished work: failed with ``exc`` (a peer gone at issue), or done."""
    future: Future = Future()
    future.set_running_or_notify_cancel()
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
    return future


class Waiter:
    """One daemon thread that waits on gloo works in issue order and completes futures.

    While it is inside a gloo ``wait`` (C++) the interpreter must not finalize: a daemon
    thread that comes back from C++ into a finalizing interpreter is unwound through
    C++ frames and the process dies of ``std::terminate`` (SIGABRT, "terminate called
    without an active exception"). ``CommGroup.close`` and the exit hook therefore end its
    pending works first and join it (see ``CommGroup._release_pending``).
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
