"""A rank's local tensors against a plan: build the plan from a model, check, view, allocate.

* :func:`plan_for_source` — the plan from a ``ModelConfig`` / shape specs (placement
  rules) or from a DTensor state dict (its placements *are* the training layout);
* :func:`check_local_tensors` — a rank's tensors are exactly the plan's (names,
  shapes, dtypes), else ``ConfigError``;
* :func:`shard_views` — a training rank's shards as views of full tensors (no copies);
* :func:`flat_local_tensors` — destination tensors as views of one zeroed buffer in
  the trainer's order (so copies coalesce);
* :func:`as_plan` — a ``ReshardPlan`` from itself or its refit-info dict (hash checked).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from policyworker.errors import ConfigError, PlanMismatch
from policyworker.layout.plan import ReshardPlan
from policyworker.layout.planner import as_parallelism, build_plan, plan_from_layouts

__all__ = ["any_dtensor", "as_plan", "check_local_tensors", "flat_local_tensors", "is_dtensor", "plan_for_source",
           "shard_views", "validate_kv_scales"]


def as_plan(plan: Any) -> ReshardPlan:
    """``plan`` itself, or the plan of its refit-info dict; a dict whose claimed hash does
    not match its contents is a ``PlanMismatch``."""
    if isinstance(plan, ReshardPlan):
        return plan
    if not isinstance(plan, Mapping):
        raise ConfigError(f"plan must be a ReshardPlan or its refit-info dict, got {type(plan).__name__}")
    claimed = plan.get("hash")
    out = ReshardPlan.from_dict({k: v for k, v in plan.items() if k != "hash"})
    if claimed is not None and claimed != out.hash:
        raise PlanMismatch(f"the plan's contents hash to {out.hash[:12]}…, its dict claims {str(claimed)[:12]}…")
    return out


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # very old torch: no DTensor, so nothing is one
        return None
    return DTensor


def is_dtensor(t: Any) -> bool:
    # Called once per tensor on every refit: the import is looked up once, not per call.
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def any_dtensor(tensors: Iterable[Any]) -> bool:
    """Whether any of ``tensors`` is a DTensor: one check per distinct type (it runs on every
    refit, over every parameter, before the trainer can offer it)."""
    cls = _dtensor_type()
    return cls is not None and any(issubclass(t, cls) for t in set(map(type, tensors)))


def plan_for_source(
    source: Any,
    train_parallelism: Any,
    gen_parallelism: Any,
    train_world_size: int,
    gen_world_size: int,
    *,
    gen_fused: bool = True,
    dtype: Any = "bfloat16",
    config: Any = None,
) -> ReshardPlan:
    """The reshard plan from a ModelConfig / specs (rules) or a DTensor state dict.

    ``dtype`` applies to a ModelConfig's parameters (specs and DTensors carry their own).
    ``config`` (a ModelConfig) places a DTensor source's generation side by heads.
    """
    if isinstance(source, Mapping) and source and all(is_dtensor(t) for t in source.values()):
        from policyworker.layout.dtensor import dtensor_layout, dtensor_specs
        from policyworker.layout.rules import rule_layout

        gen = as_parallelism(gen_parallelism, "gen")
        gen.check_world_size(gen_world_size, side="gen")
        from policyworker.layout.experts import split_expert_layout

        # Fused expert tensors (transformers >= 5) are planned as their per-expert members.
        specs, src = split_expert_layout(dtensor_specs(source), dtensor_layout(source, world_size=train_world_size))
        dst = rule_layout(specs, gen, config=config, fused=gen_fused)
        train = as_parallelism(train_parallelism, "train") if train_parallelism is not None else None
        return plan_from_layouts(specs, src, dst, train=train, gen=gen, gen_fused=gen_fused)
    return build_plan(source, train_parallelism, gen_parallelism, train_world_size, gen_world_size,
                      gen_fused=gen_fused, dtype=dtype)


def check_local_tensors(plan: ReshardPlan, side: str, rank: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ConfigError`` unless ``tensors`` are exactly the plan's local tensors of ``rank``."""
    want = plan.local_tensors(side, rank)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ConfigError(f"{side} rank {rank} lacks {len(missing)} local tensors the plan needs, e.g. {missing[0]!r}",
                          rank=rank, param=missing[0])
    for name, spec in want.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(spec.shape) or str(t.dtype).removeprefix("torch.") != spec.dtype:
            raise ConfigError(
                f"{side} rank {rank}: {name!r} is {str(t.dtype).removeprefix('torch.')}{list(t.shape)}, "
                f"the plan says {spec.dtype}{list(spec.shape)}", rank=rank, param=name)


def shard_views(plan: ReshardPlan, rank: int, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Training rank ``rank``'s local tensors as *views* of full tensors (no copies).

    Each local tensor must be one box of one parameter (true of every non-fused
    training layout); the views then follow the full tensors as they train.
    """
    params = plan.params
    out = {}
    for name, spec in plan.local_tensors("src", rank).items():
        if len(spec.pieces) != 1 or any(spec.pieces[0].at):
            raise ConfigError(f"local tensor {name!r} of train rank {rank} is not a single box of one parameter",
                              rank=rank, param=name)
        piece = spec.pieces[0]
        pname = params[piece.param].name
        t = full.get(pname)
        if t is None:
            raise ConfigError(f"train rank {rank} has no full tensor {pname!r}", rank=rank, param=pname)
        if tuple(t.shape) != tuple(params[piece.param].shape):
            raise ConfigError(f"{pname!r} is {list(t.shape)}, the plan says {list(params[piece.param].shape)}",
                              rank=rank, param=pname)
        view = t.detach()
        for d, (a, b) in enumerate(zip(piece.start, piece.stop)):
            view = view.narrow(d, a, b - a)
        out[name] = view
    return out


def validate_kv_scales(kv_scales: Any) -> dict[str, float] | None:
    if kv_scales is None:
        return None
    if not isinstance(kv_scales, Mapping):
        raise ConfigError(f"kv_scales must be a mapping of name to float, got {type(kv_scales).__name__}")
    out = {}
    for k, v in kv_scales.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"kv_scales entry {k!r}: {v!r} is not a finite float")
        out[k] = float(v)
    return out


def flat_local_tensors(plan: ReshardPlan, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s destination tensors as back-to-back views of one zeroed buffer.

    Ordered by the parameter their first piece comes from (the trainer's order), so
    copies from a flattened trainer coalesce into few, long copies.
    """
    from policyworker.config import torch_dtype

    tensors = plan.local_tensors("dst", rank)
    order = sorted(tensors, key=lambda n: min((p.param, p.start) for p in tensors[n].pieces))
    offsets, end = {}, 0
    for name in order:
        spec = tensors[name]
        item = torch.empty((), dtype=torch_dtype(spec.dtype)).element_size()
        end = -(-end // item) * item
        offsets[name] = end
        n = 1
        for d in spec.shape:
            n *= d
        end += n * item
    flat = torch.zeros(end, dtype=torch.uint8, device=device)
    out = {}
    for name in order:
        spec = tensors[name]
        dtype = torch_dtype(spec.dtype)
        item = torch.empty((), dtype=dtype).element_size()
        out[name] = torch.empty(0, dtype=dtype, device=device).set_(
            flat.untyped_storage(), offsets[name] // item, spec.shape)
    out.update(plan.dest_format.extra_tensors(plan, rank, device))  # the format's extra tensors (scales)
    return out
