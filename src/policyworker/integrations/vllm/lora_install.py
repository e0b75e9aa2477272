"""A new adapter version copied into the ``LoRAModel`` vLLM already serves, instead of a new one.

vLLM's own install of an adapter (``LoRAModel.from_lora_tensors``, then the manager's
``add_adapter`` and ``activate_adapter``) keeps the factor tensors it is given when their
device and dtype already fit: ``A`` as given, ``B`` multiplied in place by its module's
scaling (vLLM's ``optimize``), packed modules (``qkv_proj``, ``gate_up_proj``) holding
lists of those same tensors. :meth:`InPlaceAdapter.capture` checks that this held for
every factor of an installed adapter (identity, not assumption: a dtype conversion or a
pinned copy makes it decline). Then a later version of the same adapter is installed by
copying its factors into those tensors, doing what vLLM's install did to them (``B`` times
the scaling vLLM read), and re-activating the adapter: ``activate_adapter`` writes every
module's slot buffers from them (vLLM's ``set_lora``, which cuts a tensor-parallel rank's
slice). No ``LoRAModel`` is built, registered or packed per version.

The copy overwrites the only copy of the previous version: the caller marks the weights
touched before it starts (a failure after that leaves them torn, never mixed silently).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["InPlaceAdapter", "layer_scales"]


def _held(lora: Any) -> list[torch.Tensor]:
    """Every factor tensor a ``LoRAModel`` holds (packed modules hold lists)."""
    out = []
    for weights in lora.loras.values():
        for t in (weights.lora_a, weights.lora_b):
            out += [x for x in t if x is not None] if isinstance(t, (list, tuple)) else ([t] if t is not None else [])
    return out


def layer_scales(lora: Any, given: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
    """Right after ``LoRAModel.from_lora_tensors(given)`` (before the manager packs it): the
    scaling vLLM will multiply each ``B`` of ``given`` by, by name; None when some factor of
    ``given`` is not held as given (copied on a device or dtype change)."""
    names = {id(t): name for name, t in given.items()}
    scales: dict[str, float] = {}
    seen: set[str] = set()
    for weights in lora.loras.values():
        a, b = weights.lora_a, weights.lora_b
        if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
            return None  # not a plain module's factors: nothing to learn from
        name_a, name_b = names.get(id(a)), names.get(id(b))
        if name_a is None or name_b is None:
            return None
        scales[name_b] = float(weights.scaling)
        seen |= {name_a, name_b}
    return scales if seen == set(given) else None


class InPlaceAdapter:
    """The installed ``LoRAModel``'s factor tensors by our names, and each ``B``'s scaling."""

    def __init__(self, lora: Any, tensors: Mapping[str, torch.Tensor], scales: Mapping[str, float]) -> None:
        self.lora = lora
        self.names = list(tensors)
        self.tensors = [tensors[n] for n in self.names]
        by_scale: dict[float, list[torch.Tensor]] = {}
        for name, scale in scales.items():
            if scale != 1:  # vLLM's optimize leaves a scaling of 1 alone
                by_scale.setdefault(scale, []).append(tensors[name])
        self._scaled = list(by_scale.items())

    @classmethod
    def capture(cls, lora: Any, given: Mapping[str, torch.Tensor],
                scales: Mapping[str, float] | None) -> InPlaceAdapter | None:
        """After vLLM installed ``lora`` from ``given``: an in-place installer, or None when
        ``lora`` does not hold exactly the tensors of ``given`` (then every version is
        installed through a new ``LoRAModel``)."""
        if scales is None:
            return None
        held = _held(lora)
        if len(held) != len(given) or {id(t) for t in held} != {id(t) for t in given.values()}:
            return None
        return cls(lora, given, scales)

    def fits(self, staging: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``staging`` holds the same factors (names, shapes) as the installed adapter."""
        if len(staging) != len(self.names):
            return False
        for name, t in zip(self.names, self.tensors):
            s = staging.get(name)
            if s is None or s.shape != t.shape:
                return False
        return True

    def copy_from(self, staging: Mapping[str, torch.Tensor]) -> None:
        """The factors of ``staging`` into the installed tensors, as vLLM's install leaves them."""
        torch._foreach_copy_(self.tensors, [staging[n] for n in self.names])
        for scale, tensors in self._scaled:
            torch._foreach_mul_(tensors, scale)
