"""Block-FP8, a destination format: generation tensors that land as block-quantized float8.

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
``build_plan(..., gen_format=Fp8Target(match=...))`` gives a per-parameter rule.
`Fp8Target` is that planning input; the plan carries a `BlockFp8Format` (its block
size), the strategy the generic code asks about each copy (:mod:`.base`).

Fused targets (``qkv_proj``, ``gate_up_proj``) quantize per *source* block: each
member keeps its own block grid, and the fused scale tensor stacks the members'
scale rows in member order (``ceil(rows_q/B) + ceil(rows_k/B) + ...``).

Boxes: every shard on both sides must cut a quantized parameter on block
boundaries (a cut at a multiple of ``B``, or at the parameter's end), so a copy
is a whole number of blocks and the sender holds every block it quantizes; a
layout that would split a block is a PlanError naming the parameter and the tp
size. A copy into an fp8 tensor carries, back to back, its box's fp8 bytes
(row-major) and then its blocks' float32 scales (row-major): ``vol + 4 * blocks``
bytes (:func:`.block_fp8_grid.copy_nbytes`).

This module is the planning side and the strategy (no torch): `Fp8Target`,
`fp8_layout`, `BlockFp8Format`; :mod:`.block_fp8_grid` holds the block bookkeeping and
:mod:`.block_fp8_pack` moves the bytes (the format imports it when it first moves any).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import msgspec

from policyworker.errors import ConfigError, PlanError
from policyworker.layout.boxes import Layout, LocalSpec
from policyworker.layout.formats.block_fp8_grid import (
    FP8_DTYPE,
    FP8_MAX,
    SCALE_SUFFIX,
    copy_nbytes,
    fp8_tensor_keys,
    is_quantized,
    scale_bytes,
    split_copy,
)

__all__ = ["DEFAULT_MATCH", "FP8_DTYPE", "FP8_MAX", "LAYOUT_KEY", "SCALE_SUFFIX", "BlockFp8Format", "Fp8Target",
           "fp8_layout", "is_fp8_copy", "parse_layout_option"]

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

    @property
    def dest_format(self) -> BlockFp8Format:
        return BlockFp8Format(block=self.block)

    def shape_layouts(self, specs: Mapping[str, tuple[tuple[int, ...], Any]], src: Layout, dst: Layout, *,
                      train_tp: int, gen_tp: int) -> tuple[Layout, Layout]:
        return (fp8_layout(src, specs, self, tp=train_tp, side="train", retype=False),
                fp8_layout(dst, specs, self, tp=gen_tp, side="gen", retype=True))

    def layout_option(self) -> tuple[str, str]:
        return LAYOUT_KEY, f"block{self.block}"


LAYOUT_KEY = "fp8"  # "tp=2,fp8=block128"


def parse_layout_option(mode: str) -> Fp8Target:
    """The value of ``fp8=`` in a generation layout: ``"block<N>"``."""
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


def is_fp8_copy(plan: Any, copy: Any) -> bool:
    """Does ``copy`` land in an fp8 tensor (so it is quantized while packed)?"""
    return isinstance(plan.body.dest_format, BlockFp8Format) and is_quantized(plan, copy)

# -- the strategy the plan carries ----------------------------------------------------
class BlockFp8Format(msgspec.Struct, frozen=True, tag="block_fp8", tag_field="name"):
    """Destination tensors typed float8_e4m3fn hold ``block``-FP8 with ``_scale_inv``
    scales (the module docstring); the plan's other tensors land plain. The torch side
    (quantizers, pack / unpack, the colocated pull's launch) is :mod:`.block_fp8_pack`."""

    block: Annotated[int, msgspec.Meta(ge=1)] = 128

    # Quantized bytes are not the source's bytes: nothing forwards or diffs them, and
    # every copy is listed flat (the quantizing pack walks copies one by one).
    passthrough: ClassVar[bool] = False
    compressible: ClassVar[bool] = False

    def converted_tensors(self, layout: Layout) -> frozenset[tuple[int, str]]:
        return fp8_tensor_keys(layout)

    def box_nbytes(self, start: tuple[int, ...], stop: tuple[int, ...], param_dtype: str) -> int:
        return copy_nbytes(start, stop, self.block)

    def dest_dtype(self, local_dtype: str, param_dtype: str) -> str:
        # an fp8 destination may hold a float parameter
        return local_dtype if local_dtype == FP8_DTYPE and param_dtype in _FLOATS else param_dtype

    def converts(self, plan: Any, copy: Any) -> bool:
        return is_quantized(plan, copy)

    def split_copy(self, plan: Any, copy: Any, max_bytes: int) -> list[Any]:
        return split_copy(copy, max_bytes, self.block)

    def pack_copy(self, plan: Any, copy: Any, local_tensors: Any, out: Any, offset: int) -> int:
        from policyworker.layout.formats import block_fp8_pack

        return block_fp8_pack.pack_copy(plan, copy, local_tensors, out, offset)

    def unpack_copy(self, plan: Any, copy: Any, buf: Any, local_tensors: Any, offset: int) -> int:
        from policyworker.layout.formats import block_fp8_pack

        return block_fp8_pack.unpack_copy(plan, copy, buf, local_tensors, offset)

    def extra_tensors(self, plan: Any, rank: int, device: Any) -> dict[str, Any]:
        from policyworker.layout.formats import block_fp8_pack

        return block_fp8_pack.scale_tensors(plan, rank, device)

    def extra_bytes(self, plan: Any) -> int:
        return scale_bytes(plan)

    def converts_tensor(self, plan: Any, local: Any) -> bool:
        return local.dtype == FP8_DTYPE

    def reference_local(self, plan: Any, rank: int, name: str, high: Any) -> dict[str, Any]:
        from policyworker.layout.formats import block_fp8_pack

        return block_fp8_pack.reference_local(plan, rank, name, high)

    def pull_job(self, plan: Any, copy: Any, src_local: Any, dst_tensors: Any) -> Any:
        from policyworker.layout.formats import block_fp8_pack

        return block_fp8_pack.quant_job(plan, copy, src_local, dst_tensors)

    def pull_launch(self, plan: Any, jobs: Any, copies: Any) -> Any:
        from policyworker.layout.formats import block_fp8_pack

        return block_fp8_pack.QuantJobs(jobs, self.block, copies=copies)


_FLOATS = ("bfloat16", "float16", "float32")
