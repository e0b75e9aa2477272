"""Time `build_plan` (and the plan's encoding) for real model shapes; print JSON.

    python benchmarks/bench_plan.py [--repeat N] [--case NAME ...]

Each repeat runs in a fresh child process pinned to one CPU core, so its peak RSS
(``ru_maxrss``) is that one plan's and the time is one core's. Each case reports the
best and median over the repeats of `build_plan`'s time, of build + encode + hash (what
``policyworker plan`` pays; wall and this process's CPU time, which other load on a
shared machine inflates less), and of the child's peak RSS, next to the case's budget
(``limit_s``, ``limit_rss_mb``: issue 17), plus the plan's wire size, copies,
messages and total/minimum bytes. The machine may be shared: read the best and the
median, not one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from policyworker.layout import Parallelism, build_plan
from policyworker.models import get_preset

# name: (preset, train layout, gen layout, budget seconds or None, budget RSS MiB or None)
CASES = {
    "qwen3-8b tp4pp2dp2->tp8": ("qwen3-8b", "tp=4,pp=2,dp=2", "tp=8", None, None),
    "qwen3-8b ddp8->tp2dp4": ("qwen3-8b", "dp=8", "tp=2,dp=4", None, None),
    "qwen3-30b-a3b 64->16 (tp4pp4dp4ep4 -> tp4dp4)":
        ("qwen3-30b-a3b", "tp=4,pp=4,dp=4,ep=4", "tp=4,dp=4", None, None),
    "qwen3-30b-a3b 64->16 (tp2pp4dp8ep8 -> tp4dp4ep16)":
        ("qwen3-30b-a3b", "tp=2,pp=4,dp=8,ep=8", "tp=4,dp=4,ep=16", None, None),
    "qwen3-30b-a3b 64->32 (tp4pp4dp4ep16 -> tp8dp4)":
        ("qwen3-30b-a3b", "tp=4,pp=4,dp=4,ep=16", "tp=8,dp=4", None, None),
    # Issue 17's scale cases: <= 10 s / <= 30 s, each <= 4 GB RSS, one core.
    "qwen3-235b-a22b 64->32 (tp4pp4dp4ep16 -> tp8dp4)":
        ("qwen3-235b-a22b", "tp=4,pp=4,dp=4,ep=16", "tp=8,dp=4", 10.0, 4096),
    "kimi-k2-1t 256->128 (tp8pp8dp4ep32 -> tp8dp16ep128)":
        ("kimi-k2-1t", "tp=8,pp=8,dp=4,ep=32", "tp=8,dp=16,ep=128", 30.0, 4096),
}


def child(name: str) -> dict[str, object]:
    """One plan in this process (pinned to one core): times, peak RSS, plan facts."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    preset, train, gen = CASES[name][:3]
    config = get_preset(preset)
    t, g = Parallelism.parse(train), Parallelism.parse(gen)
    began, cpu = time.perf_counter(), time.process_time()
    plan = build_plan(config, t, g, t.world_size, g.world_size)
    plan_s = time.perf_counter() - began
    digest = plan.hash
    total_s = time.perf_counter() - began
    cpu_s = time.process_time() - cpu
    fresh = type(plan)(plan.body)   # encode + hash without the cached bytes
    began = time.perf_counter()
    fresh.hash
    encode_s = time.perf_counter() - began
    return {
        "case": name, "preset": preset, "train": str(t), "gen": str(g),
        "train_world_size": t.world_size, "gen_world_size": g.world_size,
        "params": len(plan.params), "copies": plan.num_copies, "messages": plan.messages,
        "runs": sum(len(x.runs) for x in plan.transfers),
        "total_bytes": plan.total_bytes, "min_bytes": plan.min_bytes,
        "max_send_over_mean": _imbalance(plan.send_bytes_per_src_rank()),
        "wire_bytes": len(plan.to_wire()), "hash": digest,
        "plan_s": plan_s, "plan_and_hash_s": total_s, "plan_and_hash_cpu_s": cpu_s,
        "encode_hash_s": encode_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _imbalance(sent: dict[int, int]) -> float:
    live = [n for n in sent.values() if n]
    return round(max(live) / (sum(live) / len(live)), 4) if live else 1.0


def run(name: str, repeat: int) -> dict[str, object]:
    rows = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, __file__, "--child", name], check=True,
                             capture_output=True, text=True, timeout=900)
        rows.append(json.loads(out.stdout))
    if len({r["hash"] for r in rows}) != 1:
        raise SystemExit(f"{name}: the plan's hash changed between runs")
    first = rows[0]
    _, _, _, limit_s, limit_mb = CASES[name]
    result = {k: first[k] for k in ("case", "preset", "train", "gen", "train_world_size",
                                    "gen_world_size", "params", "copies", "runs", "messages",
                                    "total_bytes", "min_bytes", "max_send_over_mean",
                                    "wire_bytes", "hash")}
    for key in ("plan_s", "plan_and_hash_s", "plan_and_hash_cpu_s", "encode_hash_s",
                "peak_rss_mb"):
        values = [float(r[key]) for r in rows]   # type: ignore[arg-type]
        result[f"{key}_best"] = round(min(values), 4 if key != "peak_rss_mb" else 1)
        result[f"{key}_median"] = round(statistics.median(values),
                                        4 if key != "peak_rss_mb" else 1)
    result["encode_hash_s"] = result["encode_hash_s_best"]
    result["repeat"] = repeat
    result["one_core"] = hasattr(os, "sched_setaffinity")
    if limit_s is not None:
        result["limit_s"] = limit_s
        result["limit_rss_mb"] = limit_mb
        result["within_limits"] = bool(result["plan_and_hash_s_median"] <= limit_s
                                       and result["peak_rss_mb_median"] <= limit_mb)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        json.dump(child(args.child), sys.stdout)
        return 0
    results = [run(n, args.repeat) for n in (args.case or CASES)]
    json.dump({"bench": "plan", "results": results}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
