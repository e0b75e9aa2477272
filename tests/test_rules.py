"""Placement rules: kinds, division checks, pipeline split, experts, fused targets."""

from __future__ import annotations

import pytest
import torch

from policyworker.errors import PlanError
from policyworker.layout import (
    Parallelism,
    build_plan,
    chunk_bounds,
    dest_shards,
    layer_stages,
    match_rule,
    rule_layout,
    source_shards,
)
from policyworker.models import PRESETS, param_specs, seeded_state_dict

TINY = PRESETS["tiny"]
MOE = PRESETS["tiny-moe"]


@pytest.mark.parametrize(("name", "kind", "dim"), [
    ("model.embed_tokens.weight", "vocab", 0),
    ("lm_head.weight", "vocab", 0),
    ("model.norm.weight", "replicated", None),
    ("model.layers.1.self_attn.q_proj.weight", "column", 0),
    ("model.layers.1.self_attn.k_proj.weight", "column", 0),
    ("model.layers.1.self_attn.o_proj.weight", "row", 1),
    ("model.layers.1.self_attn.q_norm.weight", "replicated", None),
    ("model.layers.1.mlp.gate_proj.weight", "column", 0),
    ("model.layers.1.mlp.down_proj.weight", "row", 1),
    ("model.layers.0.input_layernorm.weight", "replicated", None),
])
def test_dense_kinds(name: str, kind: str, dim: int | None) -> None:
    rule = match_rule(name, TINY)
    assert (rule.kind, rule.dim) == (kind, dim)


def test_moe_kinds() -> None:
    assert match_rule("model.layers.0.mlp.gate.weight", MOE).kind == "replicated"
    r = match_rule("model.layers.1.mlp.experts.3.up_proj.weight", MOE)
    assert (r.kind, r.dim, r.expert, r.layer) == ("column", 0, 3, 1)
    assert r.fused == "model.layers.1.mlp.experts.3.gate_up_proj.weight"
    r = match_rule("model.layers.1.mlp.experts.3.down_proj.weight", MOE)
    assert (r.kind, r.dim, r.expert) == ("row", 1, 3)


@pytest.mark.parametrize(("name", "config"), [
    ("model.layers.0.self_attn.rotary_emb.inv_freq", TINY),
    ("model.layers.0.self_attn.q_proj.bias", TINY),          # qwen3 has no qkv bias
    ("model.layers.0.mlp.experts.0.up_proj.weight", TINY),    # dense model
    ("model.layers.0.mlp.gate_proj.weight", MOE),             # MoE model
    ("model.layers.0.self_attn.q_norm.weight", PRESETS["tiny-llama"]),
    ("model.layers.7.mlp.down_proj.weight", TINY),            # no layer 7
    ("model.layers.0.mlp.experts.4.up_proj.weight", MOE),     # no expert 4
    ("lm_head.weight", PRESETS["tiny-qwen2"]),                # tied
])
def test_unknown_params_are_plan_errors(name: str, config: object) -> None:
    with pytest.raises(PlanError) as err:
        match_rule(name, config)  # type: ignore[arg-type]
    assert err.value.param == name
    assert name in str(err.value)


def test_unknown_param_fails_the_plan() -> None:
    specs = dict(param_specs(TINY))
    specs["model.layers.0.mlp.mystery.weight"] = ((3, 3), torch.bfloat16)
    with pytest.raises(PlanError, match="mystery"):
        build_plan(specs, "tp=1", "tp=1", 1, 1)


def test_qwen2_bias_is_column_and_fuses() -> None:
    config = PRESETS["tiny-qwen2"]
    rule = match_rule("model.layers.0.self_attn.v_proj.bias", config)
    assert (rule.kind, rule.dim, rule.fused) == ("column", 0, "model.layers.0.self_attn.qkv_proj.bias")


