"""FP8 targets in the plan: which generation tensors land as block-quantized float8.

Format (that of published block-FP8 checkpoints, Qwen3-*-FP8 and DeepSeek-V3): a
2-D weight ``W`` of shape ``[N, K]`` lands as ``float8_e4m3fn`` of the same shape
plus ``<name>_scale_inv``, float32 of shape ``[ceil(N/B), ceil(K/B)]`` (``B = 128``).
Block ``(i, j)`` covers rows ``[iB, (i+1)B)`` and columns ``[jB, (j+1)B)`` (clipped at
the edges); with ``s = amax(|block|) / 448`` its elements are stored as
``fp8(x / s)`` and ``weight_scale_inv[i, j] = s``, so that ``dequant = fp8 * s``. A
block of zeros stores ``s = 1`` (any ``s`` dequantizes it to 0; 1 avoids 0/0).

Which parameters: ``Fp8Target.match`` (a regex, full match on the Hugging Face
name); the default takes the linear projections (q/k/v/o, gate/up/down, experts'
gate/up/down) and leaves embeddings, norms, the router and ``lm_head`` as they are.
A generation layout says ``fp8=block128`` (``"tp=2,fp8=block128"``), or
``build_plan(..., fp8=Fp8Target(match=...))`` gives a per-parameter rule.

Fused targets (``qkv_proj``, ``gate_up_proj``) quantize per *source* block: each
member keeps its own block grid, and the fused scale tensor stacks the members'
scale rows in member order (``ceil(rows_q/B) + ceil(rows_k/B) + ...``).

Boxes: every shard on both sides must cut a quantized parameter on block
boundaries (a cut at a multiple of ``B``, or at the parameter's end), so a copy
is a whole number of blocks and the sender holds every block it quantizes; a
layout that would split a block is a PlanError naming the parameter and the tp
size. A copy into an fp8 tensor carries, back to back, its box's fp8 bytes
(row-major) and then its blocks' float32 scales (row-major): ``vol + 4 * blocks``
bytes (:func:`copy_nbytes`).

This module is pure bookkeeping (no torch); :mod:`.fp8_pack` moves the bytes.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

from policyworker.errors import ConfigError, PlanError
from policyworker.layout.boxes import Layout, LocalSpec

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Target", "SCALE_SUFFIX", "block_of", "blocks", "copy_nbytes", "fp8_layout",
           "fp8_tensor_keys", "is_fp8_copy", "scale_at", "scale_bytes", "scale_name", "scale_shapes", "split_copy",
           "split_gen_layout"]

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"

DEFAULT_MATCH = (r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                 r"|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight")


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8Target:
    """Quantize the generation-side tensors of parameters matching ``match`` to
    block-``block`` FP8 (see the module docstring)."""

    block: int = 128
    match: str = DEFAULT_MATCH

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ConfigError(f"fp8 block must be a positive int, got {self.block!r}")
        try:
            re.compile(self.match)
        except re.error as exc:
            raise ConfigError(f"fp8 match is not a regex: {exc}") from exc

    def targets(self, name: str) -> bool:
        return re.fullmatch(self.match, name) is not None


def split_gen_layout(value: Any) -> tuple[Any, Fp8Target | None]:
    """``"tp=2,fp8=block128"`` -> (``"tp=2"``, Fp8Target(block=128)); a mapping with an
    ``"fp8"`` key likewise; anything else passes through with ``None``."""
    if isinstance(value, str) and "fp8" in value:
        keep, spec = [], None
        for item in value.split(","):
            key, _, val = item.strip().partition("=")
            if key.strip() == "fp8":
                spec = _parse_mode(val.strip())
            elif item.strip():
                keep.append(item.strip())
        return ",".join(keep) or "tp=1", spec
    if isinstance(value, Mapping) and "fp8" in value:
        rest = {k: v for k, v in value.items() if k != "fp8"}
        return rest, _parse_mode(str(value["fp8"]))
    return value, None


def _parse_mode(mode: str) -> Fp8Target:
    m = re.fullmatch(r"block(\d+)", mode)
    if m is None:
        raise ConfigError(f"fp8 layout option must be 'block<N>' (e.g. fp8=block128), got {mode!r}")
    return Fp8Target(block=int(m.group(1)))


def fp8_layout(layout: Layout, specs: Mapping[str, tuple[tuple[int, ...], Any]], target: Fp8Target,
               *, tp: int, side: str, retype: bool) -> Layout:
    """Check that ``layout`` cuts every targeted parameter on block boundaries; with
    ``retype`` (the generation side) return it with those tensors typed float8.

    PlanError names the parameter, the cut and the side's tp size; a fused tensor
    mixing quantized and unquantized members, or a targeted parameter that is not
    2-D, is a PlanError too.
    """
    b = target.block
    quantized = {n for n in layout.pieces if target.targets(n)}
    for name in sorted(quantized):
        shape = tuple(specs[name][0])
        if len(shape) != 2:
            raise PlanError(f"fp8 target {name!r} has shape {shape}: only 2-D weights quantize", param=name)
        for p in layout.pieces[name]:
            for d in range(2):
                for cut in (p.start[d], p.stop[d]):
                    if cut % b and cut != shape[d]:
                        raise PlanError(
                            f"{side} tp={tp} cuts {name!r} {list(shape)} at {cut} on dim {d}, inside a "
                            f"{b}-block: fp8 block{b} needs shards on block boundaries", param=name)
            if p.at[1] != 0:
                raise PlanError(f"fp8 tensor {p.tensor!r} places {name!r} at column {p.at[1]}; "
                                "fused fp8 tensors stack along dim 0 only", param=name)
    if not retype:
        return layout
    kinds: dict[tuple[int, str], set[bool]] = {}
    for name, pieces in layout.pieces.items():
        q = name in quantized
        for p in pieces:
            kinds.setdefault((p.rank, p.tensor), set()).add(q)
    mixed = sorted(k for k, v in kinds.items() if len(v) > 1)
    if mixed:
        raise PlanError(f"fused tensor {mixed[0][1]!r} mixes fp8 and unquantized members", param=mixed[0][1])
    fp8_tensors = {k for k, v in kinds.items() if True in v}
    tensors = {rank: {n: (LocalSpec(s.shape, FP8_DTYPE) if (rank, n) in fp8_tensors else s)
                      for n, s in specs_.items()} for rank, specs_ in layout.tensors.items()}
    return Layout(world_size=layout.world_size, stage_of_rank=layout.stage_of_rank, pieces=layout.pieces,
                  tensors=tensors)


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
        self.block = body.gen_fp8_block
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


def is_fp8_copy(plan: Any, copy: Any) -> bool:
    """Does ``copy`` land in an fp8 tensor (so it is quantized while packed)?"""
    return plan.body.gen_fp8_block > 0 and copy.dst_tensor in _index(plan).tensors


def block_of(plan: Any) -> int:
    return plan.body.gen_fp8_block


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
    """``{scale tensor name: shape}`` of generation rank ``rank`` (empty without fp8)."""
    if not plan.body.gen_fp8_block:
        return {}
    return dict(_index(plan).shapes.get(rank, {}))


def scale_bytes(plan: Any) -> int:
    """Bytes of every generation rank's scale tensors (part of the plan's minimum)."""
    if not plan.body.gen_fp8_block:
        return 0
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
