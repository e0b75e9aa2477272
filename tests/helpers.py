"""Small helpers for tests (not fixtures)."""

from __future__ import annotations

from typing import Any

from policyworker import AbstractPolicyWorker


class BareWorker(AbstractPolicyWorker):
    """The abstract core with the model-specific methods left out (tests of the core only)."""

    async def prepare_nccl_reshard_refit_info(self, train_parallelism, gen_parallelism, train_world_size, gen_world_size) -> dict:
        raise NotImplementedError("not part of the core under test")

    async def nccl_reshard_refit(self, kv_scales=None, refit_timeout_s=None) -> Any:
        raise NotImplementedError("not part of the core under test")

    async def get_reference_policy_logprobs(self, *, data, micro_batch_size=None):
        raise NotImplementedError("not part of the core under test")


from policyworker.reshard_worker import NcclReshardMixin  # noqa: E402


class ShardTrainer(NcclReshardMixin, BareWorker):
    """A trainer holding given local shards (tests of the refit path only)."""

    def __init__(self, *, local_params, source, **kwargs):
        super().__init__(**kwargs)
        self.local_params = local_params
        self.source = source

    def _refit_local_params(self, plan):
        return self.local_params

    def _refit_model_source(self):
        return self.source

    def _refit_dtype(self):
        return next(iter(self.local_params.values())).dtype
