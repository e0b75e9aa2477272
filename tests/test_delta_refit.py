"""Delta refits over nccl_reshard: real processes, gloo, bit-exact against an independent oracle."""

from __future__ import annotations

import pytest

from policyworker.cli.procs import free_port, run_world

from .delta_world import DeltaSpec, delta_rank

pytestmark = pytest.mark.multiprocess


def _world(spec: DeltaSpec) -> list[dict]:
    spec.update_port = free_port()
    spec.stage_ports = [free_port() for _ in range(spec.train_par.pp)]
    return run_world(delta_rank, spec.train_par.world_size + spec.gen_par.world_size, (spec,), timeout_s=100)


@pytest.mark.timeout(120)
def test_several_delta_versions_land_bit_exact_and_move_few_bytes():
    spec = DeltaSpec(train="tp=2,pp=2", gen="tp=2,dp=2", fractions=[1.0, 0.01, 0.03, 0.0, 1.0, 0.02],
                     full_at=())
    results = _world(spec)
    rollouts = results[spec.train_par.world_size:]
    for r in rollouts:
        outs = r["outcomes"]
        assert [o["ok"] for o in outs] == [True] * 6, outs
        assert [o["exact"] for o in outs] == [True] * 6, outs
        assert [o["version"] for o in outs] == [1, 2, 3, 4, 5, 6]
        # v1: no shadow yet; v5: every element changed (past delta_max_fraction) -> full
        assert [o["delta"] for o in outs] == [False, True, True, True, False, True], [o["notes"] for o in outs]
        assert all(o["bytes"] == o["expected_bytes"] for o in outs)
        for o in outs:
            if o["delta"]:
                assert o["wire_bytes"] < 0.1 * o["bytes"], o
    for r in results[:spec.train_par.world_size]:
        assert all(o["ok"] for o in r["outcomes"]), r["outcomes"]
        assert r["outcomes"][-1]["shadow_bytes"] > 0
