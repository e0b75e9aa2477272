"""The fp8 zmq benchmark runs end to end on CPU (tiny preset, two interleaved rounds):
every mode's bytes land bit exact and every round yields its ratios (issue 16's
benchmark; its figures come from the H200, benchmarks/RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_fp8_zmq_bench_runs_interleaved_rounds_bit_exact(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the spawned ranks import the bench module by name
    import bench_fp8_zmq

    res = bench_fp8_zmq.run("tiny", "cpu", refits=2, timeout_s=60.0, rounds=2)
    assert res["bit_exact"] == {"bf16": True, "fp8": True, "bf16_then_quantize": True,
                                "bf16_then_quantize_torch": True}, res["bit_exact"]
    assert len(res["per_round"]) == 2 and res["fp8_over_bf16_spread"]["pairs"] == 2
    # 2 timed refits per mode per round (the two warm-ups after each switch are dropped)
    assert all(len(v) == 4 for v in res["all_rollout_seconds"].values()), res["all_rollout_seconds"]
    assert all(r["fp8"] > 0 and r["bf16"] > 0 for r in res["per_round"])
    assert res["bytes"]["fp8"] < res["bytes"]["bf16"]  # fp8 + scales are fewer bytes than the bf16 they replace
