#!/usr/bin/env bash
# One H200 call (< 4 min with the defaults): the fp8 kernel bench (--short: the library default, its
# neighbours and the grouped launch, bit-exact on the whole model, plus the refit's bf16 copies:
# copies first then kernel / kernel first / kernel with copy tiles), the qwen3-8b zmq colocated
# benchmark (fp8 vs bf16 vs bf16-then-quantize, with the rollout's per-phase host timeline), then
# the fp8 GPU tests (every kernel variant + copy tiles vs the oracle, quantize-while-pack, zmq over
# CUDA IPC with the copies in the launch).
# Usage (from the repository root, wheels for pyzmq/msgspec in .whl/): bash benchmarks/run_fp8_h200.sh OUTDIR
# SWEEP=1: the full kernel sweep instead of --short (~65 s more); VARIANTS='name;name': those variants
# only. KERNEL=<variant>: the zmq bench runs that variant instead of the kernel bench's best_with_copies.
# REFITS (5 per round), ROUNDS (3 interleaved bf16/fp8 rounds), PRESET (qwen3-8b).
set -u
OUT=${1:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [ "${SWEEP:-0}" = 1 ]; then KARGS=(--budget-s 65); KT=130
elif [ -n "${VARIANTS:-}" ]; then KARGS=(--variants "$VARIANTS" --budget-s 60); KT=120
else KARGS=(--short --budget-s 35); KT=90; fi
timeout $KT python3 benchmarks/bench_fp8_kernel.py "${KARGS[@]}" --json "$OUT/fp8_kernel_h200.json" > "$OUT/fp8_kernel_h200.log" 2>&1
echo "kernel bench rc=$? (t=${SECONDS}s)"
# per variant: ms and exactness (kernel alone); then the copies rows; errors: their last 4 lines
python3 - "$OUT/fp8_kernel_h200.json" <<'PY' || tail -30 "$OUT/fp8_kernel_h200.log"
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in sorted(d["quantize_ms"].items(), key=lambda kv: kv[1]):
    print(k, v, "ms", "exact" if d["bit_exact"].get(k) else "NOT EXACT")
print(json.dumps({k: d.get(k) for k in ("flat_copy_s", "kernel_at_flat_copy_rate_s", "best", "best_quantize_s",
                                        "best_quantize_gbps", "flat_copy_gbps", "launches", "all_exact", "skipped",
                                        "best_with_copies", "wall_s")}))
ov = d.get("with_bf16_copies") or {}
ms = lambda v: round(v * 1e3, 3)  # noqa: E731
print(json.dumps({"variant": ov.get("variant"), "copies": ov.get("copies"), "bytes": ov.get("bytes"),
                  "copies alone ms": ms(ov["copies_s"]) if "copies_s" in ov else None,
                  "kernel alone ms": ms(ov["kernel_s"]) if "kernel_s" in ov else None,
                  "copies first then kernel ms": ms(ov["copies_first_s"]) if "copies_first_s" in ov else None,
                  "kernel first then copies ms": ms(ov["kernel_first_s"]) if "kernel_first_s" in ov else None,
                  "kernel with copy tiles (copies + quantize in one launch) ms":
                      {k: ms(v) for k, v in ov.get("with_copy_tiles_s", {}).items()},
                  "copy tiles exact": ov.get("copy_tiles_exact"), "copy tiles": ov.get("copy_tiles")}, indent=1))
for k, v in d.get("errors", {}).items():
    print("ERROR", k, "|", " / ".join(v.splitlines()[-4:]))
PY
BEST=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d.get("best_with_copies") or d.get("best", ""))' "$OUT/fp8_kernel_h200.json" 2>/dev/null)
[ -n "${BEST:-}" ] || echo "kernel bench has no best variant: the zmq bench runs the library default kernel"
# KERNEL (the caller's), else the kernel bench's best with copies, else empty: the library default
KERNEL=${KERNEL:-${BEST:-}}
echo "zmq bench kernel: ${KERNEL:-library default}"
timeout 150 python3 benchmarks/bench_fp8_zmq.py --preset "${PRESET:-qwen3-8b}" --device cuda --refits "${REFITS:-5}" \
  --rounds "${ROUNDS:-3}" --kernel "${KERNEL:-}" \
  --json "$OUT/fp8_zmq_h200.json" > "$OUT/fp8_zmq_h200.log" 2>&1
echo "bench rc=$? (t=${SECONDS}s)"
python3 - "$OUT/fp8_zmq_h200.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001 - a report line, not control flow
    print("no bench json:", e); sys.exit(0)
print(json.dumps({k: d.get(k) for k in ("kernel", "bytes", "seconds", "trainer_seconds", "fp8_over_bf16",
                                        "fp8_over_bf16_spread", "pooled", "per_round", "then_quantize_over_fp8", "then_quantize_torch_over_fp8", "bit_exact", "rollout_phases_ms",
                                        "first_refit_notes")}, indent=1))
PY
tail -5 "$OUT/fp8_zmq_h200.log"
timeout 85 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_fp8_gpu.py 2>&1 | tee "$OUT/fp8_gpu_tests.log" | tail -25
echo "total ${SECONDS}s"
