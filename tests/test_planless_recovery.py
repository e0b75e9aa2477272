"""What a plan-less transport needs after a failed refit (docs/vllm.md): both sides re-attach.

A rollout's refit fails (its deadline passes: the trainer never sends). After both sides
re-attach, the next refit commits bit-exact: the files plugin with the same directory,
the in-memory test transport with a fresh hub (a hub is the attachments' shared state).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from policyworker import RefitTimeout, RolloutWorker, TorchPolicyWorker
from policyworker.testing import MemoryHub

pytestmark = pytest.mark.anyio


def _pair():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    trainer = TorchPolicyWorker(model, device="cpu", timeout_s=10)
    rollout = RolloutWorker(device="cpu", params={n: torch.zeros_like(p) for n, p in model.named_parameters()},
                            timeout_s=10)
    return model, trainer, rollout


def _step(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


async def _fail_then_recover(name: str, setup: dict, recovery_setup: dict):
    model, trainer, rollout = _pair()
    try:
        await asyncio.gather(trainer.attach_transport(name, **setup), rollout.attach_transport(name, **setup))
        _step(model, 1)
        await asyncio.gather(trainer.refit(name), rollout.refit(name))
        assert rollout.weight_version == 1
        with pytest.raises(RefitTimeout):  # the trainer never sends
            await rollout.refit(name, refit_timeout_s=0.5)
        assert (rollout.weight_version, rollout.torn) == (1, False)
        # The recovery: both sides re-attach, then the next refit commits bit-exact.
        await asyncio.gather(trainer.attach_transport(name, **recovery_setup),
                             rollout.attach_transport(name, **recovery_setup))
        _step(model, 2)
        await asyncio.gather(trainer.refit(name, refit_timeout_s=5), rollout.refit(name, refit_timeout_s=5))
        assert rollout.weight_version > 1 and not rollout.torn
        for n, p in model.named_parameters():
            assert torch.equal(rollout.weights()[n], p.detach())
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


@pytest.mark.timeout(60)
async def test_memory_after_a_failed_refit_both_sides_reattach_then_it_commits():
    await _fail_then_recover("memory", {"hub": MemoryHub()}, {"hub": MemoryHub()})


@pytest.mark.timeout(60)
async def test_files_after_a_failed_refit_both_sides_reattach_then_it_commits(tmp_path):
    pytest.importorskip("policyworker_files")
    setup = {"directory": str(tmp_path)}
    await _fail_then_recover("files", setup, setup)
