"""The vLLM recipe of docs/vllm.md runs as written: ``examples/vllm_recovery.py`` (whose
code the doc quotes, checked here block by block) refits a real vLLM engine from two
trainer processes, loses trainer 1 mid-refit, recovers (replacement, fresh ports, every
side re-joins) and commits the same version; greedy tokens equal HF's after every commit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vllm_recovery.py"
DOC = ROOT / "docs" / "vllm.md"


def test_the_docs_recipe_is_the_example_verbatim():
    code = EXAMPLE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    quoted = [b for b in blocks if "# from examples/vllm_recovery.py" in b]
    assert len(quoted) >= 2, "docs/vllm.md quotes the example's trainer and controller"
    for block in quoted:
        body = block.split("# from examples/vllm_recovery.py\n", 1)[1]
        assert body.strip() and body in code, body[:200]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_recovery_example_runs_as_written(tmp_path):
    pytest.importorskip("vllm")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--refits", "3", "--kill-at", "2"], capture_output=True,
                          text=True, timeout=380, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert any(x.startswith("refit 2: PeerLost") and "serving '1'" in x for x in lines), proc.stdout[-2000:]
    served = [x for x in lines if x.startswith("weight_version=")]
    assert served == [f"weight_version={v} vLLM tokens == HF tokens" for v in (1, 2, 3)], proc.stdout[-2000:]
