"""nccl_reshard end to end: real processes, real gloo, bit-exact weights."""

from __future__ import annotations

import pytest

from policyworker.procs import free_port, run_world

from .refit_world import RefitSpec, refit_rank

pytestmark = pytest.mark.multiprocess


def _run(preset, train, gen, **kw):
    spec = RefitSpec(preset=preset, train=train, gen=gen, **kw)
    spec.update_port = free_port()
    spec.stage_ports = [free_port() for _ in range(spec.train_par.pp)]
    n = spec.train_par.world_size + spec.gen_par.world_size
    results = run_world(refit_rank, n, (spec,), timeout_s=150)
    n_train = spec.train_par.world_size
    hashes = {r["hash"] for r in results}
    assert len(hashes) == 1
    for r in results[n_train:]:
        assert r["exact"] == [True] * spec.refits, r["exact"]
        assert [rep["version"] for rep in r["reports"]] == list(range(1, spec.refits + 1))
        assert r["weight_version"] == spec.refits
        assert all(rep["bytes"] == r["recv_expected"] for rep in r["reports"])  # exactly its shard's bytes
        assert [rep["kv_scales"] for rep in r["reports"]] == [{"layer0.k": 0.5 * v} for v in range(1, spec.refits + 1)]
    return results


@pytest.mark.parametrize(
    "train, gen",
    [
        ("tp=2", "tp=1"),
        ("tp=1", "tp=2"),
        ("tp=2,pp=2", "tp=2"),
    ],
)
def test_refits_land_bit_exact(train, gen):
    _run("tiny", train, gen)


def test_small_buckets_many_in_flight_and_checksums():
    _run("tiny", "tp=2", "tp=2", options={"bucket_bytes": 4096, "in_flight": 3, "checksum": True}, refits=2)


def test_moe_with_expert_parallel():
    _run("tiny-moe", "tp=1,dp=2,ep=2", "tp=2")
