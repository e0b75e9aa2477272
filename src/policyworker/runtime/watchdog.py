"""Refit deadlines: arm, fire (abort the refit's groups), or stand down.

A :class:`RefitWatchdog` is process-wide state behind one lock. ``arm()`` registers a
deadline and returns a :class:`Deadline`; one daemon timer thread (not the event loop,
which may be the very thing blocked) sleeps until the earliest deadline. When one
passes, the watchdog marks it ``fired`` and calls its abort callbacks (typically
``CommGroup.abort`` of the refit's groups). Aborted collectives may *return* instead of
raising, so the refit must check ``deadline.fired`` afterwards and raise
``RefitTimeout`` itself — :meth:`Deadline.check` does exactly that.

Deadlines belong to an *owner* (the worker that armed them). ``stand_down(owner)``
is the controller's lever once it knows a peer is dead and will rebuild: it disarms
that owner's armed deadlines without firing any and returns how many — other
workers in the same process keep theirs. It takes one uncontended lock and never
blocks on a refit, so it is safe to call from the event loop while the refit
executor thread is stuck in a collective.

Each fired deadline's abort callbacks run on a thread of their own: one abort that
hangs (an NCCL communicator that will not die) delays no other deadline.
"""

from __future__ import annotations

import heapq
import logging
import itertools
import threading
import time
from collections.abc import Callable, Iterable

from policyworker.config import positive_seconds
from policyworker.errors import RefitTimeout

__all__ = ["Deadline", "RefitWatchdog", "process_watchdog"]

_log = logging.getLogger(__name__)


class Deadline:
    """One armed refit deadline. States: armed → fired | disarmed (final)."""

    __slots__ = ("label", "at", "owner", "_callbacks", "_state", "_seq", "_done", "__weakref__")

    def __init__(self, label: str, at: float, callbacks: tuple[Callable[[], None], ...], seq: int,
                 owner: object = None) -> None:
        self.label = label
        self.owner = owner
        self.at = at
        self._callbacks = callbacks
        self._state = "armed"
        self._seq = seq
        self._done = threading.Event()  # set once a fired deadline's callbacks returned

    @property
    def armed(self) -> bool:
        return self._state == "armed"

    @property
    def fired(self) -> bool:
        return self._state == "fired"

    @property
    def stood_down(self) -> bool:
        return self._state == "stood_down"

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def check(self) -> None:
        """Raise ``RefitTimeout`` if this deadline fired (call after every aborted wait)."""
        if self._state == "fired":
            raise RefitTimeout(f"refit {self.label!r} passed its deadline and was aborted")

    def __repr__(self) -> str:
        return f"Deadline({self.label!r}, {self._state}, in {self.remaining():.3f}s)"


#: How long disarming a fired deadline waits for its aborts to return.
FIRE_JOIN_S = 5.0


class RefitWatchdog:
    """Deadlines for refits, served by one timer thread started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, Deadline]] = []
        self._armed: dict[int, Deadline] = {}
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, timeout_s: float, on_fire: Iterable[Callable[[], None]] = (), *, label: str = "refit",
            owner: object = None) -> Deadline:
        """Arm a deadline ``timeout_s`` from now for ``owner``; ``on_fire`` runs on its own thread."""
        positive_seconds(timeout_s, "refit_timeout_s", optional=False)
        seq = next(self._seq)
        deadline = Deadline(label, time.monotonic() + float(timeout_s), tuple(on_fire), seq, owner)
        with self._wake:
            self._armed[seq] = deadline
            heapq.heappush(self._heap, (deadline.at, seq, deadline))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="policyworker-watchdog", daemon=True)
                self._thread.start()
            if self._heap[0][2] is deadline:
                # The timer sleeps until the earliest entry; only a new earliest one must wake
                # it (waking it on every refit costs the refit thread a GIL hand-off).
                self._wake.notify()
        return deadline

    def disarm(self, deadline: Deadline) -> bool:
        """Disarm one deadline (refit finished). True if it was still armed.

        A deadline that fired runs its aborts on a thread of their own; disarming it waits
        (at most ``FIRE_JOIN_S``) until they returned, so an abort lands in the refit it
        ended and never in the next one (a refit that clears its abort flag on start would
        otherwise take a late abort as its own)."""
        with self._lock:
            state = deadline._state
            if state == "armed":
                deadline._state = "disarmed"
                self._armed.pop(deadline._seq, None)
                return True
        if state == "fired":
            deadline._done.wait(FIRE_JOIN_S)
        return False

    def stand_down(self, owner: object = None) -> int:
        """Disarm ``owner``'s armed deadlines without firing; return how many. Never blocks long.

        ``owner=None`` stands down every deadline of the process.
        """
        with self._lock:
            mine = [seq for seq, d in self._armed.items() if owner is None or d.owner is owner]
            for seq in mine:
                self._armed.pop(seq)._state = "stood_down"
            return len(mine)

    def armed_count(self, owner: object = None) -> int:
        with self._lock:
            return sum(1 for d in self._armed.values() if owner is None or d.owner is owner)

    def _run(self) -> None:
        while True:
            due: list[Deadline] = []
            with self._wake:
                while self._heap and self._heap[0][2]._state != "armed":
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait(timeout=60.0)
                    continue
                at = self._heap[0][0]
                now = time.monotonic()
                if at > now:
                    self._wake.wait(timeout=at - now)
                    continue
                while self._heap and self._heap[0][0] <= now:
                    _, seq, d = heapq.heappop(self._heap)
                    if d._state == "armed":
                        d._state = "fired"
                        self._armed.pop(seq, None)
                        due.append(d)
            # Callbacks run outside the lock, one thread per deadline: an abort may take
            # a while (NCCL) or hang, and neither stand_down() nor another deadline may wait.
            for d in due:
                threading.Thread(target=_fire, args=(d,), name=f"policyworker-abort-{d._seq}", daemon=True).start()


def _fire(d: Deadline) -> None:
    try:
        for cb in d._callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - one failing abort must not stop the others; it is logged
                _log.exception("watchdog abort callback failed for %r", d)
    finally:
        d._done.set()


_PROCESS_WATCHDOG: RefitWatchdog | None = None
_PROCESS_LOCK = threading.Lock()


def process_watchdog() -> RefitWatchdog:
    """The process-wide watchdog every worker in this process shares."""
    global _PROCESS_WATCHDOG
    with _PROCESS_LOCK:
        if _PROCESS_WATCHDOG is None:
            _PROCESS_WATCHDOG = RefitWatchdog()
        return _PROCESS_WATCHDOG
