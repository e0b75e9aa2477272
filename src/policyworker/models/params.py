"""Parameter names, shapes and seeded contents — without building a model.

`param_specs` is pure arithmetic (planning a 30B model must not allocate 60 GB);
`seeded_state_dict` makes any subset of the full parameters with bytes that do not
depend on which subset was asked for, so a test can build "expected" shards on one
rank and the model on another and compare bit for bit.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

from policyworker.errors import ConfigError
from policyworker.models.config import ModelConfig

__all__ = ["ParamShape", "param_specs", "seeded_param", "seeded_state_dict"]

ParamShape = tuple[tuple[int, ...], torch.dtype]


def param_specs(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, ParamShape]:
    """``{hf_name: (shape, dtype)}`` in the model's registration order. Allocates nothing."""
    c = config
    h = c.hidden_size
    specs: dict[str, ParamShape] = {"model.embed_tokens.weight": ((c.vocab_size, h), dtype)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            specs[f"{p}self_attn.{proj}_proj.weight"] = ((rows, h), dtype)
            if c.qkv_bias:
                specs[f"{p}self_attn.{proj}_proj.bias"] = ((rows,), dtype)
        specs[p + "self_attn.o_proj.weight"] = ((h, c.q_size), dtype)
        if c.qk_norm:
            specs[p + "self_attn.q_norm.weight"] = ((c.head_dim,), dtype)
            specs[p + "self_attn.k_norm.weight"] = ((c.head_dim,), dtype)
        if c.layer_is_moe(i):
            m = c.moe_intermediate_size
            specs[p + "mlp.gate.weight"] = ((c.num_experts, h), dtype)
            for e in range(c.num_experts):
                q = f"{p}mlp.experts.{e}."
                specs[q + "gate_proj.weight"] = ((m, h), dtype)
                specs[q + "up_proj.weight"] = ((m, h), dtype)
                specs[q + "down_proj.weight"] = ((h, m), dtype)
            if c.num_shared_experts:
                sh, q = c.shared_intermediate_size, f"{p}mlp.shared_experts."
                specs[q + "gate_proj.weight"] = ((sh, h), dtype)
                specs[q + "up_proj.weight"] = ((sh, h), dtype)
                specs[q + "down_proj.weight"] = ((h, sh), dtype)
        else:
            f = c.intermediate_size
            specs[p + "mlp.gate_proj.weight"] = ((f, h), dtype)
            specs[p + "mlp.up_proj.weight"] = ((f, h), dtype)
            specs[p + "mlp.down_proj.weight"] = ((h, f), dtype)
        specs[p + "input_layernorm.weight"] = ((h,), dtype)
        specs[p + "post_attention_layernorm.weight"] = ((h,), dtype)
    specs["model.norm.weight"] = ((h,), dtype)
    if not c.tie_word_embeddings:
        specs["lm_head.weight"] = ((c.vocab_size, h), dtype)
    return specs


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def seeded_param(
    name: str, shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One parameter's deterministic contents, a function of (seed, name, shape, dtype).

    Each parameter draws from its own generator seeded from (seed, crc32(name)), so
    its bytes never depend on which other parameters were generated. Norm weights sit
    near 1 and biases near 0 so that the seeded model computes finite logits.
    """
    # torch's CPU generator keeps 32 bits of its seed, so seed and name are mixed
    # into 32 bits (golden-ratio multiply keeps nearby seeds far apart).
    mixed = (zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & 0xFFFFFFFF
    gen = torch.Generator().manual_seed(mixed)
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    if _is_norm(name):
        values = 1.0 + 0.05 * values
    else:
        values = 0.02 * values
    return values.to(dtype)


def seeded_state_dict(
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters for ``names`` (default: all), seeded per parameter."""
    specs = param_specs(config, dtype)
    wanted = list(specs) if names is None else list(names)
    unknown = [n for n in wanted if n not in specs]
    if unknown:
        raise ConfigError(
            f"{len(unknown)} names are not parameters of {config.name or config.family}: "
            f"{unknown[:5]}",
            param=unknown[0],
        )
    return {n: seeded_param(n, specs[n][0], seed, dtype) for n in wanted}
