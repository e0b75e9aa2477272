"""The README's HTTP recipe, run as written: ``examples/vllm_http_controller.py`` starts a
real vLLM OpenAI server with the "policyworker" backend, refits it over the four HTTP
routes from two trainer processes with ``overlap`` while a client keeps requesting
completions, and compares every answer with HF transformers' greedy tokens of its version
(before and during the receive: version 0; submitted after the commit: version 1)."""

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
    lines = proc.stdout.splitlines()
    for phase, version in (("before", 0), ("during", 0), ("after", 1)):
        line = next(x for x in lines if x.startswith(f"{phase}: "))
        assert f"tokens == HF version {version}" in line and not line.startswith(f"{phase}: 0 "), line
    line = next(x for x in lines if x.startswith("weight_version="))
    assert line.startswith("weight_version=1 committed at engine step ") and line.endswith(": OK"), line
