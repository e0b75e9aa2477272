#!/usr/bin/env bash
# One H200 call: sglang_ipc GPU tests, then the qwen3-8b refit into the in-process engine
# (tp=1 on the trainer's GPU): 1 GiB buckets with 2 and 1 buffers, 256 MiB buckets, a flat
# rollout arena (one load copy per bucket), the engine answering after its copies finished
# (--answer-finished: SGLang's behaviour, a host wait per bucket), and zmq in the first run.
# Each run reports its same-run flat device-to-device copy ("ceiling") and per-step host spans.
# Usage (from the repository root, wheels for pyzmq/msgspec in .whl/): bash benchmarks/run_sglang_h200.sh OUTDIR
set -u
OUT=${1:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
python3 -c 'import torch; print("torch", torch.__version__)'
timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rA tests/test_sglang_gpu.py 2>&1 | tee "$OUT/sglang_gpu_tests.log" | tail -8
P=${PRESET:-qwen3-8b}; R=${REFITS:-8}
bench() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi  # ONLY="a b": just those runs
  timeout "$limit" python3 benchmarks/bench_sglang_vs_zmq.py --device cuda --preset "$P" --refits "$R" "$@" \
    --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"
  python3 - "$OUT/$name.json" <<'PY' || tail -15 "$OUT/$name.log"
import json, statistics, sys
d = json.load(open(sys.argv[1]))
s = d["sglang_ipc"]
n = s["buckets"]
ms = lambda v: round(v * 1e3, 3)
print(json.dumps({
    "buffers": s["buffers"], "bucket_bytes": s["bucket_bytes"], "buckets": n, "flat_rollout": s.get("flat_rollout"),
    "answer_queued": s.get("answer_queued"),
    "median_refit_ms": ms(statistics.median(s["refits_s"])), "first_refit_ms": ms(s["first_refit_s"]),
    "ceiling_ms": ms(statistics.median(s["ceiling_s"])), "ratio_to_ceiling": round(s["ratio_to_ceiling"], 3),
    "gbps": round(s["gbps_median"], 1), "bit_exact": s["bit_exact"], "peak_extra_bytes": s["peak_extra_bytes"],
    "host_ms_per_refit": {k: ms(v) for k, v in s.get("spans_median_s", {}).items()},
    "engine_ms_per_refit": {k: ms(v) for k, v in s.get("engine_spans_median_s", {}).items()},
}))
if "zmq" in d:
    z = d["zmq"]
    print(json.dumps({"zmq": {k: z.get(k) for k in ("gbps_median", "ceiling_gbps", "ratio_to_ceiling", "bit_exact")},
                      "sglang_ratio_over_zmq_ratio": d.get("sglang_ratio_over_zmq_ratio")}))
PY
}
bench sg_b2_1g 100 --buffers 2
bench sg_b1_1g 50 --buffers 1 --no-zmq
bench sg_b2_256m 50 --buffers 2 --bucket-bytes 268435456 --no-zmq
bench sg_b2_1g_flat 50 --buffers 2 --flat-rollout --no-zmq
bench sg_b2_1g_finished 50 --buffers 2 --answer-finished --no-zmq
