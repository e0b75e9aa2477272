#!/usr/bin/env bash
# One H200 call: the one-GPU tests of the nccl_reshard transport and its NCCL groups
# (issue 14.4): eager communicator, batched p2p, device selection under several
# CUDA_VISIBLE_DEVICES settings, event-read headers, the transport stream's event
# hand-off, timeout -> abort -> RefitTimeout. Under 4 minutes.
# Usage (from the repository root, wheels for pyzmq/msgspec in .whl/): bash benchmarks/run_nccl_h200.sh OUTDIR
set -u
OUT=${1:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
timeout 220 python3 -m pytest -q -p no:cacheprovider -o addopts="" -p no:randomly -rA \
  --junitxml="$OUT/nccl_gpu_tests.xml" tests/test_nccl_reshard_gpu.py tests/test_comm_gpu.py \
  2>&1 | tee "$OUT/nccl_gpu_tests.log" | tail -40
echo "pytest rc=${PIPESTATUS[0]}"
python3 - "$OUT/nccl_gpu_tests.xml" <<'PY'
import json, sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:  # noqa: BLE001 - a report line, not control flow
    print("no junit xml:", e); sys.exit(0)
rows = {}
for case in root.iter("testcase"):
    name = case.get("classname", "").split(".")[-1] + "::" + case.get("name", "")
    state = "passed"
    for kind in ("failure", "error", "skipped"):
        if case.find(kind) is not None:
            state = kind
    rows[name] = [state, round(float(case.get("time", 0)), 2)]
print(json.dumps({"summary": {s: sum(1 for v in rows.values() if v[0] == s) for s in ("passed", "failure", "error", "skipped")},
                  "tests": rows}, indent=1))
PY
