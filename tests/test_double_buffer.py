"""RolloutWorker(double_buffer=True): refits land in a second set, weights() serves v meanwhile.

Real processes over real gloo (nccl_reshard): a reader on the rollout's loop calls
``served()`` throughout each transfer and checks the bytes it gets against the last
committed version's shards, bit for bit; a refit that fails mid-transfer leaves that
version served and not torn, and the next refit commits bit-exact.
"""

from __future__ import annotations

import pytest

from policyworker.runtime.procs import free_port, run_world

from .refit_world import RefitSpec, refit_rank

pytestmark = pytest.mark.multiprocess


def _world(spec: RefitSpec) -> list[dict]:
    spec.update_port = free_port()
    spec.stage_ports = [free_port() for _ in range(spec.train_par.pp)]
    spec.train_port = free_port()
    return run_world(refit_rank, spec.train_par.world_size + spec.gen_par.world_size, (spec,), timeout_s=105)


def _check_mid(mid: dict) -> None:
    assert mid["in_flight"] > 0, mid  # reads happened while the transfer ran
    assert mid["exact"] == mid["in_flight"], mid  # each one the committed version, bit for bit


@pytest.mark.timeout(120)
def test_weights_serve_the_committed_version_during_every_transfer():
    spec = RefitSpec(preset="tiny", train="tp=2", gen="tp=2", refits=3, double_buffer=True,
                     options={"bucket_bytes": 8192})
    results = _world(spec)
    for r in results[2:]:
        outs = r["outcomes"]
        assert [o.get("exact") for o in outs] == [True] * 3, outs
        assert r["weight_version"] == 3
        for o in outs:
            _check_mid(o["mid"])
        assert r["staging_bytes"] == r["recv_expected"]  # one more copy of this rank's weights


@pytest.mark.timeout(120)
def test_a_transfer_that_stops_midway_leaves_the_last_version_served_not_torn():
    spec = RefitSpec(preset="tiny", train="tp=2", gen="tp=1", refits=2, refit_timeout_s=4.0, double_buffer=True,
                     options={"bucket_bytes": 8192}, fault={"version": 2, "kind": "drop_last_bucket"})
    rollout = _world(spec)[2]
    first, failed = rollout["outcomes"]
    assert first["ok"] and first["exact"] and first["version"] == 1
    assert failed["ok"] is False and failed["error"] in {"RefitTimeout", "RefitAborted"}
    assert failed["weight_version"] == 1 and failed["torn"] is False  # the in-place path would be torn
    _check_mid(failed["mid"])
    assert rollout["serves_after_failure"] is True and rollout["serves_exact"] is True


@pytest.mark.timeout(120)
def test_after_a_corrupted_transfer_the_next_refit_commits_bit_exact():
    spec = RefitSpec(preset="tiny", train="tp=2", gen="tp=1", refits=3, double_buffer=True, go_on_after_failure=True,
                     options={"checksum": True, "bucket_bytes": 8192}, fault={"version": 2, "kind": "flip_byte"})
    rollout = _world(spec)[2]
    first, failed, third = rollout["outcomes"]
    assert first["exact"] and first["version"] == 1
    assert failed["error"] == "ProtocolError" and failed["weight_version"] == 1 and failed["torn"] is False
    assert rollout["serves_exact"] is True
    assert third["ok"] and third["exact"] and third["version"] == 2  # the failed version is retried
    _check_mid(third["mid"])


@pytest.mark.timeout(120)
def test_zmq_double_buffer_serves_v_mid_transfer_and_keeps_one_copy_program_per_set():
    from .zmq_world import ZmqSpec, zmq_rank

    spec = ZmqSpec(refits=4, double_buffer=True, options={"bucket_bytes": 1024})
    trainer, rollout = run_world(zmq_rank, 2, (spec,), timeout_s=100)
    assert [o["ok"] for o in trainer["outcomes"]] == [True] * 4, trainer["outcomes"]
    outs = rollout["outcomes"]
    assert [o.get("exact") for o in outs] == [True] * 4, outs
    assert [o["weight_version"] for o in outs] == [1, 2, 3, 4]
    for o in outs:
        _check_mid(o["mid"])
    # one program per landing set, compiled once each, then reused as the sets alternate
    assert ["copy program rebuilt" in o["notes"] for o in outs] == [True, True, False, False], outs
    assert rollout["staging_bytes"] == rollout["expected_bytes"]


def test_delta_refits_are_refused_with_double_buffer():
    import asyncio

    from policyworker import ConfigError, RolloutWorker

    async def main():
        w = RolloutWorker(device="cpu", double_buffer=True)
        try:
            with pytest.raises(ConfigError, match="delta refits need the in-place path"):
                await w._attach("nccl_reshard", {"delta": True})
            with pytest.raises(ConfigError, match="double_buffer must be a bool"):
                RolloutWorker(device="cpu", double_buffer="yes")
        finally:
            await w.shutdown()

    asyncio.run(main())
