"""Model configs (families, real shape presets), their parameter shapes, and seeded weights.

The toy causal LM built from a config lives in :mod:`policyworker.models.toy_model`.
"""

from policyworker.models.config import FAMILIES, PRESETS, ModelConfig, get_preset
from policyworker.models.params import ParamShape, param_specs, seeded_param, seeded_state_dict

__all__ = [
    "FAMILIES",
    "PRESETS",
    "ModelConfig",
    "ParamShape",
    "get_preset",
    "param_specs",
    "seeded_param",
    "seeded_state_dict",
]
