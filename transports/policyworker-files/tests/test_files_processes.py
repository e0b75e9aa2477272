"""The files transport between real processes that share only a directory: a
``TorchPolicyWorker`` in one, a ``RolloutWorker`` in another, through the entry point,
``attach_transport`` and ``refit``; then a trainer killed mid-write."""

from __future__ import annotations

import asyncio
import os

import pytest

from files_helpers import committed, listing, make_rollout
from files_world import CRASH_EXIT_CODE, crash_mid_write, refit_pair, two_trainers_and_rollout
from policyworker.errors import RefitTimeout
from policyworker.runtime.procs import process_context, run_world, start_world

pytestmark = pytest.mark.multiprocess

WORLD_TIMEOUT_S = 90.0
SETUP = {"file_bytes": 64_000, "keep": 2}


def _run_pair(directory: str, refits: int) -> tuple[dict, dict]:
    barrier = process_context().Barrier(2)
    trainer, rollout = run_world(refit_pair, 2, (directory, refits, barrier, 60.0, SETUP), timeout_s=WORLD_TIMEOUT_S)
    return trainer, rollout


def _check_pair(trainer: dict, rollout: dict, versions: list[int]) -> None:
    assert [r["version"] for r in trainer["reports"]] == versions
    assert [r["version"] for r in rollout["reports"]] == versions
    assert [r["committed"] for r in rollout["reports"]] == versions
    assert all(rollout["exact"]), rollout["exact"]
    assert rollout["digests"] == trainer["digests"]  # the rollout holds what the trainer held
    assert len(set(trainer["digests"])) == len(versions)  # every refit moved new weights
    assert all(r["bytes"] > 0 and r["files"] > 1 for r in trainer["reports"])
    assert [r["bytes"] for r in rollout["reports"]] == [r["bytes"] for r in trainer["reports"]]


def test_trainer_and_rollout_processes_refit_bit_exact(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = _run_pair(d, refits=3)
    _check_pair(trainer, rollout, [1, 2, 3])
    assert listing(d) == ["signature.json", "v00000002", "v00000003"]


def test_trainer_killed_mid_write_leaves_no_half_version(tmp_path):
    d = str(tmp_path / "refit")
    world = start_world(crash_mid_write, 1, (d, 2, SETUP))
    try:
        world.procs[0].join(WORLD_TIMEOUT_S)
        assert world.procs[0].exitcode == CRASH_EXIT_CODE
    finally:
        world.close()
    # Two files of version 1 were written, then the process died: only its hidden
    # temporary directory exists, without a manifest, and no committed version.
    tmp = [n for n in listing(d) if n.startswith(".v00000001.tmp-r0-")]
    assert len(tmp) == 1 and committed(d) == []
    assert sorted(os.listdir(os.path.join(d, tmp[0]))) == ["part-00000.safetensors", "part-00001.safetensors"]

    async def rollout_sees_nothing() -> tuple[int, bool]:
        w = make_rollout()
        try:
            await w.attach_transport("files", directory=d)
            with pytest.raises(RefitTimeout):
                await w.refit("files", refit_timeout_s=0.5)
            return w.weight_version, w.torn
        finally:
            await w.shutdown()

    assert asyncio.run(rollout_sees_nothing()) == (0, False)
    # A restarted trainer cleans its rank's leftovers at connect and refits normally.
    trainer, rollout = _run_pair(d, refits=2)
    assert trainer["resumed_from"] == 0
    _check_pair(trainer, rollout, [1, 2])
    assert listing(d) == ["signature.json", "v00000001", "v00000002"]


@pytest.mark.parametrize("late", ["non-writer", "writer"])
def test_two_trainers_without_a_barrier_report_the_published_versions(tmp_path, late):
    """Two trainer processes (rank 0 writes) and a rollout process, no barrier: whichever
    trainer starts late, both report the versions the writer published (the non-writer
    with 0 bytes, only once that version is committed), and a rollout that follows
    their reports lands each bit for bit."""
    d = str(tmp_path / "refit")
    reports = process_context().Queue()
    writer, other, rollout = run_world(two_trainers_and_rollout, 3, (d, 3, reports, late, 60.0, SETUP),
                                       timeout_s=WORLD_TIMEOUT_S)
    assert [r["version"] for r in writer["reports"]] == [1, 2, 3]
    assert [r["version"] for r in other["reports"]] == [1, 2, 3]
    assert all(r["bytes"] > 0 for r in writer["reports"]) and all(r["bytes"] == 0 for r in other["reports"])
    # The non-writer never reports a version before the writer committed it.
    assert all(r["version"] <= r["published_at_return"] for r in other["reports"])
    assert rollout["disagree"] == [] and rollout["asked"] == [1, 2, 3]
    assert rollout["final"] == 3 and rollout["landed"][-1] == 3 and all(rollout["exact"])
