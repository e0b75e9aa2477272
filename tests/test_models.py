"""Model presets (published shapes), seeded weights and the small causal LM."""

from __future__ import annotations

import time
from math import prod

import pytest
import torch

from policyworker.errors import ConfigError
from policyworker.models import PRESETS, ModelConfig, get_preset, param_specs, seeded_state_dict
from policyworker.models.toy_model import build_model


def _count(config: ModelConfig, skip_embed: bool = False) -> int:
    return sum(prod(shape) for name, (shape, _) in param_specs(config).items()
               if not (skip_embed and ("embed_tokens" in name or name == "lm_head.weight")))


# Published totals (model cards: "Number of Parameters" / "Non-Embedding"), in billions,
# with the precision the cards give them.
@pytest.mark.parametrize(("preset", "total", "non_embedding", "digits"), [
    ("qwen3-0.6b", 0.6, 0.44, (1, 2)),
    ("qwen3-1.7b", 1.7, 1.4, (1, 1)),
    ("qwen3-8b", 8.2, 6.95, (1, 2)),
    ("qwen3-30b-a3b", 30.5, 29.9, (1, 1)),
])
def test_published_parameter_counts(preset: str, total: float, non_embedding: float,
                                    digits: tuple[int, int]) -> None:
    config = PRESETS[preset]
    assert round(_count(config) / 1e9, digits[0]) == total
    assert round(_count(config, skip_embed=True) / 1e9, digits[1]) == non_embedding


def test_qwen3_8b_exact_shape_facts() -> None:
    specs = param_specs(PRESETS["qwen3-8b"])
    assert len(specs) == 399
    n = _count(PRESETS["qwen3-8b"])
    assert n == 8_190_735_360
    assert round(2 * n / 1e9, 1) == 16.4  # bf16 bytes
    assert specs["model.layers.0.self_attn.k_proj.weight"][0] == (1024, 4096)
    assert specs["lm_head.weight"][0] == (151936, 4096)


def test_qwen3_30b_active_parameters() -> None:
    c = PRESETS["qwen3-30b-a3b"]
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    active = _count(c) - c.num_layers * (c.num_experts - c.num_experts_per_tok) * expert
    assert abs(active / 1e9 - 3.3) < 0.06  # the card's "3.3B activated"
    assert "model.layers.47.mlp.experts.127.down_proj.weight" in param_specs(c)


def test_tied_presets_have_no_lm_head() -> None:
    assert "lm_head.weight" not in param_specs(PRESETS["qwen3-0.6b"])
    assert "lm_head.weight" in param_specs(PRESETS["qwen3-8b"])


def test_param_specs_allocates_nothing_and_is_fast() -> None:
    began = time.perf_counter()
    specs = param_specs(PRESETS["qwen3-30b-a3b"])
    assert time.perf_counter() - began < 1.0
    assert all(isinstance(s, tuple) and d is torch.bfloat16 for s, d in specs.values())


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-qwen2", "tiny-llama"])
def test_model_matches_specs_and_runs(preset: str) -> None:
    config = PRESETS[preset]
    model = build_model(config, seed=0)
    state = model.state_dict()
    specs = param_specs(config, torch.float32)
    assert list(state) == list(specs)
    for name, (shape, dtype) in specs.items():
        assert tuple(state[name].shape) == shape and state[name].dtype == dtype
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (2, 9, config.vocab_size)
    assert torch.isfinite(logits).all()
    # Causal: changing the last token leaves earlier logits untouched.
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % config.vocab_size
    # (MoE batches rows per expert differently, so equal up to float rounding.)
    torch.testing.assert_close(model(ids2)[:, :-1], logits[:, :-1], atol=1e-5, rtol=1e-5)


def test_seeded_weights_deterministic_and_subset_independent() -> None:
    config = PRESETS["tiny"]
    full = seeded_state_dict(config, seed=7, dtype=torch.bfloat16)
    names = ["model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"]
    part = seeded_state_dict(config, seed=7, dtype=torch.bfloat16, names=names)
    assert list(part) == names
    for n in names:
        assert torch.equal(part[n], full[n])
    other = seeded_state_dict(config, seed=8, dtype=torch.bfloat16, names=names)
    assert not torch.equal(other[names[0]], full[names[0]])
    model = build_model(config, seed=7, dtype=torch.bfloat16)
    for n, t in model.state_dict().items():
        assert torch.equal(t, full[n])
    with pytest.raises(ConfigError):
        seeded_state_dict(config, names=["model.layers.9.mlp.down_proj.weight"])


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        get_preset("qwen9-1t")
    with pytest.raises(ConfigError, match="num_kv_heads"):
        PRESETS["tiny"].with_(num_kv_heads=3)
    with pytest.raises(ConfigError):
        PRESETS["tiny"].with_(family="gpt2")
    with pytest.raises(ConfigError):
        PRESETS["tiny-moe"].with_(num_experts_per_tok=9)
    with pytest.raises(ConfigError):
        PRESETS["tiny"].with_(hidden_size=0)
