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


def test_worker_steps_run_from_execute_model_to_sample_tokens_and_the_stall_is_between_them(monkeypatch):
    """A step is ``execute_model`` through the ``sample_tokens`` after it (a step that samples
    nothing ends with ``execute_model``); the idle gaps are between steps, not passes."""
    import policyworker.integrations.vllm.steps as steps_mod
    from policyworker.cli.vllm_overlap_bench import gaps_between, longest_gap
    from policyworker.integrations.vllm.steps import WorkerSteps

    clock = [0.0]
    monkeypatch.setattr(steps_mod.time, "monotonic", lambda: clock[0])

    class Worker:  # vLLM's two step calls; each advances the clock by its own length
        def execute_model(self, seconds: float) -> str:
            clock[0] += seconds
            return "executed"

        def sample_tokens(self, seconds: float) -> str:
            clock[0] += seconds
            return "sampled"

    worker = Worker()
    recorder = WorkerSteps.of(worker)
    assert WorkerSteps.of(worker) is recorder  # installed once
    for execute, sample, idle in ((1.0, 0.5, 0.25), (1.0, 0.5, 3.0), (2.0, None, 0.5), (1.0, 0.5, 0.0)):
        assert worker.execute_model(execute) == "executed"
        if sample is not None:
            assert worker.sample_tokens(sample) == "sampled"
        clock[0] += idle
    steps = recorder.times()
    assert steps == [(0.0, 1.5), (1.75, 3.25), (6.25, 8.25), (8.75, 10.25)]
    assert recorder.times(since=6.0) == steps[2:]
    assert gaps_between(steps, 0.0, 20.0) == [0.25, 3.0, 0.5]
    assert gaps_between(steps, 1.0, 7.0) == [0.25, 3.0]  # only gaps inside the phase
    assert longest_gap(steps, 2.0, 9.0) == (3.25, 6.25)
