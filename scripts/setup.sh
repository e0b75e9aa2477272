#!/usr/bin/env bash
# Make .venv (once) and install policyworker into it with its test extras, and the
# out-of-tree transport plugin transports/policyworker-files.
# torch: keep one that is already importable; otherwise pin the CPU build 2.13.0
# (an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch==2.13.0 (CPU build)"
    "$VPY" -m pip install -q torch==2.13.0
fi
"$VPY" -m pip install -q -e ".[test]"
# The out-of-tree plugin, installed from its own directory as a user installs one;
# its tests (in the testpaths) drive it by its entry-point name.
"$VPY" -m pip install -q -e transports/policyworker-files
echo "setup: ok ($("$VPY" -c 'import torch, policyworker; import policyworker_files; print("torch", torch.__version__, "policyworker", policyworker.__version__, "policyworker-files", policyworker_files.__version__)'))"
