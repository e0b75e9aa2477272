"""The README's HTTP recipe, run as written: ``examples/vllm_http_controller.py`` starts a
real vLLM OpenAI server with the "policyworker" backend, refits it over the four HTTP
routes from two trainer processes and compares its greedy tokens with HF transformers'."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vllm_http_controller.py"


@pytest.mark.timeout(400)
def test_http_controller_example_refits_a_vllm_server_like_hf(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=380,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("weight_version="))
    assert line.startswith("weight_version=1 ") and " == HF tokens " in line, line
