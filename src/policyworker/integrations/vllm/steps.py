"""When a vLLM worker ran its engine steps, and so how long the engine stood idle between them.

One engine step on a vLLM 0.32 worker is an ``execute_model`` call (the forward pass,
the logits) followed by a ``sample_tokens`` call (sampling and the step's output). The
time from the end of one step to the start of the next is what the engine spends
outside the model: scheduling in the engine core, the round trip of the step's RPCs,
and any other call that the worker runs between two steps (a weight-transfer RPC, a
``collective_rpc``). A refit that stops the engine shows up there.

:class:`WorkerSteps` wraps both methods of one worker *instance* (vLLM's executors look
them up on the instance by name, so nothing of vLLM's is patched) and keeps the
``time.monotonic()`` start and end of the latest steps in a bounded ring. The forward
passes alone are :class:`~.overlap.StepCounter`'s.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from typing import Any

__all__ = ["WorkerSteps"]


class WorkerSteps:
    """(start, end) of the latest ``keep`` engine steps of one vLLM worker.

    A step starts when ``execute_model`` is called and ends when the ``sample_tokens``
    after it returns (or ``execute_model`` itself, for a step that samples nothing).
    One writer (the worker's thread); readers copy the ring (:meth:`times`).
    """

    ATTR = "_policyworker_steps"

    def __init__(self, keep: int = 1 << 16) -> None:
        self._steps: collections.deque[list[float]] = collections.deque(maxlen=keep)

    @classmethod
    def of(cls, worker: Any) -> WorkerSteps:
        """The recorder of ``worker``, installed on the first call (idempotent)."""
        steps = worker.__dict__.get(cls.ATTR)
        if steps is None:
            steps = worker.__dict__[cls.ATTR] = cls()
            worker.execute_model = steps._wrap(worker.execute_model, start=True)
            worker.sample_tokens = steps._wrap(worker.sample_tokens, start=False)
        return steps

    def _wrap(self, method: Callable[..., Any], *, start: bool) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                ended = time.monotonic()
                if start or not self._steps:
                    self._steps.append([began, ended])
                else:
                    self._steps[-1][1] = ended  # the step's sampling: it ends now

        return timed

    def times(self, since: float = 0.0) -> list[tuple[float, float]]:
        """(start, end) of each kept step that started at or after ``since``."""
        return [(s, e) for s, e in list(self._steps) if s >= since]
