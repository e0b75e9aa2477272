"""vLLM's routed experts (``RoutedExperts``, built by ``FusedMoE``) as refit targets.

A vLLM MoE layer holds its local experts fused: ``w13_weight`` ``[E_local, 2·I/tp, H]``
(per expert, this tp rank's rows of ``gate_proj`` — vLLM's ``w1`` — then of ``up_proj``,
``w3``) and ``w2_weight`` ``[E_local, H, I/tp]`` (this tp rank's columns of
``down_proj``). Which global experts a rank holds is vLLM's expert map (with
``enable_expert_parallel``: ``-1`` for an expert not on this rank; tp inside the MoE
is then 1). :func:`expert_targets` lists, per local expert in local order, the box of
each checkpoint tensor (``mlp.experts.<e>.gate_proj.weight`` ...) this rank loads, so
a rank receives only its own experts' bytes; seen as ``[E_local·2·I/tp, H]`` and
``[E_local·H, I/tp]`` these boxes are consecutive runs of rows, which is how the
staging receives them.

Commit: vLLM's CPU MoE kernel repacks ``w13``/``w2`` into its grouped-gemm layout at
load, but a second ``process_weights_after_loading`` finds the kernel built and skips
the repack (it only copies the raw bytes back). :func:`repack_experts` runs the
kernel's own repack (``moe_kernel.fused_experts.process_weights_after_loading``) on
the layer copy holding the staged bytes, so the swapped-in tensors are packed as the
kernel expects.
"""

from __future__ import annotations

from typing import Any

import torch

from policyworker.errors import ConfigError
from policyworker.integrations.vllm.plan import Need

__all__ = ["expert_targets", "is_routed_experts", "kernel_built", "repack_experts"]

_UNQUANTIZED = "UnquantizedFusedMoEMethod"


def loaded_form(module: torch.nn.Module, pname: str, live: torch.Tensor) -> torch.Tensor:
    """The parameter as vLLM's loaders fill it: its restore metadata, else the live one."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(module)
    meta = info.restore_metadata[0].get(pname) if info is not None else None
    return meta if meta is not None else live



def is_routed_experts(module: Any) -> bool:
    """Whether ``module`` is vLLM's routed-experts layer (the holder of ``w13``/``w2``)."""
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:  # a vLLM without it has no such layers
        return False
    return isinstance(module, RoutedExperts)


def _checkpoint_base(mod_name: str) -> str:
    """``model.layers.3.mlp.experts.routed_experts`` -> ``model.layers.3.mlp.experts.``"""
    parent, _, leaf = mod_name.rpartition(".")
    if leaf == "routed_experts":
        return f"{parent}."
    return f"{mod_name}."


def expert_targets(module: Any, mod_name: str, pname: str, target_cls: Any) -> list[Any]:
    """The `Target`s of parameter ``pname`` of vLLM routed-experts layer ``mod_name``.

    ConfigError naming the layer for what the backend cannot fill: quantized experts,
    expert biases, padded hidden or intermediate sizes, redundant (EPLB) experts.
    """
    method = type(getattr(module, "quant_method", None)).__name__
    if method != _UNQUANTIZED:
        raise ConfigError(f"vLLM MoE layer {mod_name} is quantized ({method}); the policyworker backend refits "
                          "unquantized experts only", param=f"{mod_name}.{pname}")
    if pname not in ("w13_weight", "w2_weight"):
        raise ConfigError(f"vLLM MoE layer {mod_name} has parameter {pname!r}; the policyworker backend refits "
                          "w13_weight and w2_weight only (no expert biases)", param=f"{mod_name}.{pname}")
    cfg = module.moe_config
    par = cfg.moe_parallel_config
    tp_rank, tp_size = par.tp_rank, par.tp_size
    w13, w2 = module._parameters["w13_weight"], module._parameters["w2_weight"]

    w13 = loaded_form(module, "w13_weight", w13)
    w2 = loaded_form(module, "w2_weight", w2)
    local, rows2, hidden = w13.shape
    per = rows2 // 2
    if getattr(cfg, "hidden_dim_unpadded", hidden) not in (None, hidden) or tuple(w2.shape) != (local, hidden, per):
        raise ConfigError(f"vLLM MoE layer {mod_name} pads its experts (w13 {list(w13.shape)}, w2 "
                          f"{list(w2.shape)}); the policyworker backend refits unpadded experts only",
                          param=f"{mod_name}.{pname}")
    num = module.global_num_experts
    slots = sorted((module._map_global_expert_id_to_local_expert_id(e), e) for e in range(num))
    slots = [(i, e) for i, e in slots if i >= 0]
    if [i for i, _ in slots] != list(range(local)):
        raise ConfigError(f"vLLM MoE layer {mod_name} maps experts {slots} onto {local} local slots; the "
                          "policyworker backend needs each local slot filled by exactly one expert (no "
                          "redundant EPLB experts)", param=f"{mod_name}.{pname}")
    base = _checkpoint_base(mod_name)
    inter = per * tp_size
    lo, hi = tp_rank * per, (tp_rank + 1) * per
    names = (module.ckpt_gate_proj_name, module.ckpt_up_proj_name, module.ckpt_down_proj_name)
    out = []
    for _, e in slots:
        if pname == "w13_weight":
            for name, shard in ((names[0], "w1"), (names[1], "w3")):
                ckpt = f"{base}{e}.{name}.weight"
                need = Need(ckpt, (inter, hidden), (lo, 0), (hi, hidden))
                out.append(target_cls(need, mod_name, pname, {"weight_name": ckpt, "shard_id": shard,
                                                              "expert_id": e}))
        else:
            ckpt = f"{base}{e}.{names[2]}.weight"
            need = Need(ckpt, (hidden, inter), (0, lo), (hidden, hi))
            out.append(target_cls(need, mod_name, pname, {"weight_name": ckpt, "shard_id": "w2", "expert_id": e}))
    return out


def kernel_built(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is a routed-experts layer whose MoE kernel exists already (then
    vLLM's post-processing skips the kernel's repack: call :func:`repack_experts` after it)."""
    return is_routed_experts(layer) and getattr(layer.quant_method, "moe_kernel", None) is not None


def repack_experts(shadow: torch.nn.Module) -> None:
    """Run the MoE kernel's own repack on ``shadow``: a routed-experts layer copy whose
    staged raw weights vLLM's post-processing has just seen (and, its kernel built
    already, left unpacked)."""
    with torch.no_grad():
        shadow.quant_method.moe_kernel.fused_experts.process_weights_after_loading(shadow)
