"""Model shapes: a frozen `ModelConfig` and named presets with real published shapes.

The presets are shapes only (no weights are downloaded anywhere in policyworker);
weights come from a seed, see :mod:`policyworker.models.params`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from policyworker.errors import ConfigError

__all__ = ["FAMILIES", "PRESETS", "ModelConfig", "get_preset", "model_config_from_hf"]

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Shape of a Llama/Qwen-architecture causal LM.

    ``num_experts > 0`` makes every layer's MLP a mixture of experts (as in
    Qwen3-MoE with ``decoder_sparse_step=1``); ``moe_intermediate_size`` is each
    expert's width. ``first_k_dense`` leading layers keep a dense MLP of
    ``intermediate_size`` (DeepSeek-V3 / Kimi-K2's ``first_k_dense_replace``);
    ``num_shared_experts`` adds to every MoE layer one always-on SwiGLU of width
    ``num_shared_experts * moe_intermediate_size`` (DeepSeek's ``shared_experts``).
    ``qkv_bias`` adds biases to q/k/v (Qwen2); ``qk_norm`` adds per-head RMSNorms
    on q and k (Qwen3).
    """

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool = False
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    num_shared_experts: int = 0
    first_k_dense: int = 0
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown model family {self.family!r}; known: {FAMILIES}")
        for attr in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{attr} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads} (grouped-query attention needs whole groups)"
            )
        if self.num_experts < 0:
            raise ConfigError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.is_moe:
            if self.moe_intermediate_size <= 0:
                raise ConfigError("an MoE config needs moe_intermediate_size > 0")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, num_experts={self.num_experts}]"
                )
        elif self.intermediate_size <= 0:
            raise ConfigError("a dense config needs intermediate_size > 0")
        if self.num_shared_experts < 0 or (self.num_shared_experts and not self.is_moe):
            raise ConfigError(f"num_shared_experts={self.num_shared_experts} needs an MoE "
                              "config and must be >= 0")
        if not 0 <= self.first_k_dense <= self.num_layers or (
                self.first_k_dense and (not self.is_moe or self.intermediate_size <= 0)):
            raise ConfigError(f"first_k_dense={self.first_k_dense} must be in [0, num_layers] "
                              "and needs an MoE config with intermediate_size > 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.is_moe and layer >= self.first_k_dense

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared expert (0 without one)."""
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def q_size(self) -> int:
        """Rows of q_proj: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of k_proj (and v_proj): num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: object) -> ModelConfig:
        """From a Hugging Face config (Llama, Qwen2, Qwen3, Qwen3-MoE); see :mod:`policyworker.models.hf`."""
        return model_config_from_hf(config)

    def with_(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]


def _qwen3(name: str, **kw: object) -> ModelConfig:
    base: dict[str, object] = dict(
        family="qwen3", vocab_size=151936, num_heads=16, num_kv_heads=8, head_dim=128,
        qk_norm=True, rope_theta=1_000_000.0, name=name,
    )
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


