"""Delta refits over nccl_reshard: real processes, gloo, bit-exact against an independent oracle."""

from __future__ import annotations

import pytest

from policyworker.runtime.procs import free_port, run_world

from .delta_world import DeltaSpec, delta_rank

pytestmark = pytest.mark.multiprocess


def _world(spec: DeltaSpec) -> list[dict]:
    spec.update_port = free_port()
    spec.stage_ports = [free_port() for _ in range(spec.train_par.pp)]
    return run_world(delta_rank, spec.train_par.world_size + spec.gen_par.world_size, (spec,), timeout_s=100)


@pytest.mark.timeout(120)
def test_several_delta_versions_land_bit_exact_and_move_few_bytes():
    spec = DeltaSpec(train="tp=2,pp=2", gen="tp=2,dp=2", fractions=[1.0, 0.01, 0.03, 0.0, 1.0, 0.02],
                     options={"delta": True, "delta_full_every": 4})
    results = _world(spec)
    rollouts = results[spec.train_par.world_size:]
    for r in rollouts:
        outs = r["outcomes"]
        assert [o["ok"] for o in outs] == [True] * 6, outs
        assert [o["exact"] for o in outs] == [True] * 6, outs
        assert [o["version"] for o in outs] == [1, 2, 3, 4, 5, 6]
        # v1: no shadow yet; v4: delta_full_every; v5: every element changed (past
        # delta_max_fraction) -> full
        assert [o["delta"] for o in outs] == [False, True, True, False, False, True], [o["notes"] for o in outs]
        assert "delta_full_every" in outs[3]["notes"][-1] and "too many" in outs[4]["notes"][-1]
        assert all(o["bytes"] == o["expected_bytes"] for o in outs)
        for o in outs:
            if o["delta"]:
                assert o["wire_bytes"] < 0.1 * o["bytes"], o
    for r in results[:spec.train_par.world_size]:
        assert all(o["ok"] for o in r["outcomes"]), r["outcomes"]
        assert r["outcomes"][-1]["shadow_bytes"] > 0


@pytest.mark.timeout(120)
def test_checksum_mismatch_fails_nothing_served_next_refit_full_forced_full_and_back_to_delta():
    # rollout 0's live bytes diverge after v2 (a flipped byte outside any refit): the v3
    # delta lands on a base that is not the trainers' -> its checksum fails, nobody
    # commits v3; v4 is full (rollout 0 reports no base); v5 the trainers force full;
    # v6 is a delta again.
    spec = DeltaSpec(fractions=[1.0, 0.01, 0.01, 0.01, 0.01, 0.01], corrupt=(0, 2), full_at=(5,))
    results = _world(spec)
    n_train = spec.train_par.world_size
    for r in results[:n_train]:
        outs = r["outcomes"]
        assert [o["ok"] for o in outs] == [True, True, False, True, True, True], outs
        assert outs[2]["error"] == "TransportError"
    r0, r1 = results[n_train:]
    assert r0["outcomes"][2]["error"] == "ProtocolError" and "checksum" in r0["outcomes"][2]["message"]
    assert r1["outcomes"][2]["error"] == "TransportError"
    assert r0["outcomes"][2]["torn"]  # its bytes are proven not the trainers': it refuses to serve
    for r in (r0, r1):
        outs = r["outcomes"]
        failed = outs[2]
        assert failed["weight_version"] == 2
        assert failed["torn"] or failed["intact"], failed  # refuses, or serves v2 exactly
        ok = [o for i, o in enumerate(outs) if i != 2]
        assert [o["exact"] for o in ok] == [True] * 5, ok
        assert [o["version"] for o in ok] == [1, 2, 4, 5, 6]
        assert [o["delta"] for o in ok] == [False, True, False, False, True], [o["notes"] for o in ok]
        assert "forced" not in ok[3]["notes"][-1] and "asked for a full refit" in ok[3]["notes"][-1]


@pytest.mark.timeout(120)
def test_a_stall_mid_delta_times_out_and_leaves_the_rollouts_intact_at_their_version():
    # Trainer 0 stalls at its 7th group wait of v3 (the handshake's 6 as the update
    # group's rank 0 of 4 — a row from each peer, an answer to each — then its one header
    # send), before it posts its payload, past everyone's deadline: the rollouts had
    # received headers only and applied nothing.
    spec = DeltaSpec(fractions=[1.0, 0.01, 0.01], stall=(0, 3, 7, 8.0), refit_timeout_s=3.0)
    results = _world(spec)
    n_train = spec.train_par.world_size
    for g, r in enumerate(results[n_train:]):
        outs = r["outcomes"]
        assert [o["ok"] for o in outs] == [True, True, False], outs
        assert outs[1]["delta"] and outs[1]["exact"]
        failed = outs[2]
        assert failed["error"] in ("RefitTimeout", "RefitAborted"), failed
        assert failed["weight_version"] == 2
        if g == 0:  # its trainer never sent the payload: nothing of v3 was applied
            assert not failed["torn"] and failed["intact"], failed
        else:  # it may have applied its own trainer's delta (then torn, as a full refit would be)
            assert failed["torn"] or failed["intact"], failed


@pytest.mark.timeout(120)
def test_incremental_check_lands_deltas_bit_exact_trusts_held_bytes_and_a_full_check_catches_them():
    # The rollouts check deltas incrementally (delta_verify="incremental"). v1 is full;
    # v2 a delta checked in full (the first after a full refit: nothing verified yet);
    # v3, v4 deltas checked incrementally. Rollout 0's live byte is flipped after its v3
    # commit, outside any refit, where v4's delta does not write: the incremental check
    # cannot see it (it trusts the bytes it verified at v3), so v4 commits on rollout 0
    # with that byte wrong. At v5 the rollouts ask for a full check: it catches the byte
    # (ProtocolError on rollout 0, torn; nobody commits v5). v6 is full (rollout 0 has
    # no base) and heals it; v7 is checked in full again, v8 incrementally.
    spec = DeltaSpec(fractions=[1.0, 0.003, 0.003, 0.003, 0.003, 0.003, 0.003, 0.004], corrupt=(0, 3),
                     options={"delta": True, "delta_verify": "incremental"},
                     receiver_options={5: {"delta_verify": "full"}})
    results = _world(spec)
    n_train = spec.train_par.world_size
    for r in results[:n_train]:
        assert [o["ok"] for o in r["outcomes"]] == [True] * 4 + [False] + [True] * 3, r["outcomes"]
    r0, r1 = results[n_train:]
    for g, r in enumerate((r0, r1)):
        outs = r["outcomes"]
        ok = [o for i, o in enumerate(outs) if i != 4]
        assert [o["version"] for o in ok] == [1, 2, 3, 4, 6, 7, 8]
        assert [o["delta"] for o in ok] == [False, True, True, True, False, True, True], [o["notes"] for o in ok]
        checked = [o["notes"][-1].rsplit("; checked ", 1)[-1] for o in ok if o["delta"]]
        assert checked == ["in full", "incrementally", "incrementally", "in full", "incrementally"], checked
        # bit-exact against the oracle, but for rollout 0's v4: the byte it cannot see
        assert [o["exact"] for o in ok] == [True, True, True, g != 0, True, True, True], ok
    assert r0["outcomes"][4]["error"] == "ProtocolError" and "checksum" in r0["outcomes"][4]["message"]
    assert r0["outcomes"][4]["torn"] and r0["outcomes"][4]["weight_version"] == 4
    assert r1["outcomes"][4]["error"] == "TransportError"
