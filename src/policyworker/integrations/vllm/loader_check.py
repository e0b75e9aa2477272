"""Where each box lands, checked once against vLLM's own weight loaders.

Random boxes go through each layer's ``weight_loader`` (as vLLM's model loader calls
it, with its shard id) into a scratch tensor and must equal what the stage's receive
views put in place, bit for bit: a layer whose loader places a box elsewhere is refused
before any refit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from policyworker.errors import PlanMismatch
from policyworker.integrations.vllm.stage import _materialize

if TYPE_CHECKING:
    from policyworker.integrations.vllm.stage import VllmStage

__all__ = ["check_with_vllm_loaders"]


def _own_loader(loader: Callable) -> Callable:
    """The layer's own loader under vLLM's layerwise-reload wrappers.

    After ``reload_weights`` the loaders on the parameters' restore metadata (which the
    scratch tensors copy) stay wrapped. The wrapper works on the *live* layer's reload
    state: outside a reload it returns without loading anything (the check saw zeros and
    refused the first layer it met), during one it would buffer the tensor for the live
    layer. The check must never reach the live model, so it calls what is under it.
    """
    while getattr(loader, "__name__", None) == _RELOAD_WRAPPER:
        inner = getattr(loader, "__wrapped__", None)
        if inner is None:
            raise PlanMismatch("vLLM's layerwise-reload loader wraps no loader the check can call")
        loader = inner
    return loader


_RELOAD_WRAPPER = "online_process_loader"  # vllm.model_executor.model_loader.reload.layerwise


def check_with_vllm_loaders(stage: VllmStage, seed: int = 0) -> None:
    """Random boxes through vLLM's weight loaders must land where ``stage``'s views put them.

    Runs on scratch tensors, one parameter at a time (neither the staging set nor the
    live model is touched). ``PlanMismatch`` names the first parameter that differs.
    """
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    gen = torch.Generator().manual_seed(seed)
    for slot in stage._slots:
        if not slot.targets:
            continue
        module = slot.owners[0][0]
        scratch = _materialize(slot.meta, module, stage.device)
        mirror = _materialize(slot.meta, module, stage.device)
        views = stage._slot_views(slot, mirror)
        loader = _own_loader(getattr(scratch, "weight_loader", default_weight_loader))
        for t in slot.targets:
            shape = tuple(b - a for a, b in zip(t.need.start, t.need.stop))
            box = torch.randn(shape, generator=gen).to(scratch.dtype)
            carrier = torch.zeros(t.need.shape, dtype=scratch.dtype, device=scratch.device)
            carrier[tuple(slice(a, b) for a, b in zip(t.need.start, t.need.stop))] = box
            with torch.no_grad():
                if isinstance(t.shard, dict):  # keyword arguments (vLLM's MoE loader)
                    loader(scratch, carrier, **t.shard)
                else:
                    loader(scratch, carrier) if t.shard is None else loader(scratch, carrier, t.shard)
                views[t.need.name].copy_(box)
        # bit for bit (float8 has no torch.equal on CPU)
        if not (mirror.dtype == scratch.dtype and torch.equal(mirror.view(torch.uint8), scratch.view(torch.uint8))):
            raise PlanMismatch(f"vLLM's loader places {slot.targets[0].need.name} (and its fused members) "
                               "elsewhere than the policyworker backend receives it; this layer is not supported")
