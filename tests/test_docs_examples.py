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


# -- every Python block of the docs -------------------------------------------------------
# The complete programs are examples/*.py, each run by a test (quickstart above; the Ray,
# vLLM HTTP and vLLM recovery examples by their own modules). The docs' other blocks are
# fragments of a controller (they need processes, an engine, a model); each is checked here:
# it parses (top-level await allowed), every name it imports from policyworker exists, it
# uses no deprecated setup spelling, and a block headed "# from examples/<file>" is that
# file's lines, in order.

_DEPRECATED = re.compile(r"PolicyWorker\([^)]*\b(transport|reshard)_options\s*=|"
                         r"\.(reshard|zmq|sglang|transport)_options\s*=|set_transport_options\(")


def _blocks() -> list[tuple[str, str]]:
    out = []
    for path in sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            out.append((f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 2}", m.group(1)))
    return out


_BLOCKS = _blocks()


def test_the_docs_have_python_blocks():
    assert len(_BLOCKS) >= 20, [where for where, _ in _BLOCKS]


@pytest.mark.parametrize("where,code", _BLOCKS, ids=[where for where, _ in _BLOCKS])
def test_docs_block_parses_imports_exist_and_uses_one_setup_spelling(where, code):
    import ast
    import importlib

    tree = compile(code, where, "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "policyworker":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "policyworker":
                    importlib.import_module(alias.name)
    assert not _DEPRECATED.search(code), f"{where}: a deprecated setup spelling; use attach_transport(name, **setup)"
    head = code.splitlines()[0]
    if head.startswith("# from examples/"):
        source = (ROOT / head.removeprefix("# from ").strip()).read_text(encoding="utf-8").splitlines()
        at = 0
        for line in code.splitlines()[1:]:
            if not line.strip() or line.strip() == "...":
                continue
            try:
                at = source.index(line, at) + 1
            except ValueError:
                raise AssertionError(f"{where}: {line.strip()!r} is not in {head[7:]} (in this order)") from None
