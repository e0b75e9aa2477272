"""``policyworker bench --engine vllm``, run as the README and RESULTS.md give it (fewer
refits): a real vLLM engine refitted by two trainer processes, ceiling and refit
interleaved, the checkpoint path measured in the same run, tokens checked against HF —
after the refits, on the kernels the background prepack installed (``cpu_linear="background"``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policyworker.errors import ConfigError
from policyworker.models.config import get_preset

pytest.importorskip("vllm")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.timeout(400)
def test_bench_engine_vllm_reports_interleaved_pairs_and_matches_hf(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "policyworker.cli", "bench", "--engine", "vllm", "--dtype", "float32",
                           "--refits", "3", "--vllm-executor", "uni", "--vllm-cpu-linear", "background",
                           "--json", str(out)], capture_output=True, text=True, timeout=380, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tokens_match_hf"] is True and res["checkpoint_tokens_match_hf"] is True
    assert (res["vllm_executor"], res["cpu_linear"]) == ("uni", "background")
    rows = res["refits"]
    assert [r["version"] for r in rows] == [1, 2, 3] and [r["cold"] for r in rows] == [True, False, False]
    # every refit has its own ceiling round, and the reported ratio is the steady pairs' median
    for r in rows:
        assert r["ceiling_seconds"] > 0 and r["ratio_to_ceiling"] == pytest.approx(r["ceiling_seconds"] / r["seconds"])
        # served through the plain path at commit, then every linear layer (vLLM's fused
        # qkv_proj, o_proj, gate_up_proj, down_proj per decoder layer) and both embeddings
        # (embed_tokens, lm_head) got vLLM's packed kernel back
        assert r["background_prepack_layers"] == [4 * get_preset("small").num_layers + 2], r
    steady = sorted(r["ratio_to_ceiling"] for r in rows[1:])
    assert res["ratio_to_ceiling"] == pytest.approx(sum(steady) / 2) and res["ratio_spread"]["pairs"] == 2
    assert res["bytes_per_refit"] > 0 and len(res["checkpoint_reload"]) == 3


# -- bench --engine vllm --overlap ----------------------------------------------------------
def test_bench_overlap_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    from policyworker.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    code = main(["bench", "--engine", "vllm", "--overlap", "--plot", str(tmp_path / "t.png")])
    assert code == 2 and "pip install 'policyworker[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


def test_longest_gap_counts_whole_gaps_that_overlap_the_window():
    from policyworker.cli.vllm_overlap_bench import longest_gap

    passes = [(0.0, 1.0), (1.5, 2.0), (2.2, 3.0), (10.0, 11.0), (11.1, 12.0)]
    assert longest_gap(passes, 2.5, 4.0) == (3.0, 10.0)     # runs past the window's end: whole
    assert longest_gap(passes, 1.2, 1.3) == (1.0, 1.5)      # began before it: whole
    assert longest_gap(passes, 11.5, 20.0) == (12.0, 20.0)  # still open: up to the end


@pytest.mark.timeout(300)
def test_bench_overlap_alternates_paths_and_checks_tokens_per_commit(tmp_path, monkeypatch):
    """A tiny Qwen3 in an AsyncLLM under load: one overlapped and one paused refit (after a cold one)."""
    from policyworker.cli.vllm_overlap_bench import longest_gap, run_vllm_overlap_bench

    from .vllm_engine import TINY_QWEN3, omp_bind

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", omp_bind(1))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    res = run_vllm_overlap_bench(qwen3=dict(TINY_QWEN3, num_key_value_heads=2), refits=1, streams=2, phase_s=0.3,
                                 max_tokens=32, timeout_s=60.0, bucket_bytes=64 << 10, log=lambda msg: None)
    rows = res["refits"]
    assert [(r["version"], r["mode"]) for r in rows] == [(2, "overlap"), (3, "paused")]
    assert res["cold_refit"]["mode"] == "paused" and res["tokens_match_hf"] is True
    assert all(r["tokens_match_hf"] and len(r["tokens"]) == 2 for r in [res["cold_refit"], *rows])
    assert res["bytes_per_refit"] == res["bytes_minimum"]
    over, paused = rows
    w = over["worker_phase_seconds"]  # the worker's clock, from the controller's start_weight_update call
    assert 0 < w["receive_start"] <= w["receive_end"] <= w["prepare_end"] <= w["swap_start"] <= w["swap_end"]
    upd = res["timelines"]["overlap"]["calls"]["update_weights"]
    assert upd[0] <= w["receive_start"] <= upd[1]  # update_weights returned with the receive in flight
    assert "worker_phase_seconds" not in paused and paused["ready_polls"] == 0
    tl = res["timelines"]["overlap"]
    assert tl["version"] == 2 and tl["calls"]["finish_weight_update"][0] <= w["swap_start"]
    # the swap ran between two engine steps, and the reported stall is the timeline's longest gap
    assert not any(s < w["swap_end"] and e > w["swap_start"] for s, e in tl["passes"])
    for mode, row in (("overlap", over), ("paused", paused)):
        passes = res["timelines"][mode]["passes"]
        a, b = longest_gap(passes, 0.0, row["refit_seconds"])
        assert b - a == pytest.approx(row["stall_seconds"]) and row["stall_seconds"] > 0
        assert row["tokens_per_second"]["before"] > 0 and row["tokens_per_second"]["after"] > 0
    assert res["summary"]["overlap"]["stall_ms_max"] == pytest.approx(1e3 * over["stall_seconds"])
    assert res["overlap_stall_goal_met"] == (res["summary"]["overlap"]["stall_ms_max"] <= 10.0)
    try:
        from policyworker.cli.overlap_plot import plot_timelines

        plot_timelines(res, str(tmp_path / "t.png"))
    except ConfigError as exc:  # no matplotlib here: the error names the extra
        assert "policyworker[plot]" in str(exc)
    else:
        assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
