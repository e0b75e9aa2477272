"""A vLLM layer the policyworker backend cannot refit is refused with a typed ConfigError naming it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from policyworker.errors import ConfigError  # noqa: E402
from policyworker.integrations.vllm.targets import vllm_targets  # noqa: E402


@pytest.mark.parametrize("layer", [torch.nn.Linear(4, 4), torch.nn.Conv1d(2, 2, 1)])
def test_unknown_layer_is_refused_naming_it(layer):
    model = torch.nn.Module()
    block = torch.nn.Module()
    block.add_module("proj", layer)
    model.add_module("block", block)
    kind = type(layer).__name__
    with pytest.raises(ConfigError, match=rf"^vLLM layer {kind} \(block\.proj\) is not supported") as info:
        vllm_targets(model)
    assert info.value.param == "block.proj.weight"
