"""The README's HTTP recipe, run as written: ``examples/vllm_http_controller.py`` starts a
real vLLM OpenAI server with the "policyworker" backend, refits it over the four HTTP
routes from two trainer processes with ``overlap`` while a client keeps requesting
completions, and compares every answer with HF transformers' greedy tokens of its version
(before and during the receive: version 0; submitted after the commit: version 1). Then a
trainer is killed in the middle of version 2's overlapped transfer: ``finish_weight_update``
fails with ``PeerLost`` (read back from vLLM's error body) while the server keeps answering
with version 1's tokens, and after the documented recovery version 2 commits (HF's tokens)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vllm_http_controller.py"


@pytest.mark.timeout(440)
def test_http_controller_example_refits_a_vllm_server_like_hf(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=420,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    for phase, version in (("before", 0), ("during", 0), ("after", 1), ("failure", 1), ("recovered", 2)):
        line = next(x for x in lines if x.startswith(f"{phase}: "))
        assert f"tokens == HF version {version}" in line and not line.startswith(f"{phase}: 0 "), line
    line = next(x for x in lines if x.startswith("failed refit of version 2: "))
    assert "raised PeerLost (trainer 1 exit code -9); weight_version=1" in line, line
    assert line.endswith("then update_weights raised ConfigError (closes the session)"), line
    line = next(x for x in lines if x.startswith("weight_version="))
    assert line.startswith("weight_version=2 committed at engine step ") and line.endswith(": OK"), line
