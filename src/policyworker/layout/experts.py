"""Fused expert tensors (Hugging Face transformers >= 5) as the per-expert parameters plans speak.

transformers 5 holds each MoE layer's routed experts as two tensors,
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows)
and ``mlp.experts.down_proj`` ``[E, H, I]``; checkpoints on disk, vLLM's loaders and
the placement rules name each expert's matrices (``mlp.experts.<e>.gate_proj.weight``
``[I, H]``, ``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]``). Expert ``e``'s gate is
the box ``[e, 0:I, 0:H]`` of the fused tensor, its up ``[e, I:2I, 0:H]``, its down
``[e, 0:H, 0:I]``: plans stay in per-expert names, and a trainer holding fused tensors
offers views of them (no copies), so a shard of an expert is sent straight from the
fused storage.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ["expert_specs", "expert_views", "has_fused_experts"]

_FUSED = re.compile(r"(.*\.mlp\.experts\.)(gate_up_proj|down_proj)")


def has_fused_experts(names: Any) -> bool:
    """Whether any of ``names`` is a fused expert tensor."""
    return any(_FUSED.fullmatch(n) for n in names)


def _split(name: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, int] | None, tuple[int, ...]]]:
    """``(per-expert name, expert, row span or None, shape)`` of each member of fused ``name``."""
    m = _FUSED.fullmatch(name)
    base, kind = m.group(1), m.group(2)
    if len(shape) != 3:
        raise ConfigError(f"fused expert tensor {name!r} has shape {list(shape)}, expected 3 dims "
                          "[experts, rows, cols]", param=name)
    experts, rows, cols = shape
    out = []
    if kind == "gate_up_proj":
        if rows % 2:
            raise ConfigError(f"{name!r} has {rows} rows: gate and up halves must be equal", param=name)
        half = rows // 2
        for e in range(experts):
            out.append((f"{base}{e}.gate_proj.weight", e, (0, half), (half, cols)))
            out.append((f"{base}{e}.up_proj.weight", e, (half, rows), (half, cols)))
    else:
        for e in range(experts):
            out.append((f"{base}{e}.down_proj.weight", e, None, (rows, cols)))
    return out


def expert_specs(specs: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``{name: (shape, dtype)}`` with every fused expert tensor replaced by its per-expert
    members, in expert order (gate, up per expert where the fused gate_up stood; down
    where down_proj stood). Other entries keep their place."""
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for name, (shape, dtype) in specs.items():
        if _FUSED.fullmatch(name):
            for member, _, _, mshape in _split(name, tuple(shape)):
                out[member] = (mshape, dtype)
        else:
            out[name] = (tuple(shape), dtype)
    return out


def expert_views(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``tensors`` with every fused expert tensor replaced by views of its per-expert members.

    The views share the fused tensor's storage: they follow it as it trains, and a sender
    packs a member's box straight from it.
    """
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if not _FUSED.fullmatch(name):
            out[name] = t
            continue
        full = t.detach()
        for member, e, rows, _ in _split(name, tuple(full.shape)):
            view = full[e]
            out[member] = view if rows is None else view.narrow(0, rows[0], rows[1] - rows[0])
    return out
