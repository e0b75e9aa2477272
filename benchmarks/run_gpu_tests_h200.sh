#!/usr/bin/env bash
# One H200 call: every GPU test of the suite (one GPU: nccl_reshard's and the NCCL
# groups' one-GPU tests, zmq over CUDA IPC, FP8 kernels and refits, sglang_ipc, delta kernels).
# Usage (from the repository root, wheels for pyzmq/msgspec in .whl/): bash benchmarks/run_gpu_tests_h200.sh OUTDIR
set -u
OUT=${1:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
timeout 540 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rA -m gpu --timeout 240 \
  --junitxml="$OUT/gpu_tests.xml" tests/test_nccl_reshard_gpu.py tests/test_comm_gpu.py tests/test_zmq_gpu.py \
  tests/test_fp8_gpu.py tests/test_sglang_gpu.py tests/test_delta_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -60
echo "pytest rc=${PIPESTATUS[0]}"
