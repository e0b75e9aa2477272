"""CopyRuns: a layer's experts written once per pair, expanding to the per-copy plan."""

from __future__ import annotations

import pytest
import torch

from policyworker.layout import Parallelism, apply_plan, dest_shards, source_shards
from policyworker.layout.planner import plan_from_layouts
from policyworker.layout.rules import rule_layout
from policyworker.layout.runs import find_runs
from policyworker.models import PRESETS, param_specs, seeded_state_dict


def _plans(preset: str, train: str, gen: str):
    config = PRESETS[preset]
    specs = param_specs(config, torch.float32)
    t, g = Parallelism.parse(train), Parallelism.parse(gen)
    src = rule_layout(specs, t, config=config)
    dst = rule_layout(specs, g, config=config, fused=True)
    return [plan_from_layouts(specs, src, dst, train=t, gen=g, gen_fused=True, compress=c)
            for c in (True, False)]


def _dst_side(plan):
    return sorted((t.dst, c.param, c.start, c.stop, c.dst_tensor, c.dst_at)
                  for t, c in plan.iter_copies())


@pytest.mark.parametrize(("preset", "train", "gen"), [
    ("tiny-moe", "tp=2,pp=2,dp=2,ep=2", "tp=2,dp=2"),     # experts split on both sides
    ("tiny-moe", "tp=1,dp=2,ep=2", "tp=4"),               # whole experts -> tp=4 slices
    ("tiny-moe", "tp=1,dp=4,ep=2", "tp=2,ep=2"),          # replicated experts (edp=2)
    ("tiny-moe-shared", "tp=2,pp=3,dp=2,ep=2", "tp=1,dp=2,ep=2"),
])
def test_runs_expand_to_the_per_copy_plan(preset: str, train: str, gen: str) -> None:
    packed, flat = _plans(preset, train, gen)
    assert any(t.runs for t in packed.transfers)          # the experts did form runs
    assert not any(t.runs for t in flat.transfers)
    assert packed.num_copies == flat.num_copies
    assert packed.total_bytes == flat.total_bytes == packed.min_bytes
    assert _dst_side(packed) == _dst_side(flat)           # every destination byte, once
    assert len(packed.to_wire()) < len(flat.to_wire())
    packed.validate()
    # Bit-exact through the expanded copies.
    full = seeded_state_dict(PRESETS[preset], seed=3)
    got = {r: {n: torch.zeros_like(x) for n, x in dest_shards(packed, r, full).items()}
           for r in range(packed.body.gen_world_size)}
    apply_plan(packed, {r: source_shards(packed, r, full)
                        for r in range(packed.body.train_world_size)}, got)
    for r, tensors in got.items():
        want = dest_shards(packed, r, full)
        assert all(torch.equal(tensors[n], want[n]) for n in want)


def test_runs_stop_at_expert_parallel_boundaries_and_skip_dense_layers() -> None:
    config = PRESETS["tiny-moe"]          # 2 layers, 4 experts
    specs = param_specs(config)
    names, shapes = list(specs), [s for s, _ in specs.values()]
    par = Parallelism(tp=1, dp=2, ep=2)   # experts {0,1} on rank 0, {2,3} on rank 1
    lay = rule_layout(specs, par, config=config)
    tindex = {n: i for i, n in enumerate(names)}   # unfused: one tensor per param
    runs = find_runs(names, shapes, lay, lay, tindex)
    first = names.index("model.layers.0.mlp.experts.0.gate_proj.weight")
    # Per layer two runs of 2 experts (3 params each), steps of 3 tensors per expert.
    assert [(names[r.first], r.size, r.count) for r in runs][:2] == [
        (names[first], 3, 2), (names[first + 6], 3, 2)]
    assert len(runs) == 4 and all(r.src_steps == (3, 3, 3) for r in runs)
    dense = PRESETS["tiny"]
    dspecs = param_specs(dense)
    dlay = rule_layout(dspecs, Parallelism(tp=2), config=dense)
    assert find_runs(list(dspecs), [s for s, _ in dspecs.values()], dlay, dlay,
                     {n: i for i, n in enumerate(dspecs)}) == []
