"""ModelConfig.from_hf, bare-shape refusals, and the vLLM plan (no engine: see test_vllm*.py)."""

from __future__ import annotations

import pytest
import torch

from policyworker import ConfigError, PlanError, TorchPolicyWorker
from policyworker.integrations.vllm.plan import Need, Needs, needs_layout, plan_for_vllm
from policyworker.layout import apply_plan, build_plan, source_shards
from policyworker.models import ModelConfig, param_specs

transformers = pytest.importorskip("transformers")

QWEN3 = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=64)


@pytest.mark.parametrize("model_type, extra, family", [
    ("llama", {}, "llama"),
    ("qwen2", {}, "qwen2"),
    ("qwen3", {"tie_word_embeddings": True}, "qwen3"),
    ("qwen3_moe", {"num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2}, "qwen3_moe"),
])
def test_from_hf_reads_every_family(model_type, extra, family) -> None:
    cfg = transformers.AutoConfig.for_model(model_type, **{**QWEN3, **extra})
    mc = ModelConfig.from_hf(cfg)
    assert mc.family == family and mc.num_kv_heads == 1 and mc.head_dim == 64 and mc.num_layers == 2
    assert mc.qk_norm == (family in ("qwen3", "qwen3_moe")) and mc.qkv_bias == (family == "qwen2")
    assert mc.tie_word_embeddings == cfg.tie_word_embeddings
    if family == "qwen3_moe":
        assert (mc.num_experts, mc.moe_intermediate_size, mc.num_experts_per_tok) == (4, 32, 2)
    # The shapes it implies are the Hugging Face model's own parameters (transformers 5
    # holds MoE experts as fused 3-D tensors; the per-expert checkpoint names are ours).
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    have = {n: tuple(p.shape) for n, p in model.named_parameters() if ".experts." not in n}
    assert have == {n: s for n, (s, _) in param_specs(mc).items() if ".experts." not in n}


def test_from_hf_refuses_what_the_rules_cannot_place() -> None:
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        ModelConfig.from_hf(transformers.AutoConfig.for_model("gpt2"))
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig.from_hf(transformers.AutoConfig.for_model("llama", attention_bias=True, **QWEN3))
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        ModelConfig.from_hf(transformers.AutoConfig.for_model(
            "qwen3_moe", num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2, mlp_only_layers=[0],
            **QWEN3))


def test_torch_worker_over_hf_model_plans_by_heads() -> None:
    cfg = transformers.AutoConfig.for_model("qwen3", **QWEN3)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    w = TorchPolicyWorker(model, device="cpu", world_size=2)
    try:
        assert w._refit_model_source() == ModelConfig.from_hf(cfg)
    finally:
        import asyncio

        asyncio.run(w.shutdown())
    # One kv head over tp=2: by heads it is replicated on both generation ranks...
    plan = build_plan(ModelConfig.from_hf(cfg), "tp=2", "tp=2", 2, 2, gen_fused=False, dtype="float32")
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [lt.shape for lt in (plan.local_tensors("dst", r)[k] for r in (0, 1))] == [(64, 128), (64, 128)]
    # ...while bare shapes would have split the head in two rows blocks: refused, saying what to pass.
    specs = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match=r"ModelConfig.from_hf"):
        build_plan(specs, "tp=1", "tp=2", 1, 2)
    no_norms = {n: s for n, s in specs.items() if "norm" not in n or "layernorm" in n or n == "model.norm.weight"}
    with pytest.raises(PlanError, match="kv head size is unknown"):
        build_plan(no_norms, "tp=2", "tp=1", 2, 1)


def _vllm_like_needs(config: ModelConfig, tp: int) -> list[Needs]:
    """What vLLM's layers load at ``tp`` (padded vocab split, replicated kv heads) — by hand."""
    specs = param_specs(config, torch.float32)
    padded = -(-config.vocab_size // 64) * 64
    per_vocab = padded // tp
    out = []
    for r in range(tp):
        needs = []
        for name, (shape, _) in specs.items():
            lo, hi = [0] * len(shape), list(shape)
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                lo[0], hi[0] = min(r * per_vocab, shape[0]), min((r + 1) * per_vocab, shape[0])
            elif name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
                lo[0], hi[0] = r * shape[0] // tp, (r + 1) * shape[0] // tp
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                heads = config.num_kv_heads
                h = r * heads // tp if heads >= tp else r // (tp // heads)
                per = max(1, heads // tp)
                lo[0], hi[0] = h * config.head_dim, (h + per) * config.head_dim
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                lo[1], hi[1] = r * shape[1] // tp, (r + 1) * shape[1] // tp
            needs.append(Need(name, tuple(shape), tuple(lo), tuple(hi)))
        out.append(Needs(rank=r, tp_rank=r, tp_size=tp, dtype="float32", needs=needs))
    return out


def test_vllm_plan_delivers_exactly_the_needed_boxes() -> None:
    config = ModelConfig.from_hf(transformers.AutoConfig.for_model("qwen3", **QWEN3))
    needs = _vllm_like_needs(config, 2)
    plan = plan_for_vllm(config, "tp=2", 2, needs, dtype="float32")
    plan.validate()
    assert plan.total_bytes == plan.min_bytes  # each byte once, only the needed ones
    full = {n: torch.randn(s) for n, (s, _) in param_specs(config, torch.float32).items()}
    src = {r: source_shards(plan, r, full) for r in range(2)}
    got = {g: {n.name: torch.full(tuple(b - a for a, b in zip(n.start, n.stop)), float("nan"))
               for n in needs[g].needs} for g in range(2)}
    apply_plan(plan, src, got)
    for g in range(2):
        for n in needs[g].needs:
            box = full[n.name][tuple(slice(a, b) for a, b in zip(n.start, n.stop))]
            assert torch.equal(got[g][n.name], box), (g, n.name)


def test_vllm_needs_that_differ_from_the_trainer_model_are_plan_errors() -> None:
    config = ModelConfig.from_hf(transformers.AutoConfig.for_model("qwen3", **QWEN3))
    specs = {n: (s, "float32") for n, (s, _) in param_specs(config, torch.float32).items()}
    needs = _vllm_like_needs(config, 1)
    wrong = [Needs(rank=0, tp_rank=0, tp_size=1, dtype="float32",
                   needs=[Need(n.name, (n.shape[0] + 1,) + n.shape[1:], n.start, n.stop)
                          if n.name == "model.norm.weight" else n for n in needs[0].needs])]
    with pytest.raises(PlanError, match="model.norm.weight"):
        needs_layout(specs, wrong)
    missing = [Needs(rank=0, tp_rank=0, tp_size=1, dtype="float32", needs=needs[0].needs[1:])]
    with pytest.raises(PlanError, match="loaded by no vLLM rank"):
        needs_layout(specs, missing)
