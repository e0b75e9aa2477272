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

A sharded trainer (FSDP2: DTensors) holds a fused tensor's local shard; sharded over
experts (``Shard(0)``, replicas allowed) each rank holds whole experts, and
:func:`split_expert_layout` / :func:`expert_local_views` make those experts' members
its local tensors. A fused tensor split inside an expert (its rows or columns) is a
PlanError naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from policyworker.errors import ConfigError, PlanError
from policyworker.layout.boxes import Layout, LocalSpec, Piece

__all__ = ["expert_local_views", "expert_specs", "expert_views", "has_fused_experts", "split_expert_layout"]

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


def split_expert_layout(specs: Mapping[str, tuple[tuple[int, ...], Any]],
                        layout: Layout) -> tuple[dict[str, tuple[tuple[int, ...], Any]], Layout]:
    """``(specs, layout)`` of a DTensor source with every fused expert tensor replaced by its
    members: a rank holding experts ``[e0, e1)`` of a fused tensor whole holds each of
    their members whole, as a local tensor of the member's name (see
    :func:`expert_local_views`)."""
    fused = {n for n in specs if _FUSED.fullmatch(n)}
    if not fused:
        return dict(specs), layout
    pieces: dict[str, list[Piece]] = {}
    tensors = {r: {n: t for n, t in mine.items() if n not in fused} for r, mine in layout.tensors.items()}
    for name in specs:
        if name not in fused:
            if name in layout.pieces:
                pieces[name] = list(layout.pieces[name])
            continue
        shape, dtype = tuple(specs[name][0]), specs[name][1]
        members = _split(name, shape)
        for m, _, _, _ in members:
            pieces[m] = []
        for p in layout.pieces.get(name, []):
            if tuple(p.start[1:]) != (0, 0) or tuple(p.stop[1:]) != shape[1:] or any(p.at[1:]):
                raise PlanError(f"train rank {p.rank} holds rows or columns {list(p.start)}..{list(p.stop)} of "
                                f"fused expert tensor {name!r} {list(shape)}: shard fused experts over experts "
                                "(dim 0) only", rank=p.rank, param=name)
            for m, e, _, mshape in members:
                if p.start[0] <= e < p.stop[0]:
                    pieces[m].append(Piece(p.rank, m, (0, 0), mshape, (0, 0)))
                    tensors.setdefault(p.rank, {})[m] = LocalSpec(mshape, str(dtype).removeprefix("torch."))
    return expert_specs(specs), Layout(world_size=layout.world_size, stage_of_rank=layout.stage_of_rank,
                                       pieces=pieces, tensors=tensors)


def expert_local_views(local: Mapping[str, Any], wanted: Any) -> dict[str, Any]:
    """``local`` (a rank's local shards by name) plus, for each member name in ``wanted``
    held through a fused tensor's shard, a view of it: the shard holds experts
    ``[e0, e1)`` whole (:func:`split_expert_layout`), ``e0`` the lowest expert wanted of it."""
    out = {n: t for n, t in local.items() if not _FUSED.fullmatch(n)}
    member = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    first: dict[str, int] = {}
    want = []
    for n in wanted:
        m = member.fullmatch(n)
        if m and n not in out:
            fused = m.group(1) + ("down_proj" if m.group(3) == "down_proj" else "gate_up_proj")
            e = int(m.group(2))
            first[fused] = min(first.get(fused, e), e)
            want.append((n, fused, e, m.group(3)))
    for n, fused, e, kind in want:
        shard = local.get(fused)
        if shard is None:
            raise ConfigError(f"this rank has no local shard of {fused!r} for {n!r}", param=n)
        view = shard.detach()[e - first[fused]]
        if kind != "down_proj":
            half = view.shape[0] // 2
            view = view.narrow(0, 0 if kind == "gate_proj" else half, half)
        out[n] = view
    return out
