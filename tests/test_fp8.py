"""FP8 targets (issue 16): the reference quantizer as oracle, the fused CPU quantizer,
plans with fp8 destinations, and pack/unpack through buckets — bit for bit."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policyworker.errors import ConfigError, PlanError
from policyworker.layout import apply_plan, bucket_copies, build_plan, dest_shards, empty_local_tensors
from policyworker.layout import ReshardPlan, pack, plan_report, source_shards, unpack
from policyworker.layout.formats import BlockFp8Format, PlainFormat, split_gen_layout
from policyworker.layout.formats.block_fp8 import FP8_DTYPE, Fp8Target
from policyworker.layout.formats.block_fp8_pack import dequantize, quantize_into, quantize_reference
from policyworker.models import get_preset, seeded_state_dict

from .helpers import same_bits

B = 128


def _weights(n: int, k: int, seed: int, dtype: torch.dtype, zero_block: bool, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * spread)
    if zero_block:
        w[:B, :B] = 0
    return w.to(dtype)


shapes = st.tuples(st.integers(1, 400), st.integers(1, 400))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, seed=st.integers(0, 2**31), bf16=st.booleans(), zero=st.booleans(),
       spread=st.sampled_from([0.0, 3.0, 12.0]))
def test_fused_quantizer_equals_the_oracle_and_the_e4m3_bound_holds(shape, seed, bf16, zero, spread):
    n, k = shape
    w = _weights(n, k, seed, torch.bfloat16 if bf16 else torch.float32, zero, spread)
    q, s = quantize_reference(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (-(-n // B), -(-k // B))
    fq = torch.full((n, k), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # poisoned (NaN)
    fs = torch.full(s.shape, float("nan"))
    quantize_into(w, fq, fs)
    assert same_bits(fq, q) and same_bits(fs, s)
    # The bound, per element of each block with scale s (module docstring of block_fp8_pack):
    # |w - q*s| <= 2^-4 |w| + 2^-10 s, plus 2^-22 |w| of float32 rounding in x / s.
    x = w.to(torch.float64)
    sf = s.to(torch.float64).repeat_interleave(B, 0).repeat_interleave(B, 1)[:n, :k]
    err = (x - dequantize(q, s)).abs()
    assert bool((err <= (2**-4 + 2**-22) * x.abs() + 2**-10 * sf).all())
    assert bool(q.to(torch.float32).isfinite().all())
    # s = amax / 448 per block; an all-zero block stores s = 1 and zeros.
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = x[i * B:(i + 1) * B, j * B:(j + 1) * B].abs().max().to(torch.float32)
            assert s[i, j] == (amax / 448.0 if amax > 0 else 1.0)
    if zero:
        assert s[0, 0] == 1.0 and not q[:B, :B].to(torch.float32).any()


def test_fused_quantizer_writes_into_strided_views():
    w = _weights(300, 260, 1, torch.bfloat16, False, 1.0)
    big = torch.zeros(310, 300, dtype=torch.uint8).view(torch.float8_e4m3fn)
    q = big[5:305, 7:267]
    s_big = torch.zeros(5, 5)
    s = s_big[1:4, 2:5]
    quantize_into(w, q, s)
    rq, rs = quantize_reference(w)
    assert same_bits(q.contiguous(), rq) and same_bits(s.contiguous(), rs)
    assert not big[:5].view(torch.uint8).any() and not s_big[0].any()  # nothing outside the views


# -- plans ------------------------------------------------------------------------------
ALIGNED = dict(hidden_size=200, intermediate_size=256, num_heads=2, num_kv_heads=1, head_dim=128)


def _config(**kw):
    return dataclasses.replace(get_preset("tiny"), **{**ALIGNED, **kw})


def test_fp8_plan_sizes_and_which_tensors_quantize():
    config = get_preset("qwen3-8b")
    bf16 = build_plan(config, "tp=2", "tp=4", 2, 4)
    plan = build_plan(config, "tp=2", "tp=4,fp8=block128", 2, 4)
    plan.validate()
    assert plan.dest_format == BlockFp8Format(block=128) and bf16.dest_format == PlainFormat()
    kinds = {plan.tensor_name(t.name): t.dtype for t in plan.body.dests if t.rank == 0}
    assert kinds["model.embed_tokens.weight"] == "bfloat16" and kinds["lm_head.weight"] == "bfloat16"
    assert kinds["model.norm.weight"] == "bfloat16"
    assert kinds["model.layers.0.input_layernorm.weight"] == "bfloat16"
    assert kinds["model.layers.0.self_attn.q_norm.weight"] == "bfloat16"
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert kinds[f"model.layers.0.{name}.weight"] == FP8_DTYPE
    # Bytes: every quantized element costs 1 byte instead of 2, plus 4 per 128x128 block.
    linear = sum(t.shape[0] * t.shape[1] for t in plan.body.dests if t.dtype == FP8_DTYPE)
    blocks = sum(-(-t.shape[0] // 128) * -(-t.shape[1] // 128) for t in plan.body.dests if t.dtype == FP8_DTYPE)
    assert plan.total_bytes == plan.min_bytes == bf16.total_bytes - linear + 4 * blocks
    assert plan.total_bytes < 0.6 * bf16.total_bytes
    rep = plan_report("qwen3-8b", "tp=2", "tp=4,fp8=block128")
    assert rep["fp8"] == "block128" and rep["total_bytes"] == plan.total_bytes == rep["min_bytes"]
    assert sum(rep["recv_bytes_per_dst_rank"].values()) == plan.total_bytes


def test_the_plan_carries_its_format_on_the_wire():
    config = _config()
    plan = build_plan(config, "tp=1", "tp=2,fp8=block128", 1, 2)
    assert plan.to_dict()["dest_format"] == {"name": "block_fp8", "block": 128}
    assert build_plan(config, "tp=1", "tp=2", 1, 2).to_dict()["dest_format"] == {"name": "plain"}
    back = ReshardPlan.from_wire(plan.to_wire())
    assert back.dest_format == BlockFp8Format(block=128) and back.hash == plan.hash
    via_json = ReshardPlan.from_dict(msgspec.json.decode(msgspec.json.encode(plan.to_dict())))
    assert via_json.hash == plan.hash and via_json.min_bytes == plan.min_bytes
    # the same boxes with another block size are another plan
    block64 = build_plan(config, "tp=1", "tp=2,fp8=block64", 1, 2)
    assert block64.hash != plan.hash and block64.dest_format == BlockFp8Format(block=64)
    bad = plan.to_dict()
    bad["dest_format"] = {"name": "int4"}
    with pytest.raises(PlanError, match="not a reshard plan"):
        ReshardPlan.from_dict(bad)
    bad["dest_format"] = {"name": "block_fp8", "block": 0}
    with pytest.raises(PlanError, match="not a reshard plan"):
        ReshardPlan.from_dict(bad)


def test_a_split_block_is_a_plan_error_naming_param_and_tp():
    config = _config(intermediate_size=384)  # tp=2 cuts gate/up at row 192, down at column 192
    msg = r"gen tp=2 cuts 'model\.layers\.0\.mlp\.down_proj\.weight' \[200, 384\] at 192"
    with pytest.raises(PlanError, match=msg):
        build_plan(config, "tp=1", "tp=2,fp8=block128", 1, 2)
    with pytest.raises(PlanError, match=r"train tp=2 cuts 'model\.layers\.0\.mlp\.down_proj"):
        build_plan(config, "tp=2", "tp=1,fp8=block128", 2, 1)
    build_plan(config, "tp=1", "tp=2", 1, 2)  # unquantized, the same layout is fine
    build_plan(config, "tp=1", "tp=1,fp8=block128", 1, 1)


def test_layout_option_and_per_parameter_rule():
    assert split_gen_layout("tp=2,fp8=block128") == ("tp=2", Fp8Target(block=128))
    assert split_gen_layout({"tp": 2, "fp8": "block64"}) == ({"tp": 2}, Fp8Target(block=64))
    assert split_gen_layout("tp=2") == ("tp=2", None)
    with pytest.raises(ConfigError, match="block<N>"):
        split_gen_layout("tp=2,fp8=e4m3")
    with pytest.raises(ConfigError):
        Fp8Target(block=0)
    only_mlp = Fp8Target(match=r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight")
    plan = build_plan(_config(), "tp=1", "tp=1", 1, 1, gen_format=only_mlp)
    kinds = {plan.tensor_name(t.name): t.dtype for t in plan.body.dests}
    assert kinds["model.layers.0.mlp.gate_up_proj.weight"] == FP8_DTYPE
    assert kinds["model.layers.0.self_attn.qkv_proj.weight"] == "bfloat16"
    with pytest.raises(PlanError, match="mixes fp8"):
        build_plan(_config(), "tp=1", "tp=1", 1, 1, gen_format=Fp8Target(match=r".*\.q_proj\.weight"))


def _specs(n: int, k: int):
    """One MLP layer whose gate/up have ``n`` rows and ``k`` columns (any sizes)."""
    pre = "model.layers.0."
    return {f"{pre}mlp.gate_proj.weight": ((n, k), "bfloat16"), f"{pre}mlp.up_proj.weight": ((n, k), "bfloat16"),
            f"{pre}mlp.down_proj.weight": ((k, n), "bfloat16"), f"{pre}input_layernorm.weight": ((k,), "bfloat16")}


def _full(specs, seed):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, (shape, _) in specs.items()}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tps=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])), m=st.integers(1, 2),
       delta=st.integers(0, 1), k=st.integers(1, 300), seed=st.integers(0, 2**31),
       bucket=st.sampled_from([1024, 20_000, 1 << 20]))
def test_plans_move_oracle_bits_through_buckets(tps, m, delta, k, seed, bucket):
    # n = 512m - delta is cut on block boundaries by tp 1, 2 and 4 (511 over tp=4: 128,
    # 128, 128, 127) and is not a multiple of 128 when delta = 1, so the fused members
    # of a rank start mid-block; k is any width.
    t_tp, g_tp = tps
    n = 4 * B * m - delta
    specs = _specs(n, k)
    plan = build_plan(specs, f"tp={t_tp}", f"tp={g_tp},fp8=block128", t_tp, g_tp)
    plan.validate()
    full = _full(specs, seed)
    srcs = {r: source_shards(plan, r, full) for r in range(t_tp)}
    dsts = {r: empty_local_tensors(plan, "dst", r, flat=True) for r in range(g_tp)}
    for d in dsts.values():
        for t in d.values():
            t.view(torch.uint8).fill_(0x7F)  # poison: every byte must be written
    moved = 0
    for t in plan.transfers:
        for part in bucket_copies(plan, t.copies, bucket):
            buf = torch.empty(sum(_nbytes(plan, c) for c in part), dtype=torch.uint8)
            end = pack(plan, part, srcs[t.src], buf)
            assert end == buf.numel() and unpack(plan, part, buf, dsts[t.dst]) == end
            moved += end
    assert moved == plan.total_bytes == plan.min_bytes
    for r in range(g_tp):
        want = dest_shards(plan, r, full)
        assert set(want) == set(dsts[r])
        assert all(same_bits(dsts[r][name], want[name]) for name in want), r


def _nbytes(plan, c):
    from policyworker.layout import copy_nbytes

    return copy_nbytes(plan, c)


@pytest.mark.parametrize("train, gen", [("tp=2", "tp=2"), ("tp=2,pp=2", "tp=1"), ("tp=1", "tp=2")])
def test_apply_plan_on_a_model_equals_the_oracle(train, gen):
    config = _config()
    from policyworker.layout import Parallelism

    t, g = Parallelism.parse(train), Parallelism.parse(gen)
    plan = build_plan(config, train, gen + ",fp8=block128", t.world_size, g.world_size, dtype=torch.bfloat16)
    full = seeded_state_dict(config, seed=7, dtype=torch.bfloat16)
    srcs = {r: source_shards(plan, r, full) for r in range(t.world_size)}
    dsts = {r: empty_local_tensors(plan, "dst", r) for r in range(g.world_size)}
    assert apply_plan(plan, srcs, dsts) == plan.total_bytes
    for r in dsts:
        want = dest_shards(plan, r, full)
        assert all(same_bits(dsts[r][n], want[n]) for n in want)
        assert any(n.endswith("_scale_inv") for n in want)


def test_fused_launch_leaves_big_contiguous_copies_to_torch():
    # Copies of at least torch_min_bytes go back to the caller (torch copies them at
    # the memory's full rate); smaller ones become copy tiles of the launch.
    import torch

    from policyworker.ops.fp8_fused import build

    big = (torch.arange(4096, dtype=torch.int16).view(torch.bfloat16), torch.empty(4096, dtype=torch.bfloat16))
    small = (torch.arange(512, dtype=torch.int16).view(torch.bfloat16), torch.empty(512, dtype=torch.bfloat16))
    launch, _, left = build([], [big, small], 32, torch.device("cpu"), torch_min_bytes=8192)
    assert [a for a, _ in left] == [big[0]]
    assert launch is not None and launch.copy_bytes == small[0].numel() * 2 and launch.copy_tiles > 0
    launch0, _, left0 = build([], [big, small], 32, torch.device("cpu"))
    assert left0 == [] and launch0.copy_bytes == (4096 + 512) * 2
