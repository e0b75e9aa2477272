"""Block-FP8 bookkeeping shared by the format and its packer: the block grid of a box,
the wire size of a quantized copy, and where each copy's blocks sit in its destination's
scale tensor (an index per plan, cached weakly). No torch.
"""

from __future__ import annotations

import weakref
from math import prod
from typing import Any

from policyworker.errors import PlanError
from policyworker.layout.boxes import Layout

__all__ = ["FP8_DTYPE", "FP8_MAX", "SCALE_SUFFIX", "blocks", "copy_nbytes", "fp8_tensor_keys", "is_quantized",
           "scale_at", "scale_bytes", "scale_name", "scale_shapes", "split_copy"]

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"


def fp8_tensor_keys(layout: Layout) -> frozenset[tuple[int, str]]:
    """``{(rank, tensor)}`` of ``layout``'s float8 local tensors."""
    return frozenset((r, n) for r, ts in layout.tensors.items() for n, s in ts.items() if s.dtype == FP8_DTYPE)


def scale_name(tensor: str) -> str:
    """``...qkv_proj.weight`` -> ``...qkv_proj.weight_scale_inv`` (the checkpoints' name)."""
    return tensor + SCALE_SUFFIX


# -- plan queries (cached per plan) -------------------------------------------------------
class _Index:
    """Per plan: fp8 destination tensor ids and each piece's place in its scale tensor."""

    def __init__(self, plan: Any) -> None:
        body = plan.body
        self.block = body.dest_format.block
        self.tensors = frozenset(t.name for t in body.dests if t.dtype == FP8_DTYPE)
        # (dst tensor id, param id) -> [(start0, stop0, at0, scale_row0)], one per piece.
        self.pieces: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
        self.shapes: dict[int, dict[str, tuple[int, int]]] = {}
        names = body.tensor_names
        b = self.block
        for t in body.dests:
            if t.name not in self.tensors:
                continue
            row = 0
            for p in sorted(t.pieces, key=lambda p: p.at[0]):
                key = (t.name, p.param)
                entry = (p.start[0], p.stop[0], p.at[0], row)
                known = self.pieces.setdefault(key, [])
                same = [e for e in known if e[:2] == entry[:2]]
                if same and same[0] != entry:
                    raise PlanError(f"replicas of {names[t.name]!r} place their fp8 blocks differently",
                                    param=names[t.name])
                if not same:
                    known.append(entry)
                row += -(-(p.stop[0] - p.start[0]) // b)
            self.shapes.setdefault(t.rank, {})[scale_name(names[t.name])] = (row, -(-t.shape[1] // b))


_INDEX: weakref.WeakKeyDictionary[Any, _Index] = weakref.WeakKeyDictionary()


def _index(plan: Any) -> _Index:
    idx = _INDEX.get(plan)
    if idx is None:
        idx = _INDEX[plan] = _Index(plan)
    return idx


def is_quantized(plan: Any, copy: Any) -> bool:
    """Does ``copy`` of an fp8 plan land in an fp8 tensor?"""
    return copy.dst_tensor in _index(plan).tensors


def blocks(start: tuple[int, ...], stop: tuple[int, ...], block: int) -> tuple[int, int]:
    return (-(-(stop[0] - start[0]) // block), -(-(stop[1] - start[1]) // block))


def copy_nbytes(start: tuple[int, ...], stop: tuple[int, ...], block: int) -> int:
    """Bytes of a quantized copy of box ``[start, stop)``: fp8 elements + float32 scales."""
    return prod(b - a for a, b in zip(start, stop)) + 4 * prod(blocks(start, stop, block))


def scale_at(plan: Any, copy: Any) -> tuple[int, int]:
    """Block coordinates of ``copy``'s first block inside its destination scale tensor."""
    idx = _index(plan)
    b = idx.block
    for start0, stop0, at0, row0 in idx.pieces[(copy.dst_tensor, copy.param)]:
        if start0 <= copy.start[0] < stop0:
            return row0 + (copy.dst_at[0] - at0) // b, copy.dst_at[1] // b
    raise PlanError(f"copy of param {copy.param} lies in no fp8 piece of its destination", param=str(copy.param))


def scale_shapes(plan: Any, rank: int) -> dict[str, tuple[int, int]]:
    """``{scale tensor name: shape}`` of generation rank ``rank`` of an fp8 plan."""
    return dict(_index(plan).shapes.get(rank, {}))


def scale_bytes(plan: Any) -> int:
    """Bytes of every generation rank's scale tensors (part of the plan's minimum)."""
    return sum(4 * r * c for shapes in _index(plan).shapes.values() for r, c in shapes.values())


def split_copy(copy: Any, max_bytes: int, block: int) -> list[Any]:
    """Cut a quantized copy into whole-block boxes of at most ``max_bytes`` each where
    possible: bands of rows (a multiple of ``block``), then, if one band of ``block``
    rows is too big, tiles of whole column blocks. A single block is the smallest part.
    The parts are of ``copy``'s own type (the plan's ``Copy``: no import of the plan here)."""
    Copy = type(copy)
    (r0, c0), (r1, c1) = copy.start, copy.stop
    if copy_nbytes(copy.start, copy.stop, block) <= max_bytes:
        return [copy]
    band_bytes = copy_nbytes((0, c0), (block, c1), block)
    if band_bytes <= max_bytes:
        step_r, step_c = block * max(1, max_bytes // band_bytes), c1 - c0
    else:
        tile = copy_nbytes((0, 0), (block, block), block)
        step_r, step_c = block, block * max(1, max_bytes // tile)
    out = []
    for r in range(r0, r1, step_r):
        for c in range(c0, c1, step_c):
            dr, dc = r - r0, c - c0
            out.append(Copy(copy.param, (r, c), (min(r1, r + step_r), min(c1, c + step_c)),
                            copy.src_tensor, (copy.src_at[0] + dr, copy.src_at[1] + dc),
                            copy.dst_tensor, (copy.dst_at[0] + dr, copy.dst_at[1] + dc)))
    return out
