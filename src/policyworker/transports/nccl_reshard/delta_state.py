"""nccl_reshard's delta mode, its settings and what each rank keeps between refits.

A trainer keeps, per distinct *stream* (the bytes of one transfer, its copies back to
back), a shadow of the bytes it last sent and their per-copy checksums; a receiver
keeps, per stream, the per-copy checksums it verified at its last commit (trusted by
``delta_verify="incremental"`` only while its tensors stay where they were). The refit
itself is :mod:`.nccl_delta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from policyworker.errors import ConfigError
from policyworker.layout.apply import copy_nbytes
from policyworker.layout.plan import Copy, ReshardPlan, dtype_size
from policyworker.transports.nccl_reshard.schedule import _DirectSpans

__all__ = ["DeltaSettings", "check_verify", "forget_verified"]

_SAMPLES = 4096  # units sampled per stream for the changed-fraction estimate


@dataclass(frozen=True, slots=True)
class DeltaSettings:
    """``delta_max_fraction``: above this estimated changed fraction the refit is full;
    ``full_every``: every N-th version is full (None: never forced); ``verify``: the
    receiver's check, ``"full"`` or ``"incremental"`` (step 3 of the module docstring)."""

    max_fraction: float = 0.25
    full_every: int | None = None
    verify: str = "full"


_VERIFY = ("full", "incremental")


def check_verify(mode: Any) -> str:
    """``mode`` when it is a ``delta_verify`` value, else ``ConfigError``."""
    if mode not in _VERIFY:
        raise ConfigError(f"delta_verify must be one of {_VERIFY}, got {mode!r}", transport="nccl_reshard")
    return mode


@dataclass(slots=True)
class _Stream:
    """The bytes of one transfer (its copies back to back) as units of ``unit`` bytes."""

    copies: list[Copy]
    nbytes: int
    unit: int
    segments: list[tuple[int, int]]  # (offset, bytes) of each copy in the stream
    shadow: torch.Tensor | None = None  # trainer: the bytes last sent
    sums: list[int] | None = None  # trainer: the shadow's checksum per copy, when known
    scratch: torch.Tensor | None = None  # the stream packed, when it is not one span
    stride: int = 1  # trainer: every stride-th unit is sampled for the changed fraction
    index: int = 0  # its key among the state's direct spans
    verified: list[int] | None = None  # receiver: its copies' checksums (unsigned) as last verified


@dataclass(slots=True)
class _State:
    plan_hash: str
    streams: dict[tuple, _Stream] = field(default_factory=dict)  # trainer: by source regions; receiver: by peer
    shadow_version: int | None = None  # trainer: the version its shadows hold, after a good verdict
    base_valid: bool = True  # receiver: False after a failed delta (next refit full)
    received: int | None = None  # receiver: the version its last good refit returned
    spans: _DirectSpans = field(default_factory=_DirectSpans)  # each stream's span, while the tensors stay put
    # receiver: where its tensors lived when the streams' ``verified`` checksums were
    # committed (None: not trusted; the next delta is checked in full)
    verified_at: tuple | None = None


def forget_verified(state: dict) -> None:
    """The receiver's verified checksums are no longer trusted (a reconnect)."""
    st = state.get("delta")
    if st is not None:
        st.verified_at = None


def _make_stream(plan: ReshardPlan, copies: list[Copy], index: int) -> _Stream:
    fmt = plan.dest_format
    if any(fmt.converts(plan, c) for c in copies):
        raise ConfigError(f"delta refits of copies the {type(fmt).__name__} converts are not supported",
                          transport="nccl_reshard")
    unit = min(dtype_size(plan.params[c.param].dtype) for c in copies)
    segments, at = [], 0
    for c in copies:
        n = copy_nbytes(plan, c)
        segments.append((at, n))
        at += n
    return _Stream(copies, at, unit, segments, stride=_sample_stride(at // unit), index=index)


def _sample_stride(n: int) -> int:
    """A prime stride giving about ``_SAMPLES`` of ``n`` units (prime: no lockstep with
    a tensor's rows): the estimate costs a few thousand reads, not a pass."""
    p = max(127, n // _SAMPLES) | 1
    while any(p % d == 0 for d in range(3, int(p ** 0.5) + 1, 2)):
        p += 2
    return p