# Shapes from the published Hugging Face configs of each model.
PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": _qwen3("qwen3-0.6b", hidden_size=1024, intermediate_size=3072,
                         num_layers=28, tie_word_embeddings=True),
    "qwen3-1.7b": _qwen3("qwen3-1.7b", hidden_size=2048, intermediate_size=6144,
                         num_layers=28, tie_word_embeddings=True),
    "qwen3-8b": _qwen3("qwen3-8b", hidden_size=4096, intermediate_size=12288,
                       num_layers=36, num_heads=32, num_kv_heads=8),
    "qwen3-30b-a3b": _qwen3("qwen3-30b-a3b", family="qwen3_moe", hidden_size=2048,
                            intermediate_size=6144, num_layers=48, num_heads=32,
                            num_kv_heads=4, num_experts=128, moe_intermediate_size=768,
                            num_experts_per_tok=8),
    # Qwen3-235B-A22B (config.json of Qwen/Qwen3-235B-A22B): 94 layers, 64 q / 4 kv heads.
    "qwen3-235b-a22b": _qwen3("qwen3-235b-a22b", family="qwen3_moe", hidden_size=4096,
                              intermediate_size=12288, num_layers=94, num_heads=64,
                              num_kv_heads=4, num_experts=128, moe_intermediate_size=1536,
                              num_experts_per_tok=8),
    # A 1T MoE of Kimi-K2's size (config.json of moonshotai/Kimi-K2-Instruct): 61 layers,
    # the first dense (18432 wide), then 384 routed experts of 2048 plus 1 shared expert,
    # hidden 7168, vocabulary 163840, untied head. Kimi-K2's attention is DeepSeek's MLA,
    # which our rules do not place; it is modelled here by the qwen3_moe family's GQA
    # attention with Kimi's 64 query heads of 128 and 8 kv heads with q/k norms (8.0B
    # attention parameters where MLA has 6.2B; the total, 1.03T, is Kimi-K2's 1.04T within
    # 1.5%). The router's score-correction bias (384 values a layer) is left out.
    "kimi-k2-1t": _qwen3("kimi-k2-1t", family="qwen3_moe", vocab_size=163840,
                         hidden_size=7168, intermediate_size=18432, num_layers=61,
                         num_heads=64, num_kv_heads=8, num_experts=384,
                         moe_intermediate_size=2048, num_experts_per_tok=8,
                         num_shared_experts=1, first_k_dense=1, rope_theta=50_000.0),
    # DeepSeek-V3's size (config.json of deepseek-ai/DeepSeek-V3): 61 layers, the first 3
    # dense (18432 wide), then 256 routed experts of 2048 plus 1 shared, hidden 7168,
    # vocabulary 129280. Its MLA attention is modelled, as for kimi-k2-1t, by the
    # qwen3_moe family's GQA: 128 query heads of 128, 8 kv heads, q/k norms (675B in all
    # where DeepSeek-V3 has 671B).
    "deepseek-v3": _qwen3("deepseek-v3", family="qwen3_moe", vocab_size=129280,
                          hidden_size=7168, intermediate_size=18432, num_layers=61,
                          num_heads=128, num_kv_heads=8, num_experts=256,
                          moe_intermediate_size=2048, num_experts_per_tok=8,
                          num_shared_experts=1, first_k_dense=3, rope_theta=10_000.0),
    # Demo/benchmark-sized (58M parameters, 117 MB in bf16): big enough that a CPU
    # refit measures bandwidth, small enough for 8 processes on 2 cores.
    "small": _qwen3("small", vocab_size=32768, hidden_size=512, intermediate_size=1536,
                    num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64),
    # "small"'s MoE sibling for the vLLM bench (65M parameters, 262 MB in fp32): 8 experts
    # of 256, top 2, in every layer (widths the CPU MoE kernel takes without padding).
    "small-moe": _qwen3("small-moe", family="qwen3_moe", vocab_size=32768, hidden_size=512,
                        intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4,
                        head_dim=64, num_experts=8, moe_intermediate_size=256,
                        num_experts_per_tok=2),
    # Test-sized shapes: every rule (GQA, qk-norm, untied head, experts) in a few KB.
    "tiny": ModelConfig(family="qwen3", vocab_size=256, hidden_size=64,
                        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=16, qk_norm=True, rope_theta=10_000.0, name="tiny"),
    "tiny-moe": ModelConfig(family="qwen3_moe", vocab_size=256, hidden_size=64,
                            intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=4,
                            moe_intermediate_size=32, num_experts_per_tok=2,
                            rope_theta=10_000.0, name="tiny-moe"),
    # Shared expert and a leading dense layer (the kimi-k2-1t preset's extras) in a few KB.
    "tiny-moe-shared": ModelConfig(family="qwen3_moe", vocab_size=256, hidden_size=64,
                                   intermediate_size=128, num_layers=3, num_heads=4,
                                   num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=4,
                                   moe_intermediate_size=32, num_experts_per_tok=2,
                                   num_shared_experts=1, first_k_dense=1,
                                   rope_theta=10_000.0, name="tiny-moe-shared"),
    "tiny-qwen2": ModelConfig(family="qwen2", vocab_size=256, hidden_size=64,
                              intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, qkv_bias=True,
                              tie_word_embeddings=True, rope_theta=10_000.0,
                              name="tiny-qwen2"),
    "tiny-llama": ModelConfig(family="llama", vocab_size=256, hidden_size=64,
                              intermediate_size=128, num_layers=3, num_heads=4,
                              num_kv_heads=4, head_dim=16, rope_theta=10_000.0,
                              name="tiny-llama"),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; ConfigError listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None


# -- from a Hugging Face config (read as attributes: no transformers import) ------------
_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


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
