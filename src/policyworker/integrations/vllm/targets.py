"""What one vLLM rank loads: the checkpoint boxes behind each of its parameters.

vLLM's linear layers (QKV, merged gate/up, column and row parallel, replicated) fuse
and shard checkpoint tensors; :func:`vllm_targets` walks a loaded vLLM model and
says, per parameter, which box of which checkpoint tensor fills which part of it and
with which ``loaded_shard_id`` vLLM's own weight loader takes it.
:func:`needs_from_vllm_model` is what a rank publishes for the trainers' plan
(:mod:`.vllm_plan`), so the plan follows vLLM's own choices (padded vocabulary, kv
head replication, tp split) instead of a guess of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from policyworker.errors import ConfigError
from policyworker.integrations.vllm.fp8 import fp8_fields, fp8_targets
from policyworker.integrations.vllm.moe import expert_targets, is_routed_experts
from policyworker.integrations.vllm.plan import Need, Needs

__all__ = ["Target", "needs_from_vllm_model", "needs_of", "vllm_targets"]


def _box(shape: tuple[int, ...], dim: int | None, start: int, size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lo, hi = [0] * len(shape), list(shape)
    if dim is not None:
        lo[dim], hi[dim] = start, start + size
    return tuple(lo), tuple(hi)


def _linear_needs(module: Any, pname: str, checkpoint: list[str], base: str) -> list[tuple[Need, Any]]:
    """Boxes of the checkpoint tensors one vLLM linear layer's parameter ``pname`` loads.

    Each with the ``loaded_shard_id`` vLLM's model loader passes the layer's weight
    loader for it (``"q"``/``"k"``/``"v"``, the index of a merged member, else None).
    """
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    tp_rank, tp_size = getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)
    in_size = module.input_size
    bias = pname == "bias"
    out: list[tuple[Need, Any]] = []

    def add(name: str, rows_total: int, dim: int | None, start: int, size: int, shard: Any = None) -> None:
        shape = (rows_total,) if bias else (rows_total, in_size)
        lo, hi = _box(shape, dim, start, size)
        out.append((Need(f"{base}{name}.{pname}", shape, lo, hi), shard))

    if isinstance(module, QKVParallelLinear):
        q, k, v = checkpoint
        hs = module.head_size
        vhs = getattr(module, "v_head_size", hs)
        kv_rank = tp_rank // module.num_kv_head_replicas
        add(q, module.total_num_heads * hs, 0, tp_rank * module.num_heads * hs, module.num_heads * hs, "q")
        add(k, module.total_num_kv_heads * hs, 0, kv_rank * module.num_kv_heads * hs, module.num_kv_heads * hs, "k")
        add(v, module.total_num_kv_heads * vhs, 0, kv_rank * module.num_kv_heads * vhs, module.num_kv_heads * vhs,
            "v")
    elif isinstance(module, MergedColumnParallelLinear):
        if len(checkpoint) != len(module.output_sizes):
            raise ConfigError(f"{base}: {len(checkpoint)} packed names for {len(module.output_sizes)} outputs")
        for i, (name, total) in enumerate(zip(checkpoint, module.output_sizes)):
            per = total // tp_size
            add(name, total, 0, tp_rank * per, per, i)
    elif isinstance(module, ColumnParallelLinear):
        (name,) = checkpoint
        per = module.output_size_per_partition
        add(name, module.output_size, 0, tp_rank * per, per)
    elif isinstance(module, RowParallelLinear):
        (name,) = checkpoint
        shape = (module.output_size,) if bias else (module.output_size, in_size)
        # The bias of a row-parallel layer is added once, after the reduction: whole.
        lo, hi = _box(shape, None if bias else 1, tp_rank * module.input_size_per_partition,
                      module.input_size_per_partition)
        out.append((Need(f"{base}{name}.{pname}", shape, lo, hi), None))
    elif isinstance(module, ReplicatedLinear):
        (name,) = checkpoint
        add(name, module.output_size, None, 0, 0)
    else:
        raise ConfigError(f"vLLM layer {type(module).__name__} ({base.rstrip('.')}) is not supported by the "
                          "policyworker backend yet", param=f"{base}{pname}")
    return out


@dataclass(frozen=True, slots=True)
class Target:
    """Where one `Need` goes: parameter ``pname`` of vLLM module ``module``, via ``shard``."""

    need: Need
    module: str
    pname: str
    shard: Any = None
    #: Not sent by the trainers but derived from what they send (a block-FP8 weight's scales).
    derived: bool = False
    #: Block size when this box lands as block-FP8 (:mod:`.vllm_fp8`), else 0.
    fp8_block: int = 0


def vllm_targets(model: torch.nn.Module) -> list[Target]:
    """What this vLLM rank loads, read off vLLM's own layers, and where each box goes.

    Per parameter of ``model`` (vLLM names; tied ones once): the checkpoint tensors its
    loader reads and the box of each — fused ``qkv_proj`` / ``gate_up_proj`` split into
    their members by the model's ``packed_modules_mapping``, q heads by the layer's
    ``num_heads`` on its ``tp_rank``, kv heads by ``tp_rank // num_kv_head_replicas``
    (replicated when tp exceeds them), the vocabulary by the embedding's own shard
    indices (vLLM pads it; only real rows are needed), row-parallel inputs by
    ``input_size_per_partition``; norms whole; block-FP8 linear layers' weights as fp8
    boxes plus their derived block scales (:mod:`.vllm_fp8`); routed experts (``FusedMoE``)
    per local expert (:mod:`.vllm_moe`). A layer vLLM wrapped for LoRA
    (``<layer>.base_layer``) loads what the layer itself loads, under the checkpoint's
    names. Layers it does not know (other quantized layers, quantized or padded
    experts) are a ConfigError naming them.
    """
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    targets: list[Target] = []
    for real, param in model.named_parameters():
        mod_name, _, pname = real.rpartition(".")
        module = model.get_submodule(mod_name)
        checkpoint_mod = _checkpoint_module(model, mod_name)
        name = f"{checkpoint_mod}.{pname}" if checkpoint_mod else pname  # the Need's (checkpoint) name
        if is_routed_experts(module):  # FusedMoE's experts: each local expert's boxes
            targets += expert_targets(module, mod_name, pname, Target)
            continue
        quantized = getattr(module, "quant_method", None) is not None and \
            type(module.quant_method).__name__ not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
        if quantized and not isinstance(module, LinearBase):
            raise ConfigError(f"{mod_name} is quantized ({type(module.quant_method).__name__}); the policyworker "
                              "backend moves unquantized weights and block-FP8 linear layers only", param=name)
        if isinstance(module, LinearBase):
            parent, _, leaf = checkpoint_mod.rpartition(".")
            base = f"{parent}." if parent else ""
            pairs = _linear_needs(module, pname, packed.get(leaf, [leaf]), base)
            if quantized:  # block-FP8 (else a ConfigError naming the layer)
                targets += [Target(need, mod_name, pname, shard, derived, block)
                            for need, shard, derived, block in fp8_targets(module, pname, pairs)]
            else:
                targets += [Target(need, mod_name, pname, shard) for need, shard in pairs]
        elif isinstance(module, VocabParallelEmbedding):
            si = module.shard_indices
            shape = (module.org_vocab_size, module.embedding_dim)
            need = Need(name, shape, (si.org_vocab_start_index, 0), (si.org_vocab_end_index, shape[1]))
            targets.append(Target(need, mod_name, pname))
        elif isinstance(module, (RMSNorm, torch.nn.LayerNorm)):
            shape = tuple(param.shape)
            targets.append(Target(Need(name, shape, (0,) * len(shape), shape), mod_name, pname))
        else:
            raise ConfigError(f"vLLM layer {type(module).__name__} ({mod_name}) is not supported by the "
                              "policyworker backend yet", param=name)
    return targets


def _checkpoint_module(model: torch.nn.Module, mod_name: str) -> str:
    """``mod_name`` as the checkpoint names it: vLLM's LoRA wrappers hold the layer they
    wrap as ``<wrapper>.base_layer`` (the wrapper has the layer's own name)."""
    parent, _, leaf = mod_name.rpartition(".")
    if leaf == "base_layer" and parent and \
            getattr(model.get_submodule(parent), "base_layer", None) is model.get_submodule(mod_name):
        return parent
    return mod_name


def needs_of(targets: list[Target], *, rank: int, tp_rank: int, tp_size: int, dtype: Any) -> Needs:
    """What the trainers must send for ``targets`` (derived targets are not sent)."""
    return Needs(rank=rank, tp_rank=tp_rank, tp_size=tp_size, dtype=str(dtype).removeprefix("torch."),
                 needs=[t.need for t in targets if not t.derived], **fp8_fields(targets))


def needs_from_vllm_model(model: torch.nn.Module, *, rank: int, dtype: Any) -> Needs:
    """What this vLLM rank loads (:func:`vllm_targets`' boxes), as published to the trainers."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return needs_of(vllm_targets(model), rank=rank, tp_rank=get_tensor_model_parallel_rank(),
                    tp_size=get_tensor_model_parallel_world_size(), dtype=dtype)
