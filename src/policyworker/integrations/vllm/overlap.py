"""Overlapped refit for the vLLM backend, and the engine step of each commit.

With ``init_info.overlap=True`` (or ``update_info.overlap=True`` for one update) the
backend's ``update_weights`` starts the receive into its staging set (which nothing
live references) on its own loop thread and returns as soon as it handed the receive over;
vLLM keeps stepping on the committed version meanwhile. Once the receive ended with
every rank's verdict good, a background thread runs vLLM's post-processing
(``VllmStage.prepare``: on CPU the linear layers' prepack) on copies of the layers,
still off the live model. ``finish_weight_update`` waits for both (bounded by the refit
deadline), the tp ranks agree on the outcome, and every rank swaps inside the same
collective RPC, so at the same engine step: called once
``weight_update_ready()`` is true on every rank, it only moves pointers. A receive or a
post-processing that fails surfaces there and commits nothing: vLLM keeps serving the
version it had.

:class:`StepCounter` counts the model's forward passes (one per engine step on an
eager engine) with forward hooks and keeps the monotonic start and end of the latest
ones (a bounded ring), so a controller can tell which steps ran on which version and
how long the engine stood still between two steps.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from policyworker.errors import ProtocolError, RefitTimeout

__all__ = ["BACKGROUND_NICE", "GIL_SWITCH_S", "OverlappedReceive", "SideThread", "StepCounter", "give_way",
           "hold_live_state", "hurry_gil", "release_in_background"]

#: Niceness of the backend's background threads on a CPU engine (:func:`give_way`).
BACKGROUND_NICE = 10
#: The interpreter's thread switch interval (seconds) in a CPU engine's process while the
#: backend's threads run beside the engine's (:func:`hurry_gil`); Python's default is 5 ms.
GIL_SWITCH_S = 0.0005


def give_way(nice: int = BACKGROUND_NICE) -> None:
    """Let vLLM's engine thread come first: the calling thread (and every thread it starts
    later, which inherit both) runs at niceness ``nice``, on the cores the engine is not
    pinned to (any core when it is pinned to all of them).

    On CPU vLLM pins its worker to its OpenMP core(s), and every thread the worker starts
    inherits that pin: the receive (gloo's socket threads copy every byte), the
    post-processing and the engine's own step would share one core at one priority, and
    the engine would wait for the core between its steps. Off the engine's cores the
    backend's threads never take its core; and a thread of theirs that holds the GIL
    runs again soon, so the engine's thread, which waits for that GIL between its steps,
    waits less. Linux sets both per thread; the engine's pin is the process's main
    thread's (vLLM pins the thread that runs the engine).
    """
    tid = threading.get_native_id()
    try:
        cores = set(range(os.cpu_count() or 1))
        free = cores - os.sched_getaffinity(os.getpid())  # the main thread's cores
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        os.sched_setaffinity(0, free or cores)  # 0: the calling thread
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the thread keeps the worker's priority and cores


def hurry_gil(switch_s: float = GIL_SWITCH_S) -> float:
    """Make the interpreter hand the GIL over within ``switch_s`` (never longer than it is
    now); returns the interval it had, for :func:`sys.setswitchinterval` to restore.

    The engine's thread and the backend's threads share one GIL in vLLM's worker process.
    A thread that wants the GIL asks the holder to drop it and waits up to the switch
    interval (5 ms by default) before the holder must: each time the engine's thread
    comes back between two steps while the receive or the post-processing holds the GIL,
    the engine stands still that long. Measured on the CPU bench, the backend's threads
    off the engine's core at niceness 10: the engine's longest idle gaps during four
    overlapped refits 6.0-8.9 ms with 0.5 ms; with 5 ms (at niceness 0) 8.0-13.1 ms
    (benchmarks/RESULTS.md, "The overlapped stall under 10 ms").
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, switch_s))
    return old


class SideThread:
    """One long-lived daemon thread that runs the backend's work beside the engine's
    thread, one task after the other (``background``: it gives way first, :func:`give_way`).

    Handing a task to a thread that runs already costs the engine's thread a queue put.
    Starting a thread per task made the engine's thread wait inside its call until the
    new thread had run (``Thread.start`` waits for it, and it needs the GIL, which the
    receive's threads may hold): 3 ms of ``update_weights`` on the CPU bench. With
    ``overtake``, a task handed over while an earlier one still runs (a post-processing
    waiting for a receive stuck until its deadline) gets a thread of its own, so it never
    waits behind it; else it queues.
    """

    def __init__(self, name: str, background: bool = False, overtake: bool = False) -> None:
        import queue

        self.name = name
        self._background = background
        self._overtake = overtake
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = threading.Event()  # set from a hand-over until the queue ran dry
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def _serve(self) -> None:
        if self._background:
            give_way()
        while (task := self._tasks.get()) is not None:
            try:
                task()
            finally:
                if self._tasks.empty():
                    self._busy.clear()

    def run(self, task: Callable[[], None]) -> None:
        """Run ``task`` (which handles its own errors) on this thread (with ``overtake``: on a
        fresh one while this one is busy)."""
        if (self._overtake and self._busy.is_set()) or not self._thread.is_alive():
            def alone() -> None:
                if self._background:
                    give_way()
                task()

            threading.Thread(target=alone, daemon=True, name=self.name).start()
            return
        self._busy.set()
        self._tasks.put(task)

    def close(self) -> None:
        """Stop the thread once the tasks handed over so far ended."""
        self._tasks.put(None)


