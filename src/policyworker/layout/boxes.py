"""Boxes, pieces and layouts: the vocabulary shared by rules, DTensor import and plans.

A *box* is, per tensor dim, a half-open ``[start, stop)`` in a parameter's global
coordinates. A *piece* says that one rank holds one box of one parameter inside one
of its local tensors, starting at local coordinates ``at``. A local tensor is the
disjoint union of its pieces: an ordinary shard has one piece; a fused generation
tensor (``qkv_proj``) has one per member, stacked along dim 0; a strided DTensor
shard has one per contiguous run.

A `Layout` is every piece of every parameter on every rank of one side (training or
generation), plus each rank's local tensors' shapes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from math import prod
from typing import NamedTuple

from policyworker.errors import PlanError

__all__ = ["Layout", "LocalSpec", "Piece", "box_volume", "chunk_bounds", "merge_layouts"]

Index = tuple[int, ...]


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``torch.chunk`` splits ``size`` in ``parts``.

    Chunks are ``ceil(size / parts)`` long and the last ones may be shorter or empty
    (10 over 4 -> 3, 3, 3, 1; 5 over 4 -> 2, 2, 1, 0): the rule DTensor's ``Shard``
    uses, so uneven training shards line up with FSDP2's.
    """
    step = -(-size // parts)
    start = min(size, step * index)
    return start, min(size, start + step)


def box_volume(start: Index, stop: Index) -> int:
    return prod(b - a for a, b in zip(start, stop))


class Piece(NamedTuple):
    """Rank ``rank`` holds ``param[start:stop]`` at ``tensor[at:at + (stop - start)]``."""

    rank: int
    tensor: str
    start: Index
    stop: Index
    at: Index


class LocalSpec(NamedTuple):
    """Shape and dtype (torch name, e.g. ``"bfloat16"``) of one rank's local tensor."""

    shape: Index
    dtype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Where every byte of every parameter lives on one side.

    ``pieces[param]`` lists the param's pieces on all ranks (replicas included);
    ``tensors[rank][local_name]`` gives each local tensor's shape and dtype;
    ``stage_of_rank[rank]`` is the rank's pipeline stage. ``exact``: every local
    tensor is the disjoint union of its pieces by construction (the rules' layouts), so
    the planner need not sum the pieces to check it.
    """

    world_size: int
    stage_of_rank: tuple[int, ...]
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    tensors: dict[int, dict[str, LocalSpec]] = field(default_factory=dict)
    exact: bool = False


def merge_layouts(layouts: Iterable[Layout]) -> Layout:
    """One layout from per-stage layouts of the same world (e.g. one per pp stage's mesh).

    A parameter may appear in several; its pieces are concatenated. A local tensor
    defined twice on a rank is a PlanError.
    """
    layouts = list(layouts)
    if not layouts:
        raise PlanError("merge_layouts needs at least one layout")
    world = layouts[0].world_size
    stages = [-1] * world
    pieces: dict[str, list[Piece]] = {}
    tensors: dict[int, dict[str, LocalSpec]] = {}
    for lay in layouts:
        if lay.world_size != world:
            raise PlanError(f"cannot merge layouts of world sizes {world} and {lay.world_size}")
        for rank, specs in lay.tensors.items():
            mine = tensors.setdefault(rank, {})
            for name, spec in specs.items():
                if name in mine:
                    raise PlanError(f"rank {rank} defines local tensor {name!r} twice",
                                    rank=rank, param=name)
                mine[name] = spec
            stages[rank] = lay.stage_of_rank[rank]
        for param, ps in lay.pieces.items():
            pieces.setdefault(param, []).extend(ps)
    for rank, stage in enumerate(stages):
        if stage < 0:
            stages[rank] = max(0, max(lay.stage_of_rank[rank] for lay in layouts))
    return Layout(world_size=world, stage_of_rank=tuple(stages), pieces=pieces, tensors=tensors)
