"""Time `build_plan` (and the plan's encoding) for real model shapes; print JSON.

    python benchmarks/bench_plan.py [--repeat N] [--case NAME ...]

Each case reports the best and median of N runs of `build_plan`, the time to
encode and hash the plan, its wire size, copies, messages and total/minimum bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from policyworker.layout import Parallelism, build_plan
from policyworker.models import get_preset

CASES = {
    "qwen3-8b tp4pp2dp2->tp8": ("qwen3-8b", "tp=4,pp=2,dp=2", "tp=8"),
    "qwen3-8b ddp8->tp2dp4": ("qwen3-8b", "dp=8", "tp=2,dp=4"),
    "qwen3-30b-a3b 64->16 (tp4pp4dp4ep4 -> tp4dp4)":
        ("qwen3-30b-a3b", "tp=4,pp=4,dp=4,ep=4", "tp=4,dp=4"),
    "qwen3-30b-a3b 64->16 (tp2pp4dp8ep8 -> tp4dp4ep16)":
        ("qwen3-30b-a3b", "tp=2,pp=4,dp=8,ep=8", "tp=4,dp=4,ep=16"),
}


def run(name: str, preset: str, train: str, gen: str, repeat: int) -> dict[str, object]:
    config = get_preset(preset)
    t, g = Parallelism.parse(train), Parallelism.parse(gen)
    times = []
    plan = None
    for _ in range(repeat):
        began = time.perf_counter()
        plan = build_plan(config, t, g, t.world_size, g.world_size)
        times.append(time.perf_counter() - began)
    assert plan is not None
    fresh = type(plan)(plan.body)   # encode + hash without the cached bytes
    began = time.perf_counter()
    digest = fresh.hash
    encode_s = time.perf_counter() - began
    return {
        "case": name, "preset": preset, "train": str(t), "gen": str(g),
        "train_world_size": t.world_size, "gen_world_size": g.world_size,
        "params": len(plan.params), "copies": plan.num_copies, "messages": plan.messages,
        "total_bytes": plan.total_bytes, "min_bytes": plan.min_bytes,
        "wire_bytes": len(plan.to_wire()), "hash": digest,
        "plan_s_best": round(min(times), 4), "plan_s_median": round(statistics.median(times), 4),
        "encode_hash_s": round(encode_s, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    args = ap.parse_args(argv)
    results = [run(n, *CASES[n], repeat=args.repeat) for n in (args.case or CASES)]
    json.dump({"bench": "plan", "results": results}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
