"""Runs: families of parameters placed alike, so a plan can write them once per pair.

A layer's experts are the family that matters: ``model.layers.L.mlp.experts.E.*`` for
``E`` in one expert-parallel block sit on the same ranks, in boxes of the same shapes,
at the same local offsets; only their names (hence parameter and tensor indices)
differ, by a constant step from one expert to the next. The planner plans the first
expert and writes the rest as a `.plan.CopyRun`; its cost and the plan's size then
grow with (src, dst) pairs and layers, not with experts.

A *block* is the consecutive parameters sharing a name up to the number inside a
layer (``…experts.7.gate_proj.weight``, ``…experts.7.up_proj.weight``, ...). A run is
``count >= 2`` consecutive blocks numbered ``E, E+1, ...`` whose pieces agree in rank,
box and local offset, and whose tensor indices advance by the same step per block
member on each side. Only names with a layer number before the index form blocks:
whole layers (dense models) are left as single copies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policyworker.layout.boxes import Layout, Piece

__all__ = ["ParamRun", "find_runs"]

# Greedy head: the name's last number; the head must itself hold a number (the layer).
_INDEXED = re.compile(r"(.*\.\d+\..*\.)(\d+)(\..+)")


@dataclass(frozen=True, slots=True)
class ParamRun:
    """Parameters ``first + r * size + j`` (``r < count``, ``j < size``) placed alike;
    tensor indices of member ``j`` advance by ``src_steps[j]`` / ``dst_steps[j]``."""

    first: int
    size: int
    count: int
    src_steps: tuple[int, ...]
    dst_steps: tuple[int, ...]


@dataclass(slots=True)
class _Block:
    prefix: str
    number: int
    first: int
    suffixes: list[str]


def _blocks(names: Sequence[str]) -> list[_Block]:
    out: list[_Block] = []
    cur: _Block | None = None
    for i, name in enumerate(names):
        m = _INDEXED.fullmatch(name)
        if m is None:
            cur = None
            continue
        prefix, number, suffix = m.group(1), int(m.group(2)), m.group(3)
        if cur is not None and cur.prefix == prefix and cur.number == number \
                and cur.first + len(cur.suffixes) == i:
            cur.suffixes.append(suffix)
        else:
            cur = _Block(prefix, number, i, [suffix])
            out.append(cur)
    return out


def _delta(a: list[Piece] | None, b: list[Piece] | None, tindex: Mapping[str, int]) -> int | None:
    """The common tensor-index step from pieces ``a`` to ``b``, or None if they differ
    in anything else (rank, box, offset, count) or the step is not common."""
    if not a or not b or len(a) != len(b):
        return None
    step = None
    for (xr, xt, xs, xe, xa), (yr, yt, ys, ye, ya) in zip(a, b):
        if xr != yr or xs != ys or xe != ye or xa != ya:
            return None
        d = tindex[yt] - tindex[xt]
        if step is None:
            step = d
        elif d != step:
            return None
    return step


def _steps(a: _Block, b: _Block, names: Sequence[str], shapes: Sequence[tuple[int, ...]],
           src: Layout, dst: Layout, tindex: Mapping[str, int]
           ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    src_steps, dst_steps = [], []
    for j in range(len(a.suffixes)):
        na, nb = names[a.first + j], names[b.first + j]
        if shapes[a.first + j] != shapes[b.first + j]:
            return None
        ds = _delta(src.pieces.get(na), src.pieces.get(nb), tindex)
        dd = _delta(dst.pieces.get(na), dst.pieces.get(nb), tindex)
        if ds is None or dd is None:
            return None
        src_steps.append(ds)
        dst_steps.append(dd)
    return tuple(src_steps), tuple(dst_steps)


def find_runs(names: Sequence[str], shapes: Sequence[tuple[int, ...]], src: Layout,
              dst: Layout, tindex: Mapping[str, int]) -> list[ParamRun]:
    """Maximal runs (in parameter order, disjoint) of alike blocks; see the module doc.

    Linear in pieces: each block is compared with the next one only.
    """
    blocks = _blocks(names)
    runs: list[ParamRun] = []
    i = 0
    while i < len(blocks):
        head = blocks[i]
        size = len(head.suffixes)
        steps = None
        j = i + 1
        while j < len(blocks):
            prev, nxt = blocks[j - 1], blocks[j]
            if (nxt.prefix != head.prefix or nxt.number != prev.number + 1
                    or nxt.suffixes != head.suffixes or nxt.first != prev.first + size):
                break
            got = _steps(prev, nxt, names, shapes, src, dst, tindex)
            if got is None or (steps is not None and got != steps):
                break
            steps = got
            j += 1
        if steps is not None:
            runs.append(ParamRun(head.first, size, j - i, steps[0], steps[1]))
        i = j
    return runs
