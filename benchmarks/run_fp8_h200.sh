#!/usr/bin/env bash
# One H200 call (< 5 min): the fp8 kernel sweep (every variant, bit-exact on the whole model),
# the qwen3-8b zmq colocated benchmark with the best variant (fp8 vs bf16 vs bf16-then-quantize),
# then the fp8 GPU tests (every kernel variant vs the oracle, quantize-while-pack, zmq over CUDA IPC).
# Usage (from the repository root, wheels for pyzmq/msgspec in .whl/): bash benchmarks/run_fp8_h200.sh OUTDIR
# KERNEL=<variant> skips the sweep's choice; SWEEP=0 skips the sweep.
set -u
OUT=${1:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [ "${SWEEP:-1}" = 1 ]; then
  timeout 100 python3 benchmarks/bench_fp8_kernel.py --budget-s 65 --json "$OUT/fp8_kernel_h200.json" > "$OUT/fp8_kernel_h200.log" 2>&1
  echo "kernel sweep rc=$? (t=${SECONDS}s)"
  # per variant: ms and exactness; errors: their last 4 lines here, the last 20 (plus stderr's) in the JSON
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [print(k, v, "ms", "exact" if d["bit_exact"].get(k) else "NOT EXACT") for k,v in sorted(d["quantize_ms"].items(), key=lambda kv: kv[1])]; print(json.dumps({k: d.get(k) for k in ("flat_copy_s","kernel_at_flat_copy_rate_s","best","best_quantize_s","best_quantize_gbps","flat_copy_gbps","best_tile","best_tile_s","with_bf16_copies","all_exact","skipped","wall_s")})); [print("ERROR", k, "|", " / ".join(v.splitlines()[-4:])) for k, v in d.get("errors", {}).items()]' "$OUT/fp8_kernel_h200.json" || tail -30 "$OUT/fp8_kernel_h200.log"
  BEST=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("best", ""))' "$OUT/fp8_kernel_h200.json" 2>/dev/null)
  [ -n "${BEST:-}" ] || echo "sweep has no best variant: the zmq bench runs the library default kernel"
fi
# KERNEL (the caller's), else the sweep's best, else empty: the library default (fp8_triton's settings)
KERNEL=${KERNEL:-${BEST:-}}
echo "zmq bench kernel: ${KERNEL:-library default}"
timeout 85 python3 benchmarks/bench_fp8_zmq.py --preset "${PRESET:-qwen3-8b}" --device cuda --refits "${REFITS:-7}" --kernel "${KERNEL:-}" \
  --json "$OUT/fp8_zmq_h200.json" > "$OUT/fp8_zmq_h200.log" 2>&1
echo "bench rc=$? (t=${SECONDS}s)"
python3 - "$OUT/fp8_zmq_h200.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001 - a report line, not control flow
    print("no bench json:", e); sys.exit(0)
print(json.dumps({k: d[k] for k in ("kernel", "bytes", "seconds", "trainer_seconds", "fp8_over_bf16", "then_quantize_over_fp8", "bit_exact")}, indent=1))
PY
tail -5 "$OUT/fp8_zmq_h200.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_fp8_gpu.py 2>&1 | tee "$OUT/fp8_gpu_tests.log" | tail -25
echo "total ${SECONDS}s"
