"""Fault injection for drills and tests: real failures, placed deterministically.

Everything here acts inside the process it is called in: a rank that kills or stops
*itself* after its k-th wait of a refit fails mid-transfer every time, where a
signal from outside would land at a random point (or between refits).
"""

from __future__ import annotations

import os
import signal
from typing import Any

from ..comm import CommGroup

__all__ = ["FlippingGroup", "MutedGroup", "die_after_waits"]


class MutedGroup:
    """Stands in for a group in one schedule entry: the message is lost, the sender carries on."""

    def __init__(self, group: CommGroup) -> None:
        self._group = group
        self.device = group.device

    def isend(self, tensor, dst: int, tag: int = 0) -> None:
        return None

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

    def wait(self, work, **kw: Any) -> None:
        self._group.wait(work, **kw)


def die_after_waits(k: int, sig: int = signal.SIGKILL) -> None:
    """After this process's ``k``-th ``CommGroup.wait`` from now, send itself ``sig``.

    SIGKILL: the process dies mid-refit. SIGSTOP: it freezes mid-refit until someone
    sends SIGCONT. The patch removes itself once it fired.
    """
    real_wait = CommGroup.wait
    count = 0

    def wait(self, work, **kw: Any) -> None:
        nonlocal count
        count += 1
        if count == k:
            CommGroup.wait = real_wait  # type: ignore[method-assign]
            os.kill(os.getpid(), sig)
        return real_wait(self, work, **kw)

    CommGroup.wait = wait  # type: ignore[method-assign]
