"""Trainer processes whose versions differ in a few elements: the world of delta refits into vLLM.

As :mod:`.vllm_world`, but version ``v``'s weights are version 0's with ``v`` sparse
steps applied in turn: step ``s`` adds normal noise (``std``) to a ``fraction`` of each
parameter's elements, drawn from ``torch.Generator`` seeded ``s`` (parameters in name
order). The controller builds the same weights for the oracle (Hugging Face greedy
generation), so consecutive versions share most bytes, as after small optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policyworker.testing.vllm_world import WorldSpec, _load, hf_model

__all__ = ["DeltaWorldSpec", "sparse_step_model"]


@dataclass
class DeltaWorldSpec(WorldSpec):
    """A `WorldSpec` whose version ``v`` is version 0 after ``v`` sparse steps."""

    fraction: float = 0.02
    std: float = 0.5

    def load(self, worker: Any, version: int) -> None:
        import torch

        _load(worker.model, sparse_step_model(self, version), torch)


def sparse_step_model(spec: DeltaWorldSpec, version: int) -> Any:
    """The Hugging Face model with version ``version``'s weights (see the module docstring)."""
    import torch

    model = hf_model(spec, 0)
    with torch.no_grad():
        for step in range(1, version + 1):
            gen = torch.Generator().manual_seed(step)
            for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                mask = torch.rand(p.shape, generator=gen) < spec.fraction
                noise = torch.randn(p.shape, generator=gen) * spec.std
                p.add_(torch.where(mask, noise, torch.zeros_like(noise)).to(p.dtype))
    return model
