#!/usr/bin/env bash
# One H200 call: GPU tests for fp8 (kernel vs oracle, GPU quantize-while-pack, zmq over
# CUDA IPC) then the qwen3-8b zmq colocated benchmark (fp8 vs bf16 vs bf16-then-quantize).
# Usage (from the repository root, wheels for pyzmq/msgspec in .whl/): bash benchmarks/run_fp8_h200.sh OUTDIR
set -u
OUT=${1:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed; using src/"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout 80 python3 benchmarks/bench_fp8_kernel.py --json "$OUT/fp8_kernel_h200.json" > "$OUT/fp8_kernel_h200.log" 2>&1
KERNEL=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["best"])' "$OUT/fp8_kernel_h200.json" 2>/dev/null)
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [print(k, round(v*1e3,3), "ms") for k,v in d["quantize_s"].items()]; print({k: d[k] for k in ("flat_copy_s","best","best_quantize_s","best_quantize_gbps","flat_copy_gbps","bit_exact")})' "$OUT/fp8_kernel_h200.json" || tail -20 "$OUT/fp8_kernel_h200.log"
timeout 85 python3 benchmarks/bench_fp8_zmq.py --preset "${PRESET:-qwen3-8b}" --device cuda --refits "${REFITS:-7}" --kernel "${KERNEL:-}" \
  --json "$OUT/fp8_zmq_h200.json" > "$OUT/fp8_zmq_h200.log" 2>&1
echo "bench rc=$?"
python3 - "$OUT/fp8_zmq_h200.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001 - a report line, not control flow
    print("no bench json:", e); sys.exit(0)
print(json.dumps({k: d[k] for k in ("kernel", "bytes", "seconds", "trainer_seconds", "fp8_over_bf16", "then_quantize_over_fp8", "bit_exact")}, indent=1))
PY
tail -5 "$OUT/fp8_zmq_h200.log"
timeout 75 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_fp8_gpu.py 2>&1 | tee "$OUT/fp8_gpu_tests.log" | tail -25
