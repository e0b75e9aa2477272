"""Source layouts from DTensors: the pure box function against torch, and real DTensors."""

from __future__ import annotations

import time
from datetime import timedelta
from math import prod

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from policyworker.runtime.procs import free_port
from policyworker.errors import PlanError
from policyworker.layout import (
    Parallelism,
    apply_plan,
    dest_shards,
    placement_layout,
    plan_from_layouts,
    rule_layout,
    shard_pieces,
    source_shards,
)


def _torch_local(full: torch.Tensor, mesh_shape: tuple[int, ...], placements: list,
                 coord: tuple[int, ...]) -> torch.Tensor:
    """What distribute_tensor puts at ``coord``: split left to right over mesh axes."""
    t = full
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, mesh_shape[axis], with_padding=False, contiguous=True)[0][
                coord[axis]]
    return t


def _from_pieces(full: torch.Tensor, local_shape: tuple[int, ...], pieces: list) -> torch.Tensor:
    local = torch.full(local_shape, -1, dtype=full.dtype)
    for start, stop, at in pieces:
        dst, src = local, full
        for d, (a, s, e) in enumerate(zip(at, start, stop)):
            dst, src = dst.narrow(d, a, e - s), src.narrow(d, s, e - s)
        dst.copy_(src)
    return local


@st.composite
def sharding(draw: st.DrawFn, strided: bool) -> tuple:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    options = [st.just(Replicate())] + [st.just(Shard(d)) for d in range(len(shape))]
    if strided:
        options += [st.builds(_StridedShard, st.just(d), split_factor=st.integers(2, 3))
                    for d in range(len(shape))]
    placements = [draw(st.one_of(options)) for _ in mesh]
    return shape, mesh, placements


def _coords(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    import itertools
    return list(itertools.product(*(range(n) for n in mesh)))


@given(case=sharding(strided=False))
@settings(max_examples=200, deadline=None)
def test_shape_and_offset_match_torch(case: tuple) -> None:
    shape, mesh, placements = case
    for coord in _coords(mesh):
        local_shape, pieces = shard_pieces(shape, mesh, placements, coord)
        want_shape, want_offset = _compute_local_shape_and_global_offset(
            shape, mesh, list(coord), placements)
        assert local_shape == tuple(want_shape)
        if prod(local_shape):
            assert len(pieces) == 1                # plain Shard keeps one box
            assert pieces[0][0] == tuple(want_offset)
        else:
            assert pieces == []


@given(case=sharding(strided=True))
@settings(max_examples=200, deadline=None)
def test_contents_match_torch_split_including_strided(case: tuple) -> None:
    shape, mesh, placements = case
    full = torch.arange(prod(shape)).reshape(shape)
    for coord in _coords(mesh):
        local_shape, pieces = shard_pieces(shape, mesh, placements, coord)
        want = _torch_local(full, mesh, placements, coord)
        assert local_shape == tuple(want.shape)
        assert torch.equal(_from_pieces(full, local_shape, pieces), want)


def test_partial_and_bad_arguments_are_plan_errors() -> None:
    with pytest.raises(PlanError, match="pending reduction"):
        shard_pieces((4,), (2,), [Partial()], (0,))
    with pytest.raises(PlanError):
        shard_pieces((4,), (2,), [Shard(1)], (0,))
    with pytest.raises(PlanError):
        shard_pieces((4,), (2, 2), [Shard(0)], (0,))


@given(case=sharding(strided=True), tp=st.sampled_from([1, 2, 3]))
@settings(max_examples=60, deadline=None)
def test_plan_from_placements_is_exact(case: tuple, tp: int) -> None:
    shape, mesh, placements = case
    if len(shape) != 2:
        shape = (shape[0], 3)
        placements = [p if isinstance(p, Replicate) or p.dim < 2 else Replicate()
                      for p in placements]
    name = "model.layers.0.mlp.up_proj.weight"
    world = prod(mesh)
    ranks = torch.arange(world).reshape(mesh)
    src = placement_layout({name: (shape, torch.float32, ranks, placements)})
    specs = {name: (shape, "float32")}
    dst = rule_layout(specs, Parallelism(tp=tp))
    plan = plan_from_layouts(specs, src, dst)
    full = {name: torch.randn(shape)}
    srcs = {r: source_shards(plan, r, full) for r in range(world)}
    for coord in _coords(mesh):   # the plan's source shards are torch's local tensors
        r = int(ranks[coord])
        assert torch.equal(srcs[r][name], _torch_local(full[name], mesh, placements, coord))
    want = {r: dest_shards(plan, r, full) for r in range(tp)}
    got = {r: {k: torch.full_like(v, float("nan")) for k, v in w.items()} for r, w in want.items()}
    apply_plan(plan, srcs, got)
    assert all(torch.equal(got[r][k], want[r][k]) for r in want for k in want[r])
    assert plan.total_bytes == plan.min_bytes


# -- real DTensors, two processes over gloo ----------------------------------------------------

def _dtensor_worker(rank: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from policyworker.layout import dtensor_layout, dtensor_specs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    try:
        flat = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        grid = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        row = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        gen = torch.Generator().manual_seed(0)
        cases = {
            "model.embed_tokens.weight": ((5, 4), flat, [Shard(0)]),            # uneven FSDP
            "model.layers.0.self_attn.o_proj.weight": ((4, 6), row, [Replicate(), Shard(1)]),
            "model.layers.0.mlp.up_proj.weight": ((7, 3), grid, [Shard(0), Shard(0)]),
            "model.layers.0.input_layernorm.weight": ((4,), flat, [Replicate()]),
            "model.layers.0.mlp.down_proj.weight": ((1, 4), flat, [Shard(0)]),  # empty shard
        }
        full = {n: torch.randn(s, generator=gen) for n, (s, _, _) in cases.items()}
        sd = {n: distribute_tensor(full[n], mesh, pl) for n, (_, mesh, pl) in cases.items()}
        layout = dtensor_layout(sd)
        specs = dtensor_specs(sd)
        plan = plan_from_layouts(specs, layout, rule_layout(specs, Parallelism(tp=1)))
        mine = source_shards(plan, rank, full)
        for n, dt in sd.items():
            assert torch.equal(mine[n], dt.to_local()), n
        # Every rank derived every rank's boxes: the plans agree.
        hashes: list[str | None] = [None, None]
        dist.all_gather_object(hashes, plan.hash)
        assert hashes[0] == hashes[1]
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_real_dtensors_two_processes() -> None:
    ctx = mp.start_processes(_dtensor_worker, args=(free_port(),), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 75
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail("DTensor workers did not finish in 75 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
