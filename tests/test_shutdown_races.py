"""Shutdown and group rebuilds never close a group the executor thread is inside.

Real processes: a rank blocks its executor in an update-group collective its peer
never joins, then rebuilds (``init_collective`` on a fresh port) or shuts down while
that refit-thread work is in flight. The blocked call must end with ``RefitAborted``
(abort first), the rebuild/shutdown must wait for the thread to leave (bounded), and
the new group must work. In process: a stuck executor cannot hold shutdown past
``timeout_s``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from policyworker.runtime.procs import free_port, run_world

pytestmark = [pytest.mark.multiprocess]


def _pair_rank(rank: int, ports: list[int]) -> dict:
    import torch

    from policyworker.errors import RefitAborted
    from policyworker.workers.rollout import RolloutWorker
    from policyworker.models.toy_model import build_model
    from policyworker.models import get_preset
    from policyworker.workers.torch_trainer import TorchPolicyWorker

    torch.set_num_threads(1)

    async def main() -> dict:
        if rank == 0:
            w = TorchPolicyWorker(build_model(get_preset("tiny"), seed=0), rank=0, world_size=1, device="cpu",
                                  timeout_s=20)
        else:
            w = RolloutWorker(rank=0, gen_world_size=1, device="cpu", timeout_s=20)
        out: dict = {}
        await w.init_collective("127.0.0.1", ports[0], 2, train_world_size=1)
        first = w.model_update_group
        if rank == 0:
            # A collective rank 1 never joins: the executor thread sits inside `first`.
            stuck = asyncio.ensure_future(w._run(first.barrier, deadline=time.monotonic() + 60))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            rebuild = asyncio.ensure_future(w.init_collective("127.0.0.1", ports[1], 2, train_world_size=1))
            try:
                await stuck
            except RefitAborted:
                out["stuck_error"] = "RefitAborted"
            await rebuild
            out["rebuild_seconds"] = time.monotonic() - t0
            out["old_closed"] = first.pg is None
        else:
            await asyncio.sleep(1.0)
            await w.init_collective("127.0.0.1", ports[1], 2, train_world_size=1)
        second = w.model_update_group
        await w._run(second.barrier, deadline=time.monotonic() + 20)  # the new group works
        out["new_group_works"] = second is not first
        if rank == 0:
            stuck = asyncio.ensure_future(w._run(second.barrier, deadline=time.monotonic() + 60))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await w.shutdown()
            out["shutdown_seconds"] = time.monotonic() - t0
            out["shutdown_clean"] = w.shutdown_clean
            try:
                await stuck
            except RefitAborted:
                out["stuck_at_shutdown"] = "RefitAborted"
            out["second_closed"] = second.pg is None
        else:
            await asyncio.sleep(2.0)
            await w.shutdown()
        return out

    return asyncio.run(main())


@pytest.mark.timeout(120)
def test_rebuild_and_shutdown_mid_collective_abort_then_close():
    res = run_world(_pair_rank, 2, ([free_port(), free_port()],), timeout_s=100)
    r0 = res[0]
    assert r0["stuck_error"] == "RefitAborted"  # aborted before its group was replaced
    assert r0["old_closed"] is True and r0["new_group_works"] is True and res[1]["new_group_works"] is True
    assert r0["stuck_at_shutdown"] == "RefitAborted"
    assert r0["shutdown_clean"] is True and r0["second_closed"] is True
    assert r0["shutdown_seconds"] < 20  # bounded by timeout_s, in practice at once


@pytest.mark.timeout(60)
def test_shutdown_wait_is_bounded_when_the_executor_is_stuck():
    from policyworker.workers.rollout import RolloutWorker

    async def main():
        w = RolloutWorker(rank=0, gen_world_size=1, device="cpu", timeout_s=0.5)
        release = asyncio.Event()
        import threading

        gate = threading.Event()
        stuck = asyncio.ensure_future(w._run(gate.wait, 30))  # no abort reaches a bare wait
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await w.shutdown()
        took = time.monotonic() - t0
        clean = w.shutdown_clean
        gate.set()
        await stuck
        release.set()
        return took, clean

    took, clean = asyncio.run(main())
    assert clean is False
    assert took < 10  # bounded by timeout_s (0.5 s) plus scheduling, never the 30 s of the stuck call
