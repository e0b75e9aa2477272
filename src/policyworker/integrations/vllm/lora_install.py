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

Re-activating costs a ``set_lora`` per module (zero the slot, copy each slice: a few hundred
small tensor calls). :class:`SlotWriter` replays what it wrote instead: once vLLM's own
activation has filled the slot, it works out each module's slot views the way the linear
layers' ``set_lora`` cuts them (tensor-parallel size 1, the plain and the merged-column
layers only) and checks them against what vLLM wrote (bitwise); later versions are then
one ``_foreach_copy_`` from the ``LoRAModel``'s tensors into those views, while the
adapter keeps its slot and every module keeps its buffers (checked each commit).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["InPlaceAdapter", "SlotWriter", "layer_scales"]


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


def _set_lora_kinds() -> tuple:
    """vLLM's ``set_lora`` functions whose writes :class:`SlotWriter` knows (``[:rows, :cols]``
    of each slice's slot, after zeroing the slot)."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.column_parallel_linear import MergedColumnParallelLinearWithLoRA

    return BaseLinearLayerWithLoRA.set_lora, MergedColumnParallelLinearWithLoRA.set_lora


class SlotWriter:
    """The slot buffers vLLM's activation of one adapter wrote, as views, with their sources."""

    def __init__(self, index: int, dst: list[torch.Tensor], src: list[torch.Tensor], buffers: list[tuple]) -> None:
        self.index, self.dst, self.src, self._buffers = index, dst, src, buffers

    @classmethod
    def capture(cls, manager: Any, lora_id: int, lora: Any, owned: InPlaceAdapter) -> SlotWriter | None:
        """Right after vLLM activated ``lora`` (registered as ``lora_id``): its slot views, or
        None when some module is of a kind this does not know, a view does not hold
        exactly what vLLM wrote, or its source is not one of the tensors ``owned`` copies
        each version into (then every version is re-activated by vLLM)."""
        from vllm.lora.layers import ClassificationHeadWithLoRA

        if lora_id not in manager.lora_index_to_id or getattr(manager, "is_pooling_model", False):
            return None  # (a pooling model's module names may be looked up another way)
        index = manager.lora_index_to_id.index(lora_id)
        kinds = _set_lora_kinds()
        written = {id(t) for t in owned.tensors}
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        buffers: list[tuple] = []
        for name, module in manager.modules.items():
            if isinstance(module, ClassificationHeadWithLoRA):
                return None  # its activation also installs modules to save
            weights = lora.get_lora(name)
            if weights is None:
                continue  # vLLM zeroed this module's slot; nothing of the adapter goes there
            if getattr(type(module), "set_lora", None) not in kinds or getattr(module, "tp_size", None) != 1:
                return None
            a, b = weights.lora_a, weights.lora_b
            n = module.n_slices
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and n == 1:
                a, b = [a], [b]
            if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) == n):
                return None
            for i in range(n):
                for factor, stacked in ((a[i], module.lora_a_stacked), (b[i], module.lora_b_stacked)):
                    if factor is None:
                        continue
                    view = stacked[i][index, 0, : factor.shape[0], : factor.shape[1]]
                    if id(factor) not in written or view.shape != factor.shape or not torch.equal(view, factor):
                        return None
                    dst.append(view)
                    src.append(factor)
            buffers.append((module, tuple(module.lora_a_stacked), tuple(module.lora_b_stacked)))
        return cls(index, dst, src, buffers) if dst else None

    def write(self, manager: Any, lora_id: int) -> bool:
        """Copy the adapter's tensors into its slot; False (nothing written) when it moved
        slot or a module replaced its buffers since the capture."""
        ids = manager.lora_index_to_id
        if self.index >= len(ids) or ids[self.index] != lora_id:
            return False
        for module, a, b in self._buffers:
            if (len(a) != len(module.lora_a_stacked) or len(b) != len(module.lora_b_stacked)
                    or any(x is not y for x, y in zip(a, module.lora_a_stacked))
                    or any(x is not y for x, y in zip(b, module.lora_b_stacked))):
                return False
        torch._foreach_copy_(self.dst, self.src)
        return True
