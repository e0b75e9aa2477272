"""The README's main job, end to end, as a user runs it (smaller preset to keep CI fast)."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.timeout(300)  # the subprocess's own bound (240 s) fires first
def test_demo_refits_bit_exact_and_writes_json(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "policyworker.cli", "demo", "--preset", "tiny", "--refits", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["transport"] == "nccl_reshard"
    assert data["layouts"] == {"train": "tp=2,pp=2,dp=1,ep=1", "gen": "tp=2,pp=1,dp=2,ep=1"}
    assert data["bit_exact"] is True
    assert [r["version"] for r in data["refits"]] == [1, 2, 3]
    assert all(r["seconds"] > 0 and r["bytes"] > 0 for r in data["refits"])
    assert data["ceiling_gbps"] > 0 and data["gbps_median"] > 0
    # Interleaved pairs: the steady figure is the median of per-pair ratios (v2, v3), the
    # cold first refit apart.
    spread = data["ratio_spread"]
    assert spread["pairs"] == data["steady_refits"] == 2
    assert spread["min"] <= data["ratio_to_ceiling"] <= spread["max"]
    steady = [r["ratio_to_ceiling"] for r in data["details"]["refits"][1:]]
    assert data["ratio_to_ceiling"] == pytest.approx(sum(steady) / 2)
    assert data["cold_refit"]["version"] == 1 and data["details"]["refits"][0]["cold"] is True
    assert len(data["details"]["ceiling_seconds"]) == 3 * 3   # 3 ceiling rounds before each refit
    details = data["details"]
    assert details["bytes_over_min"] == 1.0  # each rollout received exactly its shard's bytes
    assert details["committed_versions"] == [3, 3, 3, 3]
    assert "refit v3" in proc.stdout and "ceiling" in proc.stdout


@pytest.mark.timeout(300)
def test_bench_prints_json():
    proc = subprocess.run(
        [sys.executable, "-m", "policyworker.cli", "bench", "--transport", "nccl_reshard", "--preset", "tiny",
         "--train", "tp=2", "--gen", "tp=1", "--refits", "2"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["bit_exact"] is True and len(data["refits"]) == 2
    assert data["ring_bytes_per_process"] <= data["bucket_x_staging"] + 8 * data["staging"]


@pytest.mark.timeout(300)
def test_zmq_bench_interleaves_ceiling_and_refit(tmp_path):
    out = tmp_path / "zmq.json"
    proc = subprocess.run(
        [sys.executable, "-m", "policyworker.cli", "bench", "--transport", "zmq", "--device", "cpu",
         "--preset", "tiny", "--refits", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bit_exact"] is True and len(data["refits"]) == 3
    # One ceiling per measured refit (the cold first refit has its own, reported apart).
    assert len(data["ceiling_seconds"]) == 3 and data["ratio_spread"]["pairs"] == 3
    assert data["ratio_spread"]["min"] <= data["ratio_to_ceiling"] <= data["ratio_spread"]["max"]
    assert data["cold_refit"]["seconds"] == data["first_refit_s"]
    assert data["loop_lag_ticks"] > 0
    assert data["loop_lag_ms_p50"] <= data["loop_lag_ms_p99"]
    # tp=1 with flatten: the refit is only its copy runs, so the ceiling is those runs
    # between the refit's own buffers; the private-buffer copy is reported beside it.
    assert data["ceiling_kind"] == "own"
    assert len(data["private_ceiling_seconds"]) == 3 and data["private_ceiling_gbps"] > 0
    # The NeMo-protocol baseline ships with the command and runs in the same processes.
    assert data["baseline_bit_exact"] is True and len(data["baseline_refits"]) == 3
    assert data["speedup_vs_baseline"] > 0
