"""Independent groups among real spawned processes (gloo on CPU, random free ports)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from policyworker import ConfigError, RefitAborted, RolloutWorker
from policyworker.runtime.comm import new_group
from policyworker.errors import PeerLost, RefitTimeout, TransportError
from policyworker.runtime.procs import ProcessFailed, free_port, run_world
from policyworker.runtime.watchdog import RefitWatchdog

from .helpers import BareWorker

pytestmark = pytest.mark.multiprocess


def _update_group_rank(rank: int, n_train: int, n_gen: int, ports: list[int]) -> dict:
    async def main() -> dict:
        world = n_train + n_gen
        if rank < n_train:
            w = BareWorker(rank=rank, world_size=n_train, device="cpu", timeout_s=30)
        else:
            w = RolloutWorker(rank=rank - n_train, gen_world_size=n_gen, device="cpu", timeout_s=30)
        seen = []
        for port in ports:  # the second call replaces the first group (recovery path)
            old = w.model_update_group
            await w.init_collective("127.0.0.1", port, world, train_world_size=n_train)
            g = w.model_update_group
            assert old is None or old.aborted  # the old group is closed, not leaked
            payload = torch.arange(1000, dtype=torch.float32) * (port % 97) if g.rank == 0 else torch.zeros(1000)
            g.broadcast(payload, 0)
            seen.append((g.rank, g.world_size, payload.sum().item()))
        await w.shutdown()
        return {"seen": seen, "alive_after": w.is_alive()}

    return asyncio.run(main())


def test_update_group_forms_verifies_and_is_reentrant():
    n_train, n_gen = 2, 2
    ports = [free_port(), free_port()]
    results = run_world(_update_group_rank, n_train + n_gen, (n_train, n_gen, ports), timeout_s=90)
    for rank, res in enumerate(results):
        assert [s[0] for s in res["seen"]] == [rank, rank]  # trainers first, then inference ranks
        assert all(s[1] == 4 for s in res["seen"])
        expect = [float((torch.arange(1000, dtype=torch.float32) * (p % 97)).sum()) for p in ports]
        assert [s[2] for s in res["seen"]] == expect
        assert res["alive_after"] is False


def _stage_groups_rank(rank: int, ports: list[int]) -> dict:
    # world: trainers 0 (stage 0) and 1 (stage 1); rollouts 2, 3 (gen ranks 0, 1)
    async def main() -> dict:
        got = {}
        if rank < 2:
            w = BareWorker(rank=rank, world_size=2, device="cpu", timeout_s=30)
            await w.init_nccl_reshard_comm_group(["127.0.0.1"] * 2, ports, 2, rank, 3, 0)
            g = w.pp_comm_group
            works = []
            for dst in (1, 2):
                t = torch.full((257,), float(100 * rank + dst))
                works.append((g.isend(t, dst), t))
            for work, _t in works:
                g.wait(work)
            got["stage"] = w._refit_transport_state("nccl_reshard")["pp_stage"]
        else:
            w = RolloutWorker(rank=rank - 2, gen_world_size=2, device="cpu", timeout_s=30)
            await w.init_nccl_reshard_comm_groups(["127.0.0.1"] * 2, ports, [1, 1])
            for stage, g in sorted(w.stage_groups.items()):
                buf = torch.empty(257)
                g.wait(g.irecv(buf, 0))
                got[stage] = buf[0].item()
                assert torch.equal(buf, torch.full((257,), buf[0].item()))
        await w.shutdown()
        return got

    return asyncio.run(main())


def test_each_stage_group_holds_its_trainers_then_every_gen_rank():
    ports = [free_port(), free_port()]
    results = run_world(_stage_groups_rank, 4, (ports,), timeout_s=90)
    assert results[0] == {"stage": 0} and results[1] == {"stage": 1}
    # rollout gen rank g is group rank 1 + g in both stage groups
    assert results[2] == {0: 1.0, 1: 101.0}
    assert results[3] == {0: 2.0, 1: 102.0}


def _lonely_rank(rank: int, port: int) -> str:
    t0 = time.monotonic()
    try:
        new_group(host="127.0.0.1", port=port, rank=0, world_size=2, name="lonely", timeout_s=2.0)
    except (RefitTimeout, PeerLost, TransportError) as exc:
        return f"{type(exc).__name__} after {time.monotonic() - t0:.1f}s"
    return "formed?!"


def test_a_peer_that_never_comes_fails_within_the_timeout():
    (out,) = run_world(_lonely_rank, 1, (free_port(),), timeout_s=30)
    kind, _, after = out.partition(" after ")
    assert kind in {"RefitTimeout", "PeerLost", "TransportError"}
    assert float(after.rstrip("s")) < 10.0


def test_a_port_in_use_is_a_config_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match="already in use"):
            new_group(host="127.0.0.1", port=port, rank=0, world_size=2, name="busy", timeout_s=2.0)


def _abort_rank(rank: int, port: int) -> dict:
    g = new_group(host="127.0.0.1", port=port, rank=rank, world_size=2, name="abort", timeout_s=20)
    if rank == 1:
        time.sleep(3.0)  # never joins the broadcast: rank 0 is stuck until its watchdog fires
        return {"slept": True}
    wd = RefitWatchdog()
    deadline = wd.arm(0.5, [g.abort], label="abort-test")
    t0 = time.monotonic()
    try:
        g.broadcast(torch.zeros(10), 1)
    except RefitAborted as exc:
        return {"error": type(exc).__name__, "after": time.monotonic() - t0, "fired": deadline.fired}
    return {"error": None}


def test_watchdog_abort_unblocks_a_stuck_collective():
    res = run_world(_abort_rank, 2, (free_port(),), timeout_s=60)
    assert res[0]["error"] == "RefitAborted" and res[0]["fired"] is True
    assert res[0]["after"] < 2.0


def _dying_rank(rank: int, port: int) -> dict:
    import os

    g = new_group(host="127.0.0.1", port=port, rank=rank, world_size=2, name="dying", timeout_s=30)
    if rank == 1:
        time.sleep(0.3)
        os._exit(0)  # dies without a word while rank 0 waits for its bytes
    t0 = time.monotonic()
    try:
        g.wait(g.irecv(torch.empty(100), 1))
    except PeerLost:
        return {"error": "PeerLost", "after": time.monotonic() - t0}
    return {"error": None}


def test_a_dead_peer_is_peer_lost_promptly():
    from policyworker.runtime.procs import start_world

    world = start_world(_dying_rank, 2, (free_port(),))
    out = world.collect(60, allow_dead=[1])
    assert out[0]["error"] == "PeerLost"
    assert out[0]["after"] < 10.0


def _raiser(rank: int) -> None:
    raise ValueError(f"rank {rank} failed on purpose")


def test_harness_reports_child_tracebacks():
    with pytest.raises(ProcessFailed) as info:
        run_world(_raiser, 2, timeout_s=90)
    assert set(info.value.failures) == {0, 1}
    assert "failed on purpose" in info.value.failures[1]
