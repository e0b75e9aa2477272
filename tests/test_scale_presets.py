"""Large presets (qwen3-235b-a22b, kimi-k2-1t) and the shared-expert / leading-dense rules."""

from __future__ import annotations

from math import prod

import pytest
import torch

from policyworker.errors import ConfigError, PlanError
from policyworker.layout import apply_plan, build_plan, dest_shards, match_rule, source_shards
from policyworker.models import PRESETS, param_specs
from policyworker.models.toy_model import build_model


def _count(name: str, *, active: bool = False) -> int:
    c = PRESETS[name]
    n = sum(prod(s) for s, _ in param_specs(c).values())
    if active:  # only num_experts_per_tok routed experts of each MoE layer run per token
        moe_layers = sum(c.layer_is_moe(i) for i in range(c.num_layers))
        n -= moe_layers * (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size \
            * c.moe_intermediate_size
    return n


def test_qwen3_235b_matches_its_model_card() -> None:
    # Card: 235B parameters in total, 22B activated; 94 layers, 64 q / 4 kv heads, 128 experts.
    assert round(_count("qwen3-235b-a22b") / 1e9) == 235
    assert round(_count("qwen3-235b-a22b", active=True) / 1e9) == 22
    specs = param_specs(PRESETS["qwen3-235b-a22b"])
    assert specs["model.layers.93.mlp.experts.127.down_proj.weight"][0] == (4096, 1536)
    assert specs["model.layers.0.self_attn.k_proj.weight"][0] == (512, 4096)


def test_kimi_k2_sized_preset() -> None:
    c = PRESETS["kimi-k2-1t"]
    specs = param_specs(c)
    # Layer 0 is dense (18432 wide); layers 1..60 have 384 routed experts + 1 shared.
    assert specs["model.layers.0.mlp.gate_proj.weight"][0] == (18432, 7168)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in specs
    assert specs["model.layers.60.mlp.experts.383.up_proj.weight"][0] == (2048, 7168)
    assert specs["model.layers.1.mlp.shared_experts.down_proj.weight"][0] == (7168, 2048)
    assert specs["lm_head.weight"][0] == (163840, 7168)
    # Kimi-K2: 1.04T total, 32B activated; ours within a few percent (GQA for MLA).
    assert 1.00e12 < _count("kimi-k2-1t") < 1.06e12
    assert 30e9 < _count("kimi-k2-1t", active=True) < 36e9


def test_shared_expert_and_dense_layer_rules() -> None:
    c = PRESETS["tiny-moe-shared"]
    assert match_rule("model.layers.1.mlp.shared_experts.down_proj.weight", c).dim == 1
    assert match_rule("model.layers.1.mlp.shared_experts.up_proj.weight", c).fused == \
        "model.layers.1.mlp.shared_experts.gate_up_proj.weight"
    assert match_rule("model.layers.0.mlp.down_proj.weight", c).dim == 1
    for bad in ("model.layers.0.mlp.experts.0.down_proj.weight",
                "model.layers.0.mlp.shared_experts.down_proj.weight",
                "model.layers.1.mlp.down_proj.weight"):
        with pytest.raises(PlanError, match="no placement rule"):
            match_rule(bad, c)
    with pytest.raises(ConfigError, match="first_k_dense"):
        c.with_(first_k_dense=9)
    with pytest.raises(ConfigError, match="num_shared_experts"):
        PRESETS["tiny"].with_(num_shared_experts=1)


def test_shared_expert_model_survives_a_refit_bit_exact() -> None:
    c = PRESETS["tiny-moe-shared"]
    plan = build_plan(c, "tp=2,pp=3,dp=2,ep=2", "tp=1", 12, 1, gen_fused=False,
                      dtype=torch.float32)
    plan.validate()
    full = dict(build_model(c, seed=5).state_dict())
    target = build_model(c, seed=99)
    apply_plan(plan, {r: source_shards(plan, r, full) for r in range(12)},
               {0: dict(target.state_dict())})
    ids = torch.randint(0, c.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(target(ids), build_model(c, seed=5)(ids))
    # Fused generation side: the shared expert's gate_up_proj is [gate; up] per tp rank.
    plan = build_plan(c, "tp=2,pp=3,dp=2,ep=2", "tp=2,ep=2", 12, 2, dtype=torch.float32)
    got = {0: {}, 1: {}}
    for r in got:
        got[r] = {n: torch.zeros_like(t) for n, t in dest_shards(plan, r, full).items()}
    apply_plan(plan, {r: source_shards(plan, r, full) for r in range(12)}, got)
    name = "model.layers.2.mlp.shared_experts.gate_up_proj.weight"
    gate = full["model.layers.2.mlp.shared_experts.gate_proj.weight"]
    up = full["model.layers.2.mlp.shared_experts.up_proj.weight"]
    assert torch.equal(got[1][name], torch.cat([gate[16:], up[16:]]))


def test_deepseek_v3_sized_preset() -> None:
    c = PRESETS["deepseek-v3"]
    specs = param_specs(c)
    assert "model.layers.2.mlp.down_proj.weight" in specs                 # 3 dense layers
    assert "model.layers.3.mlp.experts.255.down_proj.weight" in specs
    assert 0.66e12 < _count("deepseek-v3") < 0.69e12                      # 671B published