@pytest.mark.parametrize(("par", "message"), [
    (Parallelism(tp=3), "does not divide num_heads"),
    (Parallelism(pp=3), "exceeds num_layers"),
])
def test_bad_layouts_for_tiny(par: Parallelism, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        rule_layout(param_specs(TINY), par, config=TINY)


def test_ep_must_divide_experts() -> None:
    config = MOE.with_(num_experts=6, num_experts_per_tok=2)
    with pytest.raises(PlanError, match="ep=4 does not divide num_experts=6"):
        rule_layout(param_specs(config), Parallelism(tp=4, ep=4), config=config)


def test_kv_heads_must_split_or_replicate() -> None:
    config = TINY.with_(num_heads=6, num_kv_heads=3)   # tp=2 neither splits nor replicates kv
    with pytest.raises(PlanError, match="num_kv_heads"):
        rule_layout(param_specs(config), Parallelism(tp=2), config=config)


def test_kv_heads_replicate_when_tp_exceeds_them() -> None:
    # tiny: 2 kv heads of 16; tp=4 -> ranks 0,1 hold head 0 and ranks 2,3 hold head 1.
    lay = rule_layout(param_specs(TINY), Parallelism(tp=4), config=TINY)
    boxes = {p.rank: (p.start[0], p.stop[0])
             for p in lay.pieces["model.layers.0.self_attn.k_proj.weight"]}
    assert boxes == {0: (0, 16), 1: (0, 16), 2: (16, 32), 3: (16, 32)}
    q = {p.rank: (p.start[0], p.stop[0]) for p in lay.pieces["model.layers.0.self_attn.q_proj.weight"]}
    assert q == {0: (0, 16), 1: (16, 32), 2: (32, 48), 3: (48, 64)}


def test_layer_stages_and_pipeline_ends() -> None:
    assert layer_stages(5, 2) == [0, 0, 0, 1, 1]
    assert layer_stages(28, 3) == [0] * 10 + [1] * 9 + [2] * 9
    lay = rule_layout(param_specs(PRESETS["tiny-llama"]), Parallelism(pp=2),
                      config=PRESETS["tiny-llama"])
    assert {p.rank for p in lay.pieces["model.embed_tokens.weight"]} == {0}
    assert {p.rank for p in lay.pieces["lm_head.weight"]} == {1}
    assert {p.rank for p in lay.pieces["model.norm.weight"]} == {1}
    assert {p.rank for p in lay.pieces["model.layers.1.mlp.up_proj.weight"]} == {0}
    assert {p.rank for p in lay.pieces["model.layers.2.mlp.up_proj.weight"]} == {1}


def test_uneven_mlp_and_vocab_split_like_torch_chunk() -> None:
    config = TINY.with_(intermediate_size=100, vocab_size=250, num_heads=6, num_kv_heads=3)
    lay = rule_layout(param_specs(config), Parallelism(tp=3), config=config)
    up = sorted((p.start[0], p.stop[0]) for p in lay.pieces["model.layers.0.mlp.up_proj.weight"])
    assert up == [(0, 34), (34, 68), (68, 100)]
    down = sorted((p.start[1], p.stop[1]) for p in lay.pieces["model.layers.0.mlp.down_proj.weight"])
    assert down == up
    assert [chunk_bounds(250, 3, i) for i in range(3)] == [(0, 84), (84, 168), (168, 250)]


def test_expert_ownership() -> None:
    # train tp=2, dp=2, ep=2: ep carved from dp; expert e on ranks with dp_rank == e // 2.
    par = Parallelism(tp=2, dp=2, ep=2)
    lay = rule_layout(param_specs(MOE), par, config=MOE)
    for e in range(4):
        owners = {p.rank for p in lay.pieces[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]}
        assert owners == {r for r in range(4) if par.coords(r).dp_rank == e // 2}
    # Whole experts when ep == dp * tp.
    lay = rule_layout(param_specs(MOE), Parallelism(tp=4, ep=4), config=MOE)
    pieces = lay.pieces["model.layers.0.mlp.experts.2.down_proj.weight"]
    assert [(p.rank, p.start, p.stop) for p in pieces] == [(2, (0, 0), (64, 32))]


def test_fused_targets_are_stacked_shards() -> None:
    config = PRESETS["tiny-qwen2"]          # with qkv biases
    full = seeded_state_dict(config, seed=1, dtype=torch.bfloat16)
    plan = build_plan(config, "tp=1", "tp=2", 1, 2)
    for rank in range(2):
        got = dest_shards(plan, rank, full)
        for kind in ("weight", "bias"):
            p = "model.layers.1.self_attn."
            want = torch.cat([full[f"{p}{x}_proj.{kind}"].chunk(2, dim=0)[rank] for x in "qkv"])
            assert torch.equal(got[f"{p}qkv_proj.{kind}"], want)
        p = "model.layers.0.mlp."
        want = torch.cat([full[f"{p}{x}_proj.weight"].chunk(2, dim=0)[rank] for x in ("gate", "up")])
        assert torch.equal(got[f"{p}gate_up_proj.weight"], want)
        assert torch.equal(got[f"{p}down_proj.weight"], full[f"{p}down_proj.weight"].chunk(2, 1)[rank])
        assert "model.layers.0.mlp.gate_proj.weight" not in got
    # Experts fuse per expert.
    full = seeded_state_dict(MOE, seed=1, dtype=torch.bfloat16)
    plan = build_plan(MOE, "tp=2", "tp=2", 2, 2)
    got = dest_shards(plan, 1, full)
    e = "model.layers.1.mlp.experts.3."
    want = torch.cat([full[e + "gate_proj.weight"].chunk(2)[1], full[e + "up_proj.weight"].chunk(2)[1]])
    assert torch.equal(got[e + "gate_up_proj.weight"], want)


def test_source_shards_follow_training_rules() -> None:
    full = seeded_state_dict(TINY, seed=2, dtype=torch.bfloat16)
    plan = build_plan(TINY, "tp=2,pp=2", "tp=1", 4, 1)
    r3 = source_shards(plan, 3, full)   # stage 1, tp rank 1
    assert "model.embed_tokens.weight" not in r3
    assert torch.equal(r3["lm_head.weight"], full["lm_head.weight"].chunk(2)[1])
    assert torch.equal(r3["model.layers.1.self_attn.o_proj.weight"],
                       full["model.layers.1.self_attn.o_proj.weight"].chunk(2, 1)[1])
    assert torch.equal(r3["model.norm.weight"], full["model.norm.weight"])
