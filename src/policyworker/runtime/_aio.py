"""Bridging blocking work to whatever async loop runs the worker.

The worker runs on asyncio (uvloop when installed) or under anyio (asyncio or trio).
Blocking bodies go to a dedicated executor; awaiting its future must work on each,
and must stay cancellable on each: a cancelled await returns at once (the caller —
``WorkerCore.refit`` — then aborts the transport and waits, bounded and shielded, for
the executor to leave the weights). asyncio wraps the concurrent future directly; any
other backend waits for it on a helper thread it can abandon when cancelled.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["run_in_executor"]


async def run_in_executor(executor: Executor | None, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    call = functools.partial(fn, *args, **kwargs) if (args or kwargs) else fn
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (e.g. anyio on trio)
        loop = None
    if loop is not None:
        return await loop.run_in_executor(executor, call)
    import anyio.to_thread

    if executor is None:
        return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
    future = executor.submit(call)
    # Abandoned on cancel: the helper thread then only waits for ``future`` (which the
    # caller's abort ends) and returns; nothing it does touches the weights.
    return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)
