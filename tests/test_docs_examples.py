"""The README's complete example is examples/quickstart.py, and it runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_is_the_quickstart_file():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## A complete example.*?```python\n(.*?)```", readme, re.S).group(1)
    source = (ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8")
    body = source.split('"""', 2)[2].lstrip("\n").split('\nif __name__ == "__main__":')[0].rstrip()
    assert block.rstrip() == body + "\n\n\nasyncio.run(main())"


@pytest.mark.timeout(180)
def test_quickstart_runs_as_written(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                          text=True, timeout=150, cwd=tmp_path, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2", "step 3"]
    assert all(line.endswith("bit-exact=True") for line in lines)
    assert [line.split(", ")[0].split(": ")[1] for line in lines] == ["v1", "v2", "v3"]
