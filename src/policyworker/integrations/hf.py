"""`ModelConfig` from a Hugging Face ``PretrainedConfig`` (Llama, Qwen2, Qwen3, Qwen3-MoE).

Reads only attributes (no transformers import), so any object with the same fields
works. What the placement rules cannot express is refused with a ``ConfigError``
naming the field: biases on ``o_proj`` or the MLP, MoE layers that are not all
sparse, an unknown ``model_type``. Planning needs the heads (how to split or
replicate k/v), which bare shapes do not carry: this is what to pass instead.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..models.config import ModelConfig

__all__ = ["is_hf_config", "model_config_from_hf"]

_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


def is_hf_config(config: Any) -> bool:
    """True for a transformers ``PretrainedConfig`` (duck-typed: ``model_type`` + ``to_dict``)."""
    return isinstance(getattr(config, "model_type", None), str) and callable(getattr(config, "to_dict", None))


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else getattr(params, "rope_theta", None)
    return float(theta) if theta is not None else 10_000.0


def model_config_from_hf(config: Any) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face config; ConfigError for what the rules cannot place."""
    model_type = getattr(config, "model_type", None)
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {sorted(_FAMILIES)} "
                          "(or pass refit_source=ModelConfig(...) / {name: (shape, dtype)})")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if getattr(config, "attention_bias", False) and family != "qwen2":
        raise ConfigError(f"{model_type} with attention_bias=True (a bias on o_proj) is not supported by the "
                          "placement rules")
    if getattr(config, "mlp_bias", False):
        raise ConfigError(f"{model_type} with mlp_bias=True is not supported by the placement rules")
    moe: dict[str, Any] = {}
    if family == "qwen3_moe":
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            raise ConfigError("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step != 1) is not "
                              "supported: every layer must be sparse")
        moe = dict(num_experts=config.num_experts, moe_intermediate_size=config.moe_intermediate_size,
                   num_experts_per_tok=config.num_experts_per_tok,
                   norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)))
    return ModelConfig(
        family=family, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", 0) or 0,
        num_layers=config.num_hidden_layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        qk_norm=family in ("qwen3", "qwen3_moe"), qkv_bias=family == "qwen2",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rope_theta=_rope_theta(config), rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        name=str(getattr(config, "name_or_path", "") or model_type), **moe,
    )
