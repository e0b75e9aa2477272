"""`ModelConfig` from a Hugging Face ``PretrainedConfig`` (Llama, Qwen2, Qwen3, Qwen3-MoE).

Reads only attributes (no transformers import), so any object with the same fields
works. What the placement rules cannot express is refused with a ``ConfigError``
naming the field: biases on ``o_proj`` or the MLP, MoE layers that are not all
sparse, an unknown ``model_type``. Planning needs the heads (how to split or
replicate k/v), which bare shapes do not carry: this is what to pass instead.
"""

from __future__ import annotations

from typing import Any

from policyworker.models.config import model_config_from_hf

__all__ = ["is_hf_config", "model_config_from_hf"]


def is_hf_config(config: Any) -> bool:
    """True for a transformers ``PretrainedConfig`` (duck-typed: ``model_type`` + ``to_dict``)."""
    return isinstance(getattr(config, "model_type", None), str) and callable(getattr(config, "to_dict", None))
