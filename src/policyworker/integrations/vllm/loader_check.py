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

    Runs on a scratch tensor, one parameter at a time (neither the staging set nor the
    live model is touched). Each box, loaded by vLLM's loader, must be found bit for bit in
    the stage's view of it, which is then zeroed; once every box of the parameter is
    loaded, no byte of the scratch may be left (a loader that wrote elsewhere too).
    ``PlanMismatch`` names the first parameter that differs. Memory: the scratch, the
    loader's input (the full tensor before tensor-parallel cuts) and, on the host, the box.
    """
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    gen = torch.Generator().manual_seed(seed)
    for slot in stage._slots:
        if not slot.targets:
            continue
        module = slot.owners[0][0]
        scratch = _materialize(slot.meta, module, stage.device)
        dtype = scratch.dtype
        loader = _own_loader(getattr(scratch, "weight_loader", default_weight_loader))
        for t in slot.targets:
            region = tuple(slice(a, b) for a, b in zip(t.need.start, t.need.stop))
            box = torch.randn(tuple(r.stop - r.start for r in region), generator=gen).to(dtype)
            carrier = torch.zeros(t.need.shape, dtype=dtype, device=scratch.device)
            carrier[region] = box
            with torch.no_grad():
                if isinstance(t.shard, dict):  # keyword arguments (vLLM's MoE loader)
                    loader(scratch, carrier, **t.shard)
                else:
                    loader(scratch, carrier) if t.shard is None else loader(scratch, carrier, t.shard)
                del carrier
                got = stage._slot_views(slot, scratch)[t.need.name]  # after the load: a loader may re-point
                if scratch.dtype != dtype or not _same_bits(got, box):
                    _refuse(slot)
                got.zero_()
        if scratch.view(torch.uint8).any():  # a byte no view accounts for
            _refuse(slot)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bit for bit (float8 has no torch.equal on CPU); ``b`` is on the host
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8))


def _refuse(slot) -> None:
    raise PlanMismatch(f"vLLM's loader places {slot.targets[0].need.name} (and its fused members) "
                       "elsewhere than the policyworker backend receives it; this layer is not supported")
