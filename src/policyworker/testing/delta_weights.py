"""Weights that change a little per version: the stand-in for a training step in delta tests.

``perturb_(state, fraction, seed)`` flips the lowest bit of about ``fraction`` of the
elements of every tensor (positions drawn from ``seed``; a few collide at small
fractions), so every process that replays the same seeds holds the same bytes. The
lowest mantissa bit of a finite float stays finite, so bit-exact checks stay simple.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

__all__ = ["perturb_", "versioned_state"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def perturb_(state: MutableMapping[str, torch.Tensor], fraction: float, seed: int) -> int:
    """Flip the lowest bit of ~``fraction`` of each tensor's elements in place; returns how many flips."""
    flips = 0
    for i, name in enumerate(sorted(state)):
        t = state[name]
        bits = t.view(_INT[t.element_size()]).view(-1)
        n = bits.numel()
        if fraction >= 1.0:
            bits ^= 1
            flips += n
            continue
        k = int(round(fraction * n))
        if k == 0:
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        idx = torch.randint(n, (k,), generator=g).unique()
        bits[idx] ^= 1
        flips += idx.numel()
    return flips


def versioned_state(base: MutableMapping[str, torch.Tensor], fractions: list[float]) -> dict[str, torch.Tensor]:
    """``base`` (copied) after ``perturb_`` with ``fractions[v-1]`` and seed v for v = 1, 2, ..."""
    state = {k: v.clone() for k, v in base.items()}
    for v, f in enumerate(fractions, start=1):
        perturb_(state, f, v)
    return state
