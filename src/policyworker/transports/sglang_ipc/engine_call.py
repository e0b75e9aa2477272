"""sglang_ipc's engine side: what the gather source says to its engine and how the answer comes back.

The source calls ``engine.update_weights_from_tensor`` once per bucket (the transport's
``_call_engine``), bounded by the refit deadline, inline or on one helper thread
(:class:`EngineCaller`). Here: its request (SGLang's: one entry per tp rank,
``weight_version`` on the last bucket, :func:`engine_request`) and its answer, a verdict
code that the per-bucket round spreads to every rank of the engine, so every rank
raises the same error class (:func:`error_class`).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import torch

from policyworker.errors import (
    ConfigError,
    PeerLost,
    PolicyWorkerError,
    ProtocolError,
    RefitAborted,
    RefitTimeout,
    TransportError,
)
from policyworker.transports.base import TransportContext
from policyworker.transports.sglang_ipc.format import to_base64
from policyworker.wire import Decoder, Message

__all__ = ["BucketBlob", "EngineCaller", "answer_of", "code_of", "engine_request", "error_class"]


class BucketBlob(Message, frozen=True, kw_only=True):
    """A rank's SGLang blob of one bucket (only when the engine wants blobs)."""

    version: int
    bucket: int
    blob: bytes


_BLOB = Decoder(BucketBlob)

# Verdict codes broadcast by the source: every rank raises the same class.
_VERDICTS: dict[int, type[PolicyWorkerError]] = {
    1: TransportError,  # the engine refused the bucket
    2: PeerLost,
    3: RefitTimeout,
    4: ProtocolError,
    5: ConfigError,
    6: RefitAborted,
}
_CODES = {cls: code for code, cls in _VERDICTS.items()}


def code_of(exc: PolicyWorkerError) -> int:
    """The verdict code of ``exc`` (its nearest class with a code; else "refused": 1)."""
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return 1


def error_class(code: int) -> type[PolicyWorkerError]:
    """The error class every rank raises for verdict ``code``."""
    return _VERDICTS.get(code, TransportError)


class EngineCaller:
    """The gather source's calls into its engine, and their answers.

    A call (the transport's ``_call_engine``) is made inline (a deferred ``(fn, *args)``
    tuple, run when its answer is taken) or on one helper thread (a ``Future``); either
    way its answer is ``(code, message, reading event or None)``.
    """

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, *call: Any) -> concurrent.futures.Future:
        """Run ``call`` (``fn, *args``) on the helper thread."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="policyworker-sglang-call")
        return self._pool.submit(*call)

    @classmethod
    def take(cls, pending: Any, deadline: float, reading: list[Any], index: int, on_device: bool) -> tuple[int, str]:
        """The engine's (code, message) for bucket ``index``; a handed-over CUDA event is kept
        in ``reading`` for that bucket's slot when ``on_device``, else waited for here."""
        code, message, event = cls.answer(pending, deadline)
        if isinstance(event, torch.cuda.Event):
            if on_device and not code:
                reading[index % len(reading)] = event
            else:
                event.synchronize()  # bounded: device work already queued
        return code, message

    @staticmethod
    def answer(pending: Any, deadline: float) -> tuple[int, str, Any]:
        """The engine's (code, message, reading event) for the previous bucket; (0, "", None) on
        ranks that call no engine."""
        if pending is None:
            return 0, "", None
        if not isinstance(pending, concurrent.futures.Future):
            fn, *args = pending
            return fn(*args)  # bounded: the engine gets the time left as its timeout
        try:
            return pending.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            return code_of(RefitTimeout("x")), "the engine did not answer before the deadline", None

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def engine_request(ctx: TransportContext, version: int, layout: Any, gathered: Any, wants_blobs: bool) -> Any:
    """SGLang's request for bucket ``layout``: one entry per tp rank (the gathered blobs when the
    engine wants them), the buffers' handles, SGLang's flags on the first / last bucket."""
    from policyworker.transports.sglang_ipc.client import UpdateWeightsFromTensorRequest

    state = ctx.state
    blobs: list[str] = []
    if wants_blobs:
        for rank, raw in enumerate(gathered or []):
            msg = _BLOB.decode(raw)
            if msg.version != version or msg.bucket != layout.index:
                raise ProtocolError(f"tp rank {rank} sent bucket {msg.bucket} of refit {msg.version}")
            blobs.append(to_base64(msg.blob))
    last = layout.index == len(state["buckets"]) - 1
    return UpdateWeightsFromTensorRequest(
        serialized_named_tensors=blobs,
        flush_cache=bool(ctx.option("flush_cache", True)) and last,
        abort_all_requests=bool(ctx.option("abort_all_requests", False)) and layout.index == 0,
        weight_version=str(version) if last else None,
        torch_empty_cache=bool(ctx.option("torch_empty_cache", False)) and last,
        buffers=state["peer_handles"][layout.index % len(state["peer_handles"])], metadata=layout.metadata,
        bucket=layout.index, num_buckets=len(state["buckets"]),
    )


def answer_of(result: Any) -> tuple[int, str, Any]:
    """The engine's result as (code, message, reading event or None)."""
    reading = getattr(result, "reading", None)
    if not result.success:
        return 1, f"the engine refused it: {result.message}", reading
    return 0, "", reading
