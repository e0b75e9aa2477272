"""nccl_reshard end to end: real processes, real gloo, bit-exact weights."""

from __future__ import annotations

import pytest

from policyworker.runtime.procs import free_port, run_world

from .refit_world import RefitSpec, kv_scales, refit_rank

pytestmark = pytest.mark.multiprocess


def _world(spec: RefitSpec) -> list[dict]:
    spec.update_port = free_port()
    spec.stage_ports = [free_port() for _ in range(spec.train_par.pp)]
    spec.train_port = free_port()
    n = spec.train_par.world_size + spec.gen_par.world_size
    # Below the per-test timeout (120 s), so that an overrunning world is reported by
    # the harness — which ranks, and their stacks — rather than killed by pytest blind.
    return run_world(refit_rank, n, (spec,), timeout_s=105)


def _run_ok(preset, train, gen, **kw):
    spec = RefitSpec(preset=preset, train=train, gen=gen, **kw)
    results = _world(spec)
    n_train = spec.train_par.world_size
    assert len({r["hash"] for r in results}) == 1  # every rank holds the same plan
    for r in results[:n_train]:
        assert [o["ok"] for o in r["outcomes"]] == [True] * spec.refits, r["outcomes"]
    for r in results[n_train:]:
        outs = r["outcomes"]
        assert [o.get("exact") for o in outs] == [True] * spec.refits, outs
        assert [o["version"] for o in outs] == list(range(1, spec.refits + 1))
        assert r["weight_version"] == spec.refits
        assert all(o["bytes"] == r["recv_expected"] for o in outs)  # exactly its shard's bytes
        assert [o["kv_scales"] for o in outs] == [kv_scales(spec, v) for v in range(1, spec.refits + 1)]
        assert [o["report_kv_scales"] for o in outs] == [o["kv_scales"] for o in outs]  # the report carries them
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
    _run_ok("tiny", train, gen)


def test_kv_scales_past_the_verdicts_inline_bytes_arrive_as_their_own_message():
    # 300 scales: ~12 KB of msgpack, more than the answer carries inline (4 KiB)
    _run_ok("tiny", "tp=2", "tp=2", kv_scales_entries=300)


def test_small_buckets_many_in_flight_and_checksums():
    _run_ok("tiny", "tp=2", "tp=2", options={"bucket_bytes": 4096, "in_flight": 3, "checksum": True})


def test_rows_wider_than_a_bucket_are_cut_and_staging_stays_bounded():
    # down_proj rows are 512 float32 = 2 KiB, the bucket 1 KiB: rows are cut inside
    results = _run_ok("tiny", "tp=1", "tp=2", overrides={"intermediate_size": 1024},
                      options={"bucket_bytes": 1024, "in_flight": 4, "staging": 2})
    assert all(o["peak_extra_bytes"] == 2 * 1024 for r in results for o in r["outcomes"])


def test_moe_with_expert_parallel():
    _run_ok("tiny-moe", "tp=1,dp=2,ep=2", "tp=2")


def test_fsdp_dtensor_shards_with_uneven_vocab_to_tp2():
    # vocab 255 over dp=2 (Shard(0)): 128 + 127 rows; over gen tp=2: 128 + 127 again.
    _run_ok("tiny", "dp=2", "tp=2", source="dtensor", vocab_size=255, dtype="bfloat16")


def test_a_rollout_that_misses_bytes_does_not_commit():
    spec = RefitSpec(preset="tiny", train="tp=2", gen="tp=1", refits=2, refit_timeout_s=4.0, options={"bucket_bytes": 8192},
                     fault={"version": 2, "kind": "drop_last_bucket"})
    results = _world(spec)
    trainer0, rollout = results[0], results[2]
    assert trainer0["outcomes"][0]["ok"] and not trainer0["outcomes"][1]["ok"]
    assert rollout["outcomes"][0] == {**rollout["outcomes"][0], "ok": True, "exact": True, "version": 1}
    failed = rollout["outcomes"][1]
    assert failed["ok"] is False and failed["error"] in {"RefitTimeout", "RefitAborted"}
    assert failed["weight_version"] == 1  # never advanced
    assert failed["torn"] is True  # bytes of v2 had landed in place
    assert rollout["serves_after_failure"] == "TornWeights"


