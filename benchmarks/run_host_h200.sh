#!/usr/bin/env bash
# One H200 call (~3 min, at most 5.2): the zmq refit's host path on the GPU.
# 1. How late the transport's GPU wait (zmq_program._sync) sees the end of a ~5 ms kernel on its
#    stream: polls every 10 us for the first 20 ms (the policy now) vs every 0.2 ms (the one
#    before) vs a spin (sleep(0) between polls), interleaved in one run; each against the same
#    kernel waited for by torch.cuda.synchronize() (the floor). JSON: median ms late per policy.
# 2. The zmq GPU tests (CUDA IPC refits; the event wait: abortable, and bounded by its deadline).
# 3. bench_fp8_zmq.py on qwen3-8b: the rollout's per-phase host timeline (rollout_phases_ms).
# Usage (from the repository root, wheels for pyzmq/msgspec in .whl/): bash benchmarks/run_host_h200.sh OUTDIR
# REFITS (5 per round), ROUNDS (3), PRESET (qwen3-8b).
set -u
OUT=${1:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
timeout 60 python3 - "$OUT/gpu_wait_h200.json" <<'PY'
import json, statistics, sys, time

import torch

from policyworker.transports.zmq import program as z

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
torch.cuda._sleep(10**7)
end.record()
torch.cuda.synchronize()
cycles = int(10**7 * 5.0 / start.elapsed_time(end))  # ~5 ms of GPU time
# (name, _FAST_POLL_S, _FAST_SLEEP_S): the policy now, the one before, and a true spin
policies = [("fast_polls_10us", z._FAST_POLL_S, z._FAST_SLEEP_S), ("polls_0.2ms", 0.0, z._FAST_SLEEP_S),
            ("spin_sleep0", z._FAST_POLL_S, 0.0)]
keep = (z._FAST_POLL_S, z._FAST_SLEEP_S)
rows = {name: [] for name in ["floor_synchronize", *(p[0] for p in policies)]}
for _ in range(40):
    for name, fast_s, fast_sleep_s in [("floor_synchronize", 0, 0), *policies]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        if name == "floor_synchronize":
            torch.cuda.synchronize()
        else:
            z._FAST_POLL_S, z._FAST_SLEEP_S = fast_s, fast_sleep_s
            z._sync(dev)
        rows[name].append(time.perf_counter() - t0)
z._FAST_POLL_S, z._FAST_SLEEP_S = keep
floor = statistics.median(rows["floor_synchronize"])
late = {k: round((statistics.median(v) - floor) * 1e3, 4) for k, v in rows.items() if k != "floor_synchronize"}
out = {"kernel_ms": round(floor * 1e3, 3), "late_ms": late}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out))
PY
echo "gpu wait rc=$? (t=${SECONDS}s)"
timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rA tests/test_zmq_gpu.py \
  "tests/test_comm_gpu.py::test_zmq_gpu_wait_is_an_event_on_the_current_stream_and_abortable" 2>&1 \
  | tee "$OUT/zmq_gpu_tests.log" | tail -8
timeout 150 python3 benchmarks/bench_fp8_zmq.py --preset "${PRESET:-qwen3-8b}" --device cuda --refits "${REFITS:-5}" \
  --rounds "${ROUNDS:-3}" --json "$OUT/host_zmq_h200.json" > "$OUT/host_zmq_h200.log" 2>&1
echo "bench rc=$? (t=${SECONDS}s)"
python3 - "$OUT/host_zmq_h200.json" <<'PY' || tail -20 "$OUT/host_zmq_h200.log"
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({k: d.get(k) for k in ("seconds", "trainer_seconds", "rollout_phases_ms", "bit_exact")}, indent=1))
PY
