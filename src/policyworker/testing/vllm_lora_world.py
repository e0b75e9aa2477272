"""Trainer processes that refit a LoRA adapter into vLLM: the tests' and the bench's world.

As :mod:`.vllm_world`, with each trainer a ``LoraPolicyWorker`` over a PEFT LoRA model
on version 0's base (``base_seed``'s, to test a base that is not the engine's). Version
``v``'s adapter is drawn from ``torch.Generator`` seeded ``v`` (factors in name order,
normal with ``std``), so the controller can build the same adapter for the oracle:
Hugging Face PEFT's greedy generation with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policyworker.testing.vllm_world import WorldSpec, hf_model

__all__ = ["LoraWorldSpec", "adapter_weights", "peft_model"]

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraWorldSpec(WorldSpec):
    """A `WorldSpec` whose trainers train a LoRA adapter of rank ``r`` on ``targets``."""

    r: int = 8
    alpha: float = 16.0
    targets: list[str] = field(default_factory=lambda: list(PROJECTIONS))
    std: float = 0.15
    #: The base's weights: ``hf_model(spec, base_seed)`` (the engine loads seed 0's).
    base_seed: int = 0

    def make_worker(self, rank: int) -> Any:
        from policyworker.integrations.peft import LoraPolicyWorker

        # Its setup (reshard_options) is given when prepare() attaches nccl_reshard.
        return LoraPolicyWorker(peft_model(self, 0), rank=rank, world_size=self.n_train, device="cpu",
                                timeout_s=self.timeout_s)

    def load(self, worker: Any, version: int) -> None:
        import torch

        from policyworker.integrations.peft import adapter_tensors

        live = adapter_tensors(worker.model)
        with torch.no_grad():
            for name, value in adapter_weights(self, version, worker.model).items():
                live[name].copy_(value)

    async def prepare(self, worker: Any, gen_world_size: int, train: str | None = None, **options: Any) -> dict:
        from policyworker.integrations.vllm.lora_plan import prepare_vllm_lora_refit

        return await prepare_vllm_lora_refit(worker, self.train, gen_world_size,
                                             **{**self.reshard_options, **options})


def adapter_weights(spec: LoraWorldSpec, version: int, model: Any) -> dict[str, Any]:
    """Version ``version``'s factors by plain name, shaped like ``model``'s (deterministic)."""
    import torch

    from policyworker.integrations.peft import adapter_tensors

    gen = torch.Generator().manual_seed(version)
    return {n: (torch.randn(t.shape, generator=gen, dtype=torch.float32) * spec.std).to(t.dtype)
            for n, t in sorted(adapter_tensors(model).items())}


def peft_model(spec: LoraWorldSpec, version: int | None) -> Any:
    """The base (``base_seed``'s weights) with a LoRA adapter (version ``version``'s factors; None: PEFT's init)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf_model(spec, spec.base_seed), LoraConfig(r=spec.r, lora_alpha=spec.alpha,
                                                         target_modules=list(spec.targets)))
    if version is not None:
        from policyworker.integrations.peft import adapter_tensors

        live = adapter_tensors(model)
        with torch.no_grad():
            for name, value in adapter_weights(spec, version, model).items():
                live[name].copy_(value)
    return model.eval()