def test_a_corrupted_bucket_is_caught_and_not_committed():
    spec = RefitSpec(preset="tiny", train="tp=2", gen="tp=1", refits=2,
                     options={"checksum": True}, fault={"version": 2, "kind": "flip_byte"})
    results = _world(spec)
    for trainer in results[:2]:
        assert trainer["outcomes"][1]["ok"] is False and trainer["outcomes"][1]["error"] == "TransportError"
    failed = results[2]["outcomes"][1]
    assert failed["error"] == "ProtocolError" and failed["weight_version"] == 1
    assert results[2]["serves_after_failure"] in (True, "TornWeights")


# -- destinations made on demand (TransportContext.landing) ----------------------------------
_SMALL_WINDOW = {"bucket_bytes": 4096, "in_flight": 2}


def test_destinations_made_on_demand_land_bit_exact_and_are_handed_over_once_each():
    # Every other destination is a meta placeholder: opened just before its first message,
    # handed over after its last; so with a small window few are open at once.
    results = _run_ok("tiny", "tp=2", "tp=1", options=_SMALL_WINDOW, landing={})
    landing = results[-1]["landing"]
    for v in (1, 2):
        calls = [(kind, name) for ver, kind, name in landing["calls"] if ver == v]
        assert sorted(n for k, n in calls if k == "landed") == landing["names"]  # every destination, once
        opened = [n for k, n in calls if k == "open"]
        assert sorted(opened) == landing["placeholders"]  # every placeholder, once
        assert all(calls.index(("open", n)) < calls.index(("landed", n)) for n in opened)
    # within the ring's bytes (2 x 4 KiB), plus the tensors a message opens beyond it
    assert 0 < landing["peak"] <= 2 * 4096 + 2 * landing["largest"] < landing["placeholder_bytes"], landing


def test_a_landing_that_fails_fails_the_refit_typed_on_every_rank_and_the_next_commits():
    # Refit 2: the consumer cannot open its third destination; refit 3: it fails to take over
    # the first landed one (a consumer may have installed it live: torn); refit 4 commits.
    spec = RefitSpec(preset="tiny", train="tp=2", gen="tp=1", refits=4, go_on_after_failure=True,
                     options=_SMALL_WINDOW, landing={"fail": {2: "open", 3: "landed"}})
    results = _world(spec)
    for r in results[:2]:  # the trainers learn it in the verdict round
        assert [o["ok"] for o in r["outcomes"]] == [True, False, False, True], r["outcomes"]
        assert [o.get("error") for o in r["outcomes"][1:3]] == ["TransportError"] * 2, r["outcomes"]
    (rollout,) = results[2:]
    outs = rollout["outcomes"]
    for index, fail, says in ((2, "open", "could not open a destination for"),
                              (3, "landed", "could not take over the landed")):
        out = outs[index - 1]
        assert out["ok"] is False and out["error"] == "TransportError" and says in out["message"], out
        assert out["weight_version"] == 1  # nothing committed
        calls = [(kind, name) for ver, kind, name in rollout["landing"]["calls"] if ver == index]
        failing = [i for i, c in enumerate(calls) if c[0] == fail][-1 if fail == "open" else 0]
        assert not [c for c in calls[failing + 1:] if c[0] == "landed"]  # nothing handed over after it
    assert outs[2]["torn"] is True  # torn until a full refit
    assert outs[3]["ok"] and outs[3]["exact"] and outs[3]["version"] == 2, outs[3]  # the failed version, again
    assert rollout["weight_version"] == 2
