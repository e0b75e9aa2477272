"""Fault injection for drills and tests: real failures, placed deterministically.

Everything here acts inside the process it is called in: a rank that kills or stops
*itself* after its k-th wait of a refit fails mid-transfer every time, where a
signal from outside would land at a random point (or between refits).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from policyworker.runtime.comm import CommGroup

__all__ = ["FlippingGroup", "MutedGroup", "StallingEngine", "after_calls", "cancel_task", "die_after_waits", "signal_self"]


class MutedGroup:
    """Stands in for a group in one schedule entry: the message is lost, the sender carries on."""

    def __init__(self, group: CommGroup) -> None:
        self._group = group
        self.device = group.device

    def isend(self, tensor, dst: int, tag: int = 0) -> None:
        return None

    def batch_isend_irecv(self, ops, tag: int = 0) -> list:
        return [None] * len(ops)

    def wait(self, work, **_kw: Any) -> None:
        return None


class FlippingGroup:
    """Stands in for a group in one schedule entry: flips the first byte on the wire, once."""

    def __init__(self, group: CommGroup) -> None:
        self._group = group
        self.device = group.device
        self._armed = True

    def isend(self, tensor, dst: int, tag: int = 0):
        if self._armed:
            self._armed = False
            tensor[0] ^= 0xFF
        return self._group.isend(tensor, dst, tag)

    def batch_isend_irecv(self, ops, tag: int = 0) -> list:
        if self._armed and ops:
            self._armed = False
            ops[0][1][0] ^= 0xFF
        return self._group.batch_isend_irecv(ops, tag)

    def wait(self, work, **kw: Any) -> None:
        self._group.wait(work, **kw)


def die_after_waits(k: int, sig: int = signal.SIGKILL) -> Callable[[], None]:
    """After this process's ``k``-th ``CommGroup.wait`` from now, send itself ``sig``.

    SIGKILL: the process dies mid-refit. SIGSTOP: it freezes mid-refit until someone
    sends SIGCONT. The patch removes itself once it fired.
    """
    return after_calls(CommGroup, "wait", k, signal_self(sig))


def after_calls(cls: Any, attr: str, k: int, action) -> Callable[[], None]:
    """Run ``action()`` at this process's ``k``-th call of ``cls.attr`` from now, then the call.

    ``cls`` is a class or a module (a module function's first argument passes through
    as ``self``). The patch removes itself once it fired; the returned callable removes
    it earlier (a fault whose refit ended before the k-th call must not leak into the
    next). Used for zmq channel waits (``Channel.expect``), engine calls and file
    writes, where ``die_after_waits`` counts group waits.
    """
    real = getattr(cls, attr)
    count = 0

    def patched(self, *args: Any, **kw: Any):
        nonlocal count
        count += 1
        if count == k:
            remove()
            action()
        return real(self, *args, **kw)

    def remove() -> None:
        if getattr(cls, attr) is patched:
            setattr(cls, attr, real)

    setattr(cls, attr, patched)
    return remove


def signal_self(sig: int, *, hold_s: float = 0.0):
    """An ``action`` for :func:`after_calls`: this process sends itself ``sig``.

    ``hold_s``: the calling thread then sleeps that long before going on, so a signal
    the main thread handles (SIGINT) lands while the refit is still under way rather
    than after a worker thread finished its part.
    """
    def action() -> None:
        os.kill(os.getpid(), sig)
        if hold_s > 0:
            time.sleep(hold_s)

    return action


def cancel_task(loop, task):
    """An ``action`` for :func:`after_calls` (any thread): cancel ``task`` on ``loop``,
    as a controller's ``asyncio.wait_for`` would."""
    return lambda: loop.call_soon_threadsafe(task.cancel)


class StallingEngine:
    """Wraps an in-process engine; refit ``version``'s bucket ``bucket`` never gets an answer.

    It waits out the ``timeout_s`` the transport granted (as an HTTP engine's client
    would), then raises ``RefitTimeout``; the bucket is not applied.
    """

    def __init__(self, engine, *, version: int, bucket: int) -> None:
        self.engine, self.version, self.bucket = engine, version, bucket
        self.wants_serialized = engine.wants_serialized
        self.refit = 0

    def update_weights_from_tensor(self, request, *, timeout_s=None):
        import time

        from policyworker.errors import RefitTimeout

        if request.bucket == 0:
            self.refit += 1
        if self.refit == self.version and request.bucket == self.bucket:
            time.sleep(max(0.0, timeout_s or 0.0))
            self.engine.fail_refit(True)  # earlier buckets of this refit landed
            raise RefitTimeout(f"the engine did not answer bucket {request.bucket} within {timeout_s:.1f} s")
        return self.engine.update_weights_from_tensor(request, timeout_s=timeout_s)

    def close(self) -> None:
        self.engine.close()
