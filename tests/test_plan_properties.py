"""Property tests: any valid layout pair, random small shapes -> an exact, minimal plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policyworker.errors import PlanError
from policyworker.layout import (
    Parallelism,
    ReshardPlan,
    apply_plan,
    build_plan,
    dest_shards,
    source_shards,
)
from policyworker.models import ModelConfig, seeded_state_dict

DTYPES = [torch.bfloat16, torch.float32, torch.float16]


@st.composite
def configs(draw: st.DrawFn) -> ModelConfig:
    kv = draw(st.sampled_from([1, 2, 3, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    moe = draw(st.booleans())
    family = "qwen3_moe" if moe else draw(st.sampled_from(["llama", "qwen2", "qwen3"]))
    experts = draw(st.sampled_from([2, 4, 6])) if moe else 0
    return ModelConfig(
        family=family,
        vocab_size=draw(st.integers(5, 40)),
        hidden_size=draw(st.integers(2, 9)),
        intermediate_size=draw(st.integers(3, 13)),
        num_layers=draw(st.integers(1, 4)),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=draw(st.sampled_from([2, 4])),
        qk_norm=family.startswith("qwen3"),
        qkv_bias=family == "qwen2",
        tie_word_embeddings=draw(st.booleans()),
        num_experts=experts,
        moe_intermediate_size=draw(st.integers(1, 7)) if moe else 0,
        num_experts_per_tok=1 if moe else 0,
    )


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


@st.composite
def layouts(draw: st.DrawFn, config: ModelConfig, max_world: int) -> Parallelism:
    kv = config.num_kv_heads
    tps = [t for t in _divisors(config.num_heads, 4) if kv % t == 0 or t % kv == 0]
    tp = draw(st.sampled_from(tps))
    pp = draw(st.integers(1, min(config.num_layers, max(1, max_world // tp), 3)))
    dp = draw(st.integers(1, max(1, min(3, max_world // (tp * pp)))))
    eps = [e for e in _divisors(dp * tp, 8)
           if not config.is_moe or config.num_experts % e == 0]
    ep = draw(st.sampled_from(eps))
    return Parallelism(tp=tp, pp=pp, dp=dp, ep=ep)


@st.composite
def cases(draw: st.DrawFn) -> tuple[ModelConfig, Parallelism, Parallelism, torch.dtype, bool]:
    config = draw(configs())
    return (config, draw(layouts(config, 8)), draw(layouts(config, 8)),
            draw(st.sampled_from(DTYPES)), draw(st.booleans()))


def _plan(case: tuple[ModelConfig, Parallelism, Parallelism, torch.dtype, bool]) -> ReshardPlan:
    config, train, gen, dtype, fused = case
    return build_plan(config, train, gen, train.world_size, gen.world_size,
                      gen_fused=fused, dtype=dtype)


@given(case=cases(), seed=st.integers(0, 2**31))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_apply_is_bit_exact(case: tuple, seed: int) -> None:
    config, train, gen, dtype, _ = case
    plan = _plan(case)
    full = seeded_state_dict(config, seed=seed, dtype=dtype)
    src = {r: source_shards(plan, r, full) for r in range(train.world_size)}
    want = {r: dest_shards(plan, r, full) for r in range(gen.world_size)}
    got = {r: {k: torch.full_like(v, float("nan")) for k, v in w.items()}
           for r, w in want.items()}
    apply_plan(plan, src, got)
    for r in want:
        assert got[r].keys() == want[r].keys()
        for k in want[r]:
            assert torch.equal(got[r][k], want[r][k]), (r, k)
    # Unfused generation tensors are exactly the rules' shards of the full tensors.
    assert plan.total_bytes == plan.min_bytes


@given(case=cases())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_destination_byte_written_exactly_once(case: tuple) -> None:
    plan = _plan(case)
    counts = {(t.rank, plan.tensor_name(t.name)): torch.zeros(t.shape, dtype=torch.int32)
              for t in plan.body.dests}
    sources = {(t.rank, plan.tensor_name(t.name)): t for t in plan.body.sources}
    for t, c in plan.iter_copies():
        view = counts[(t.dst, plan.tensor_name(c.dst_tensor))]
        for d, (a, s, e) in enumerate(zip(c.dst_at, c.start, c.stop)):
            view = view.narrow(d, a, e - s)
        view += 1
        # The source box lies inside the source tensor, and inside one of its pieces.
        src = sources[(t.src, plan.tensor_name(c.src_tensor))]
        assert any(p.param == c.param and all(a <= s and e <= b for a, b, s, e in
                                              zip(p.start, p.stop, c.start, c.stop))
                   for p in src.pieces)
        assert plan.body.train and t.stage == Parallelism(**plan.body.train).coords(t.src).pp_stage
    for key, count in counts.items():
        assert bool((count == 1).all()), key
    plan.validate()


@given(case=cases())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_wire_round_trip_and_hash_stable(case: tuple) -> None:
    plan = _plan(case)
    back = ReshardPlan.from_wire(plan.to_wire())
    assert back.body == plan.body and back.hash == plan.hash
    assert ReshardPlan.from_dict(plan.to_dict()).to_wire() == plan.to_wire()
    assert _plan(case).hash == plan.hash


@given(config=configs(), tp=st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_bad_tp_is_a_plan_error(config: ModelConfig, tp: int) -> None:
    kv = config.num_kv_heads
    good = config.num_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
    par = Parallelism(tp=tp)
    if good:
        build_plan(config, par, "tp=1", tp, 1)
    else:
        with pytest.raises(PlanError):
            build_plan(config, par, "tp=1", tp, 1)
