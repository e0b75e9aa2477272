"""A small Llama/Qwen-architecture causal LM, its shapes, and seeded weights."""

from policyworker.models.config import FAMILIES, PRESETS, ModelConfig, get_preset
from policyworker.models.lm import CausalLM, build_model
from policyworker.models.params import ParamShape, param_specs, seeded_param, seeded_state_dict

__all__ = [
    "FAMILIES",
    "PRESETS",
    "CausalLM",
    "ModelConfig",
    "ParamShape",
    "build_model",
    "get_preset",
    "param_specs",
    "seeded_param",
    "seeded_state_dict",
]
