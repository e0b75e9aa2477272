#!/usr/bin/env bash
# One H200 call (~3-9 min; the timeouts sum to 570 s): the delta GPU tests (every kernel form and
# finish, the tiles finish included, against the torch and numpy paths, bit for bit), then
# bench_delta_encode.py on a 2 GiB bf16 stream: each changed fraction with the encoding step by step
# (scan; prefix: the tiles' starts and totals; sync: the one read to the host; [glue: torch's header,
# torch finish only]; gather; CUDA events), the torch and tiles finishes interleaved, and the sweep of
# tile sizes / warps / kernel forms / finishes (device, torch, tiles) at SWEEP_FRACTIONS, each row
# checked bit for bit before it is timed, the fastest named; then the fused scan's sweep in a process
# of its own (its look-back waits on other programs: a fault there cannot take the other results with it).
# Usage (from the repository root, wheels for pyzmq/msgspec in .whl/):
# bash benchmarks/run_delta_h200.sh OUTDIR
# GIB (2), REPS (5), SWEEP_FRACTIONS (0.03), FUSED_FRACTIONS (0.03,0.001).
set -u
OUT=${1:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rA -m gpu --timeout 120 tests/test_delta_gpu.py \
  > "$OUT/delta_gpu_tests.log" 2>&1
echo "gpu tests rc=$? (t=${SECONDS}s)"; tail -3 "$OUT/delta_gpu_tests.log"
timeout 300 python3 benchmarks/bench_delta_encode.py --gib "${GIB:-2}" --reps "${REPS:-5}" --sweep \
  --sweep-fractions "${SWEEP_FRACTIONS:-0.03}" --sweep-finishes device,torch,tiles \
  --json "$OUT/delta_encode_kernels_h200.json" 2>&1 | tee "$OUT/delta_encode_kernels_h200.log"
echo "bench rc=${PIPESTATUS[0]} (t=${SECONDS}s)"
timeout 100 python3 benchmarks/bench_delta_encode.py --gib "${GIB:-2}" --reps "${REPS:-5}" --fractions 0.01,0.03 \
  --sweep --sweep-fractions "${FUSED_FRACTIONS:-0.03,0.001}" --sweep-finishes fused \
  --json "$OUT/delta_encode_fused_h200.json" 2>&1 | tee "$OUT/delta_encode_fused_h200.log"
echo "fused bench rc=${PIPESTATUS[0]} (t=${SECONDS}s)"
