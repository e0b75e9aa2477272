"""The conformance suite on the built-ins that run both ends in one process: memory, nccl_reshard.

(zmq runs it in tests/test_zmq_ipc.py; the files plugin in its own tests. sglang_ipc's
receiver is the SGLang engine itself, not a Transport: tests/test_sglang_ipc.py.)
nccl_reshard's two ends join real gloo groups from two threads of this process.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from policyworker.comm import new_group
from policyworker.device import device_facts
from policyworker.layout import build_plan, dest_shards
from policyworker.models import get_preset, seeded_state_dict
from policyworker.cli.procs import free_port
from policyworker.testing import TransportPair, check_transport, memory_pair_factory
from policyworker.transports.base import TransportContext
from policyworker.transports.nccl_delta import DeltaSettings
from policyworker.transports.nccl_reshard import NcclReshardTransport

pytestmark = pytest.mark.anyio


async def test_memory_passes_the_suite():
    params = {"a": torch.randn(64, 8), "b": torch.arange(12, dtype=torch.int64)}
    result = await check_transport(memory_pair_factory(params))
    assert [r.version for r in result.reports] == [1, 1, 2, 2, 3, 3]
    assert result.timeout_seconds < 4 and result.abort_seconds < 2


def _groups(n: int = 2) -> list[tuple]:
    """Stage and update groups of a 1 trainer + 1 rollout world, joined from two threads."""
    stage_port, update_port = free_port(), free_port()

    def join(rank: int):
        stage = new_group(host="127.0.0.1", port=stage_port, rank=rank, world_size=n, name="reshard_pp0",
                          timeout_s=20)
        update = new_group(host="127.0.0.1", port=update_port, rank=rank, world_size=n, name="model_update",
                           timeout_s=20)
        return stage, update

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(join, range(n)))


def _nccl_factory(plan, recv_plan=None, delta=False):
    config = get_preset("tiny")
    dtype = getattr(torch, plan.params[0].dtype)
    src = {k: v.clone() for k, v in seeded_state_dict(config, seed=0, dtype=dtype).items()}
    recv_plan = recv_plan or plan
    facts = device_facts("cpu")

    async def factory() -> TransportPair:
        (s_stage, s_update), (r_stage, r_update) = await asyncio.to_thread(_groups)
        dst = {k: torch.zeros(v.shape, dtype=getattr(torch, v.dtype)) for k, v in
               recv_plan.local_tensors("dst", 0).items()}
        execs = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]
        s_ctx = TransportContext(worker=None, role="send", rank=0, device=facts, params=src, plan=plan,
                                 state={"group": s_stage, "stage": 0}, update_group=s_update, executor=execs[0])
        r_ctx = TransportContext(worker=None, role="receive", rank=0, device=facts, params=dst, plan=recv_plan,
                                 state={"groups": {0: r_stage}}, update_group=r_update, executor=execs[1])

        async def close() -> None:
            for g in (s_stage, s_update, r_stage, r_update):
                g.abort()
                g.close()
            for e in execs:
                e.shutdown(wait=False)

        sender, receiver = NcclReshardTransport(bucket_bytes=4096), NcclReshardTransport(bucket_bytes=4096)
        if delta:  # every refit after the first a delta, even at 100% changed (the suite's perturbation)
            sender.delta = receiver.delta = DeltaSettings(max_fraction=1.0)
        return TransportPair(sender, s_ctx, receiver, r_ctx, expected=lambda p: dest_shards(plan, 0, p), close=close)

    return factory


@pytest.mark.multiprocess
async def test_nccl_reshard_passes_the_suite():
    config = get_preset("tiny")
    plan = build_plan(config, "tp=1", "tp=1", 1, 1, dtype=torch.float32)
    other = build_plan(config, "tp=1", "tp=1", 1, 1, dtype=torch.bfloat16)
    result = await check_transport(_nccl_factory(plan), mismatched_factory=_nccl_factory(plan, other))
    assert [r.version for r in result.reports] == [1, 1, 2, 2, 3, 3]
    assert result.timeout_seconds < 4 and result.abort_seconds < 2


@pytest.mark.multiprocess
async def test_nccl_reshard_in_delta_mode_passes_the_suite():
    config = get_preset("tiny")
    plan = build_plan(config, "tp=1", "tp=1", 1, 1, dtype=torch.bfloat16)
    other = build_plan(config, "tp=1", "tp=1", 1, 1, dtype=torch.float32)
    result = await check_transport(_nccl_factory(plan, delta=True),
                                   mismatched_factory=_nccl_factory(plan, other, delta=True))
    assert [r.version for r in result.reports] == [1, 1, 2, 2, 3, 3]
    kinds = [r.notes[-1].split(" ")[0] for r in result.reports]
    assert kinds == ["full:", "full:", "delta", "delta", "delta", "delta"], [r.notes for r in result.reports]
    assert result.timeout_seconds < 4 and result.abort_seconds < 2
