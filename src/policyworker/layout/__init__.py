"""Layouts (who holds which box of each parameter) and the reshard plan between them.

* :mod:`.parallelism` — `Parallelism`, the one rank map (pp, then dp, then tp).
* :mod:`.rules` — placements per model family (column / row / vocab / replicated /
  experts, fused generation targets).
* :mod:`.dtensor` — source layouts read from DTensor state dicts (no rules).
* :mod:`.planner`, :mod:`.plan` — `build_plan` and the `ReshardPlan` it returns.
* :mod:`.runs` — families of alike parameters (a layer's experts) written once per pair.
* :mod:`.fabric` — a fabric model: bytes per link and lower-bound refit times.
* :mod:`.apply` — `pack` / `unpack` and expected shards for tests.
* :mod:`.formats` — destination formats, the one strategy a plan carries for how
  bytes land: plain, block-FP8 (``fp8=block128``: the reference quantizer,
  quantize-while-pack).
"""

from policyworker.layout.apply import (
    apply_plan,
    bucket_copies,
    copy_nbytes,
    dest_shards,
    empty_local_tensors,
    local_shape,
    pack,
    source_shards,
    unpack,
)
from policyworker.layout.boxes import Layout, LocalSpec, Piece, chunk_bounds, merge_layouts
from policyworker.layout.dtensor import (
    dtensor_layout,
    dtensor_specs,
    placement_layout,
    shard_pieces,
)
from policyworker.layout.fabric import Fabric, fabric_report, load_fabric
from policyworker.layout.formats import Fp8Target
from policyworker.layout.parallelism import Parallelism, RankCoords
from policyworker.layout.plan import (
    Copy,
    CopyRun,
    LocalTensor,
    ParamInfo,
    PlanBody,
    ReshardPlan,
    Transfer,
    WirePiece,
    dtype_size,
)
from policyworker.layout.planner import as_parallelism, build_plan, plan_from_layouts
from policyworker.layout.report import format_plan_report, plan_report
from policyworker.layout.rules import ParamRule, layer_stages, match_rule, rule_layout

__all__ = [
    "Copy",
    "CopyRun",
    "Fabric",
    "Fp8Target",
    "Layout",
    "LocalSpec",
    "LocalTensor",
    "ParamInfo",
    "ParamRule",
    "Parallelism",
    "Piece",
    "PlanBody",
    "RankCoords",
    "ReshardPlan",
    "Transfer",
    "WirePiece",
    "apply_plan",
    "as_parallelism",
    "bucket_copies",
    "build_plan",
    "chunk_bounds",
    "copy_nbytes",
    "dest_shards",
    "dtensor_layout",
    "dtensor_specs",
    "dtype_size",
    "empty_local_tensors",
    "fabric_report",
    "format_plan_report",
    "layer_stages",
    "load_fabric",
    "local_shape",
    "match_rule",
    "merge_layouts",
    "pack",
    "placement_layout",
    "plan_from_layouts",
    "plan_report",
    "rule_layout",
    "shard_pieces",
    "source_shards",
    "unpack",
]
