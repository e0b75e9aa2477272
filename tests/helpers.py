"""Small helpers for tests (not fixtures)."""

from __future__ import annotations


import torch

from policyworker import AbstractPolicyWorker


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (float8 has no ``torch.equal`` on CPU)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


class BareWorker(AbstractPolicyWorker):
    """The abstract core with the model-specific methods left out (tests of the core only)."""

    async def get_reference_policy_logprobs(self, *, data, micro_batch_size=None):
        raise NotImplementedError("not part of the core under test")


class ShardTrainer(BareWorker):
    """A trainer holding given local shards (tests of the refit path only)."""

    def __init__(self, *, local_params, source, **kwargs):
        super().__init__(**kwargs)
        self.local_params = local_params
        self.source = source

    def _plan_tensors(self, plan):
        return self.local_params

    def _named_tensors(self):
        return self.local_params

    def _refit_model_source(self):
        return self.source

    def _refit_dtype(self):
        return next(iter(self.local_params.values())).dtype
