"""Relayed refits over gloo with fake nodes: seconds per refit; print JSON.

    PYTHONPATH=src python benchmarks/bench_relay_cpu.py [--preset small] [--refits 5] [--json FILE]

Run from the repository root (it uses the tests' refit world, ``tests/refit_world.py``).
Two trainers (``tp=2``) on node "a", four rollouts on node "b" (``POLICYWORKER_NODE``
per process), bf16, 4 MiB buckets: each byte leaves "a" once and the entries relay it.
Per layout: each refit's slowest-rank wall time, the median after the first, whether
every rollout was bit-exact every refit, and the bytes the trainers sent (the
cross-node minimum). A CPU measurement on loopback: it says how the relay's message
order behaves, not what NVLink would do; on a shared machine read it with its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, os.getcwd())
    from policyworker.runtime.procs import free_port, run_world
    from tests.refit_world import RefitSpec, refit_rank

    out: dict = {"preset": args.preset, "load_before": os.getloadavg()}
    for gen in ("tp=1,dp=4", "tp=2,dp=2"):
        spec = RefitSpec(preset=args.preset, train="tp=2", gen=gen, refits=args.refits, dtype="bfloat16",
                         nodes=["a", "a", "b", "b", "b", "b"], options={"bucket_bytes": 4 << 20})
        spec.update_port = free_port()
        spec.stage_ports = [free_port() for _ in range(spec.train_par.pp)]
        spec.train_port = free_port()
        res = run_world(refit_rank, 6, (spec,), timeout_s=900)
        per = [max(r["outcomes"][v]["seconds"] for r in res) for v in range(spec.refits)]
        out[gen] = {"seconds": per, "median_after_first": statistics.median(per[1:]),
                    "exact": all(o.get("exact") for r in res[2:] for o in r["outcomes"]),
                    "trainer_bytes": sum(r["outcomes"][0]["bytes"] for r in res[:2])}
        if not out[gen]["exact"]:
            raise SystemExit(f"{gen}: a relayed refit was not bit-exact")
    out["load_after"] = os.getloadavg()
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
