"""Small helpers for tests (not fixtures)."""

from __future__ import annotations

from typing import Any

from policyworker import AbstractPolicyWorker


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
