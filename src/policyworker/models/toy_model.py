"""A small Llama/Qwen-architecture causal LM in plain torch, with Hugging Face names.

RMSNorm, rotary embeddings, grouped-query attention (optional q/k biases and per-head
q/k norms), SwiGLU MLP or a top-k mixture of SwiGLU experts (optionally with a shared expert and
leading dense layers). It exists to give the
refit paths real parameter names and shapes and a forward pass whose logits prove
that the weights arrived intact; it is not tuned for speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from policyworker.models.config import ModelConfig
from policyworker.models.params import param_specs, seeded_state_dict

__all__ = ["CausalLM", "build_model"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference implementations do: bf16 variance is coarse.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.q_size, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_size, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        groups = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, c.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Softmax router, top-k experts, renormalised weights (Qwen3-MoE's routing)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts)
        )
        if c.num_shared_experts:
            self.shared_experts = MLP(c.hidden_size, c.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(flat).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.c.num_experts_per_tok, dim=-1)
        if self.c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel():
                w = weights[rows, slot].unsqueeze(-1).to(flat.dtype)
                out.index_add_(0, rows, expert(flat[rows]) * w)
        if self.c.num_shared_experts:
            out = out + self.shared_experts(flat)
        return out.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MoE(c) if c.layer_is_moe(index) else MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward(input_ids [B, S]) -> logits [B, S, vocab]``.

    With ``tie_word_embeddings`` there is no ``lm_head.weight`` parameter: logits use
    ``model.embed_tokens.weight``, so ``state_dict()`` names match `param_specs`.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _rope_tables(self, seq: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32,
                                                   device=like.device) / c.head_dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=like.device), inv)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope_tables(input_ids.shape[1], x)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.config.tie_word_embeddings \
            else self.lm_head.weight
        return F.linear(x, head)


def build_model(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> CausalLM:
    """A `CausalLM` whose parameters equal ``seeded_state_dict(config, seed, dtype)``."""
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    state = seeded_state_dict(config, seed, dtype)
    # strict: names of the module and of param_specs must never drift apart.
    model.load_state_dict(state, strict=True)
    if list(model.state_dict()) != list(param_specs(config, dtype)):
        raise RuntimeError("CausalLM parameter order drifted from param_specs")
    return model