class StepCounter:
    """Forward passes of ``model`` so far and the times of the latest ``keep`` of them.

    One writer (vLLM's model thread); readers copy the ring (:meth:`times`). Times are
    ``time.monotonic()`` (one clock for every process of the host, on Linux).
    """

    def __init__(self, model: torch.nn.Module, keep: int = 1 << 16) -> None:
        self.count = 0
        self._start = 0.0
        self._passes: collections.deque[tuple[float, float]] = collections.deque(maxlen=keep)
        self._handles = [model.register_forward_pre_hook(self._tick), model.register_forward_hook(self._tock)]

    def _tick(self, module: torch.nn.Module, args: Any) -> None:
        self._start = time.monotonic()
        self.count += 1

    def _tock(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._passes.append((self._start, time.monotonic()))

    def times(self, since: float = 0.0) -> list[tuple[float, float]]:
        """(start, end) of each kept forward pass that ended, started at or after ``since``."""
        return [p for p in list(self._passes) if p[0] >= since]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class OverlappedReceive:
    """One receive running on the backend's loop while the engine steps, then its
    post-processing on a thread of its own; see the module docstring."""

    def __init__(self, future: concurrent.futures.Future, *, version: int, step: int, timeout_s: float) -> None:
        self.future = future
        self.version = version
        self.started_step = step
        self.timeout_s = timeout_s
        #: The receive's ``RefitReport`` once it ended well.
        self.report: Any = None
        #: Monotonic times of this refit's phases on this rank (update_enter, receive_start,
        #: update_return, receive_end, prepare_end, finish_start, swap_start, swap_end,
        #: finish_end), for timelines.
        self.times: dict[str, float] = {"receive_start": time.monotonic()}
        self._prepared: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    @classmethod
    def start(cls, loop: Any, coro: Any, *, worker: Any, version: int, step: int, timeout_s: float,
              prepare: Callable[[], Any], side: SideThread) -> OverlappedReceive:
        """Submit ``coro`` (the worker's receive) to ``loop`` and return at once; ``prepare``
        (the post-processing) runs on ``side`` once the receive ended well.

        It does not wait for the loop to pick the receive up: that thread gives way to the
        engine's, so the engine's thread would wait for a thread it outranks (1-8 ms on the
        CPU bench). A receive that fails before its first byte (a refit still in flight,
        a closed worker) fails this refit in ``finish_weight_update``, like any other.
        """
        import asyncio

        self = cls(asyncio.run_coroutine_threadsafe(coro, loop.loop), version=version, step=step,
                   timeout_s=timeout_s)
        side.run(lambda: self._after_receive(worker.rank, prepare))
        return self

    def _after_receive(self, rank: int, prepare: Callable[[], Any]) -> None:
        try:
            self._wait_receive(rank)
            self.times["receive_end"] = time.monotonic()
            self._prepared = prepare()
            self.times["prepare_end"] = time.monotonic()
        except BaseException as exc:  # handed to finish_weight_update (result), which raises it
            self._error = exc
        finally:
            self._done.set()

    def _wait_receive(self, rank: int) -> None:
        try:
            report = self.future.result(self.timeout_s + 30.0)
        except concurrent.futures.TimeoutError:
            self.future.cancel()
            raise RefitTimeout(f"vLLM rank {rank}: the overlapped receive of version {self.version} did not end "
                               f"within its deadline", rank=rank) from None
        if report.version != self.version:
            raise ProtocolError(f"the trainers sent version {report.version}, update_info says {self.version}; "
                                f"nothing committed", rank=rank)
        self.report = report

    def ready(self) -> bool:
        """True once the receive and its post-processing ended (well or not): a finish
        called now waits for nothing."""
        return self._done.is_set()

    def result(self, rank: int) -> tuple[int, Any]:
        """(the received version, its post-processed state), once both ended; the error of
        the receive or of the post-processing otherwise."""
        if not self._done.wait(self.timeout_s + 60.0):
            self.future.cancel()
            raise RefitTimeout(f"vLLM rank {rank}: the overlapped refit of version {self.version} did not end "
                               f"within its deadline", rank=rank)
        if self._error is not None:
            raise self._error
        return self.version, self._prepared

    def forget_prepared(self) -> None:
        """Drop the post-processed state (:meth:`result` handed it out). Kept here, the copies
        would hold what the swap installs until this object goes: the version that the
        *next* swap replaces would then be freed inside that swap, on the engine's thread."""
        self._prepared = None

    def cancel(self, timeout_s: float = 60.0) -> None:
        """Stop the receive; return once the post-processing thread stopped touching the
        staging set (or ``timeout_s`` passed)."""
        self.future.cancel()
        self._done.wait(timeout_s)


def hold_live_state(layers: list[tuple[torch.nn.Module, Any]]) -> list[Any]:
    """References to what a swap of ``layers`` (live module, prepared copy) replaces."""
    return [(dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m, _ in layers]


def release_in_background(held: list[Any], side: SideThread, pause_s: float = 0.001) -> None:
    """Drop ``held`` (:func:`hold_live_state`) one layer at a time on ``side``.

    The swap itself only moves references; freeing the replaced kernels' memory (on CPU
    the old version's prepacked weights: as many bytes as the model) inside the commit
    would stop the engine for as long, with the GIL held. Spread over short steps, the
    engine's thread gets the GIL between them.
    """

    def run() -> None:
        while held:
            held.pop()
            time.sleep(pause_s)

    side.run(run)
