"""Overlapped refit for the vLLM backend, and the engine step of each commit.

With ``init_info.overlap=True`` the backend's ``update_weights`` starts the receive
into its staging set (which nothing live references) on its own loop thread and
returns as soon as the receive is running; vLLM keeps stepping on the committed
version meanwhile. ``finish_weight_update`` waits for the receive (bounded by the
refit deadline), then post-processes and swaps as the paused path does — every tp
rank inside the same collective RPC, so at the same engine step. A receive that fails
surfaces there and commits nothing: vLLM keeps serving the version it had.

:class:`StepCounter` counts the model's forward passes (one per engine step on an
eager engine) with a forward pre-hook; the backend records the count at each commit,
so a controller can tell which steps ran on which version.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import torch

from policyworker.errors import ProtocolError, RefitTimeout

__all__ = ["OverlappedReceive", "StepCounter"]


class StepCounter:
    """Forward passes of ``model`` so far (a pre-hook; thread-safe enough: one writer)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._tick)

    def _tick(self, module: torch.nn.Module, args: Any) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


class OverlappedReceive:
    """One receive running on the backend's loop while the engine steps."""

    def __init__(self, future: concurrent.futures.Future, *, version: int, step: int, timeout_s: float) -> None:
        self.future = future
        self.version = version
        self.started_step = step
        self.timeout_s = timeout_s
        #: The receive's ``RefitReport`` once :meth:`wait` returned.
        self.report: Any = None

    @classmethod
    def start(cls, loop: Any, coro: Any, *, worker: Any, version: int, step: int, timeout_s: float,
              start_timeout_s: float = 10.0) -> OverlappedReceive:
        """Submit ``coro`` (the worker's receive) and return once it is in flight (or done)."""
        import asyncio

        future = asyncio.run_coroutine_threadsafe(coro, loop.loop)
        end = time.monotonic() + start_timeout_s
        while not worker.ledger.in_flight and not future.done():
            if time.monotonic() > end:
                future.cancel()
                raise RefitTimeout(f"vLLM rank {worker.rank}: the overlapped receive did not start within "
                                   f"{start_timeout_s} s", rank=worker.rank)
            time.sleep(0.0005)
        if future.done():
            future.result()  # a receive that failed at once raises here, before update_weights returns
        return cls(future, version=version, step=step, timeout_s=timeout_s)

    def wait(self, rank: int) -> int:
        """The received version, once every byte landed; the receive's error otherwise."""
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
        return report.version
