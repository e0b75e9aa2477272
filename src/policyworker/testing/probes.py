"""What the conformance suite watches a real worker with: live bytes, the transport's word, its steps.

* :func:`snapshot` / :func:`changed` — copies of a receiver's live tensors, compared
  byte for byte afterwards: the suite judges *torn* by what happened to the bytes,
  not by what the transport said.
* :class:`ReceiveRecorder` — wraps one attached transport instance's ``receive`` so the
  suite sees ``ctx.touched`` as the transport left it when it returned or raised.
* :class:`SteppedExecutor` — stands in for a worker's refit executor: counts the
  blocking steps a refit runs (every ``ctx.blocking`` call) and can cut a refit
  *before* step ``k`` deterministically (the step does not run; the transport is
  aborted and the step raises ``RefitAborted``, as if the watchdog fired exactly then).
* :func:`mismatched_dtype` / :func:`mismatched_plan` — a peer that disagrees: the
  same tensors (or plan) in another dtype of the same element size.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from policyworker.errors import RefitAborted

__all__ = ["ReceiveRecorder", "SteppedExecutor", "changed", "mismatched_dtype", "mismatched_plan", "snapshot"]

#: Same element size, another meaning: a receiver expecting these disagrees with its peer.
_SWAP = {"bfloat16": "float16", "float16": "bfloat16", "float32": "int32", "int32": "float32",
         "float64": "int64", "int64": "float64", "int16": "float16", "uint8": "int8", "int8": "uint8",
         "bool": "uint8"}


def snapshot(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of ``params`` (the live tensors are not touched)."""
    with torch.no_grad():
        return {k: v.detach().to("cpu", copy=True) for k, v in params.items()}


def changed(before: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose bytes differ from ``before`` (compared as raw bytes, so NaNs compare too)."""
    out = []
    for name, old in before.items():
        now = params[name].detach().cpu()
        if now.shape != old.shape or now.dtype != old.dtype:
            out.append(name)
        elif old.numel() and not torch.equal(_raw(now), _raw(old)):
            out.append(name)
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def mismatched_dtype(dtype: torch.dtype) -> torch.dtype:
    """Another dtype of ``dtype``'s element size (float32 → int32, bfloat16 → float16, ...)."""
    name = str(dtype).removeprefix("torch.")
    return getattr(torch, _SWAP.get(name, "uint8" if dtype.itemsize == 1 else name))


def mismatched_plan(plan: Any) -> Any:
    """``plan`` with every float/int dtype swapped for another of the same size: the same
    layout and byte counts (so a worker can adopt it), another hash."""
    from policyworker.layout.local import as_plan
    from policyworker.layout.plan import ReshardPlan

    plan = as_plan(plan)
    body = plan.body

    def swap(items):
        return [msgspec.structs.replace(x, dtype=_SWAP.get(x.dtype, x.dtype)) for x in items]

    return ReshardPlan(msgspec.structs.replace(body, params=swap(body.params), sources=swap(body.sources),
                                               dests=swap(body.dests)))


class ReceiveRecorder:
    """Wraps ``transport.receive`` on the instance: records the context's ``touched`` flag
    as the transport left it. ``last`` is ``(ok, touched)`` of the latest receive."""

    def __init__(self, transport: Any) -> None:
        self.last: tuple[bool, bool | None] | None = None
        inner = transport.receive

        async def receive(ctx, version):
            try:
                report = await inner(ctx, version)
            except BaseException:
                self.last = (False, ctx.touched)
                raise
            self.last = (True, ctx.touched)
            return report

        transport.receive = receive


class SteppedExecutor(concurrent.futures.Executor):
    """A single-thread executor that counts steps and can cut before one (see module docstring).

    ``arm(cut_before=k, on_cut=abort)`` starts counting at 0; step ``k`` (1-based) then
    does not run: ``on_cut()`` is called and the step raises ``RefitAborted``. ``cut_before``
    None only counts. ``disarm()`` stops counting; ``steps`` is the count since ``arm``.
    """

    def __init__(self, inner: concurrent.futures.Executor) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._armed = False
        self._cut_before: int | None = None
        self._on_cut: Callable[[], None] | None = None
        self.steps = 0
        self.cut = False

    def arm(self, *, cut_before: int | None = None, on_cut: Callable[[], None] | None = None) -> None:
        with self._lock:
            self._armed, self._cut_before, self._on_cut = True, cut_before, on_cut
            self.steps, self.cut = 0, False

    def disarm(self) -> None:
        with self._lock:
            self._armed = False

    def submit(self, fn, /, *args, **kwargs):
        with self._lock:
            if not self._armed or self.cut:
                return self._inner.submit(fn, *args, **kwargs)
            self.steps += 1
            if self.steps != self._cut_before:
                return self._inner.submit(fn, *args, **kwargs)
            self.cut = True
            on_cut = self._on_cut

        def cut():
            if on_cut is not None:
                on_cut()
            raise RefitAborted("check_transport: refit cut short before one of its blocking steps")

        return self._inner.submit(cut)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._inner.shutdown(wait=wait, cancel_futures=cancel_futures)
