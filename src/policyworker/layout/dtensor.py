"""Source layouts read from DTensor state dicts — the trainer's own sharding, no rules.

`shard_pieces` is a pure function of (global shape, mesh shape, placements, mesh
coordinate): it replays DTensor's sharding left to right over the mesh axes, keeping
per tensor dim the list of global indices the coordinate holds, and cuts those into
contiguous runs. ``Shard(d)`` splits ``torch.chunk``-style (uneven chunks and empty
shards included) and keeps a dim one run; ``_StridedShard`` (FSDP2 over a
tensor-parallel dim) can leave several runs, hence several pieces; ``Replicate``
changes nothing; ``Partial`` is a PlanError (a pending reduction is not a layout).

`dtensor_layout` applies it to every coordinate of every parameter's device mesh —
each rank can compute every other rank's boxes from its own DTensors, because mesh
and placements are global facts.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

try:  # FSDP2's placement when it shards a dim that tensor parallelism already split
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = None  # type: ignore[assignment,misc]

from policyworker.errors import PlanError
from policyworker.layout.boxes import Layout, LocalSpec, Piece
from policyworker.layout.rules import dtype_name

__all__ = ["dtensor_layout", "dtensor_specs", "placement_layout", "shard_pieces"]

Run = tuple[int, int, int]  # global [lo, hi) at local position pos


def _strided_indices(placement: Any, indices: Sequence[int], parts: int,
                     index: int) -> list[int]:
    try:
        from torch.distributed.tensor._utils import _StridedShardOffsetMode
    except ImportError as exc:  # an older torch: strided shards not supported
        raise PlanError(f"cannot read placement {placement!r} with this torch") from exc
    _, offsets = placement.local_shard_size_and_offset(
        len(indices), parts, index, _StridedShardOffsetMode.ALL)
    return [indices[i] for i in offsets or ()]


def _runs(indices: Sequence[int]) -> list[Run]:
    if isinstance(indices, range):
        return [(indices.start, indices.stop, 0)] if len(indices) else []
    runs: list[Run] = []
    for pos, g in enumerate(indices):
        if runs and runs[-1][1] == g:
            lo, _, at = runs[-1]
            runs[-1] = (lo, g + 1, at)
        else:
            runs.append((g, g + 1, pos))
    return runs


def shard_pieces(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Any],
    coord: Sequence[int],
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]:
    """``(local_shape, [(start, stop, at), ...])`` held at mesh coordinate ``coord``.

    Pieces are disjoint boxes in global coordinates; ``at`` is where each starts in
    the local tensor. An empty shard has no pieces.
    """
    if not (len(mesh_shape) == len(placements) == len(coord)):
        raise PlanError(f"mesh shape {tuple(mesh_shape)}, placements {tuple(placements)} "
                        f"and coordinate {tuple(coord)} differ in length")
    held: list[Sequence[int]] = [range(n) for n in global_shape]
    for axis, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Partial):
            raise PlanError(f"placement {placement!r} on mesh axis {axis} is a pending "
                            "reduction, not a layout; redistribute first")
        strided = _StridedShard is not None and isinstance(placement, _StridedShard)
        if not (strided or isinstance(placement, Shard)):
            raise PlanError(f"unsupported placement {placement!r} on mesh axis {axis}")
        dim, parts, index = placement.dim, mesh_shape[axis], coord[axis]
        if not 0 <= dim < len(held):
            raise PlanError(f"placement {placement!r} shards dim {dim} of a "
                            f"{len(held)}-dim tensor")
        cur = held[dim]
        if not strided:
            step = -(-len(cur) // parts)
            lo = min(len(cur), step * index)
            held[dim] = cur[lo:lo + step]  # a range stays a range: one run
        else:
            held[dim] = _strided_indices(placement, cur, parts, index)
    local_shape = tuple(len(ix) for ix in held)
    if 0 in local_shape:
        return local_shape, []
    pieces = []
    for combo in itertools.product(*(_runs(ix) for ix in held)):
        pieces.append((tuple(r[0] for r in combo), tuple(r[1] for r in combo),
                       tuple(r[2] for r in combo)))
    return local_shape, pieces


def dtensor_specs(state_dict: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (global shape, dtype name)}`` of a DTensor state dict."""
    return {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in state_dict.items()}


def dtensor_layout(state_dict: Mapping[str, Any], *, world_size: int | None = None,
                   pp_stage: int = 0) -> Layout:
    """Every rank's pieces of every DTensor in ``state_dict`` (keyed by parameter name).

    ``world_size`` defaults to one more than the highest rank in any mesh; ranks
    outside the meshes hold nothing. ``pp_stage`` is recorded for all ranks here;
    combine the layouts of several stages with :func:`.boxes.merge_layouts`.
    Anything that is not a DTensor is a PlanError naming it.
    """
    entries = {}
    for name, t in state_dict.items():
        if not isinstance(t, DTensor):
            raise PlanError(f"{name!r} is a {type(t).__name__}, not a DTensor", param=name)
        entries[name] = (tuple(t.shape), t.dtype, t.device_mesh.mesh, tuple(t.placements))
    return placement_layout(entries, world_size=world_size, pp_stage=pp_stage)


def placement_layout(
    entries: Mapping[str, tuple[Sequence[int], Any, torch.Tensor, Sequence[Any]]],
    *,
    world_size: int | None = None,
    pp_stage: int = 0,
) -> Layout:
    """The layout of ``{name: (global shape, dtype, mesh ranks, placements)}``.

    ``mesh ranks`` is the tensor of global ranks a DeviceMesh holds (``mesh.mesh``);
    this is `dtensor_layout` without DTensors, so it runs without a process group.
    """
    pieces: dict[str, list[Piece]] = {}
    tensors: dict[int, dict[str, LocalSpec]] = {}
    top = -1
    for name, (shape, dtype, ranks, placements) in entries.items():
        shape = tuple(shape)
        dname = dtype_name(dtype)
        mesh_shape = tuple(ranks.shape)
        out = pieces[name] = []
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            rank = int(ranks[coord])
            top = max(top, rank)
            local_shape, ps = shard_pieces(shape, mesh_shape, placements, coord)
            for start, stop, at in ps:
                out.append(Piece(rank, name, start, stop, at))
            mine = tensors.setdefault(rank, {})
            if name in mine:
                raise PlanError(f"rank {rank} appears twice in the mesh of {name!r}",
                                rank=rank, param=name)
            mine[name] = LocalSpec(local_shape, dname)
    world = top + 1 if world_size is None else world_size
    if top >= world:
        raise PlanError(f"meshes name rank {top} but world_size is {world}")
    for r in range(world):
        tensors.setdefault(r, {})
    return Layout(world_size=world, stage_of_rank=(pp_stage,) * world, pieces=pieces,
                  tensors=tensors)
