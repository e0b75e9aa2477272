"""``policyworker demo``: a real refit world on this host (CPU: gloo + shared memory).

Trainers in TP=2 x PP=2 and rollout workers in TP=2 x DP=2 (8 processes) form the
update group and the per-stage reshard groups, then alternate a gloo point-to-point
ceiling round between themselves and a refit of the "small" preset (58M params, bf16)
with new weights every time; every rollout checks every tensor bit for bit. A
progress display follows the ranks; a table summarises each refit.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from policyworker.cli.output import write_json
from policyworker.cli.refit_bench import RefitBenchSpec, run_refit_bench

__all__ = ["main"]


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    spec = RefitBenchSpec(preset=args.preset, train=args.train, gen=args.gen, refits=args.refits,
                          timeout_s=args.timeout)
    spec.validate()  # bad input: one line, before any process starts
    n = spec.train_par.world_size + spec.gen_par.world_size
    console = Console()
    console.print(
        f"[bold]policyworker demo[/]: {spec.train_par.world_size} trainers ({spec.train}) → "
        f"{spec.gen_par.world_size} rollouts ({spec.gen}), preset {spec.preset} ({spec.dtype}), "
        f"transport nccl_reshard over gloo, {spec.refits} refits"
    )
    steps = {"joined": "groups formed", "ceiling": "ceiling measured"}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        tasks: dict[str, Any] = {
            "joined": progress.add_task("start processes, form groups", total=n),
            "ceiling": progress.add_task("measure gloo p2p ceiling", total=n),
        }
        for v in range(1, spec.refits + 1):
            tasks[f"refit{v}"] = progress.add_task(f"refit v{v} (send, receive, verify)", total=n)

        def on_event(rank: int, kind: str, version: int) -> None:
            key = kind if kind in steps else f"refit{version}"
            progress.advance(tasks[key])

        t0 = time.perf_counter()
        result = run_refit_bench(spec, on_event=on_event)
        elapsed = time.perf_counter() - t0

    table = Table(title=f"refits of {result['bytes_moved'] / 1e6:.1f} MB "
                        f"(minimum {result['min_bytes'] / 1e6:.1f} MB, ratio {result['bytes_over_min']:.2f})")
    for col in ("version", "seconds", "GB/s", "ceiling GB/s", "x its ceiling", "committed", "bit-exact"):
        table.add_column(col, justify="right")
    for row in result["refits"]:
        table.add_row(f"{row['version']}{' (cold)' if row['cold'] else ''}", f"{row['seconds']:.3f}",
                      f"{row['gbps']:.2f}", f"{row['ceiling_gbps']:.2f}", f"{row['ratio_to_ceiling']:.2f}",
                      f"v{row['version']}", "yes" if result["bit_exact"] else "NO")
    console.print(table)
    spread = result["ratio_spread"]
    console.print(
        f"ceiling and refit interleaved (ceiling right before each refit, same processes): median of "
        f"{spread['pairs']} steady pairs {result['ratio_to_ceiling']:.2f} x ceiling (min {spread['min']:.2f}, "
        f"IQR {spread['p25']:.2f}-{spread['p75']:.2f}, max {spread['max']:.2f}); cold first refit "
        f"{result['cold_refit']['ratio_to_ceiling']:.2f} x, excluded; steady refit {result['gbps_median']:.2f} GB/s "
        f"vs ceiling {result['ceiling_gbps']:.2f} GB/s; staging ring "
        f"{result['ring_bytes_per_process'] / 2**20:.0f} MiB/process; total {elapsed:.1f}s"
    )
    if args.json:
        demo = {
            "transport": result["transport"],
            "layouts": result["layouts"],
            "refits": [{"seconds": r["seconds"], "bytes": r["bytes"], "version": r["version"]}
                       for r in result["refits"]],
            "bit_exact": bool(result["bit_exact"]),
            "ceiling_gbps": result["ceiling_gbps"],
            "gbps_median": result["gbps_median"],
            "ratio_to_ceiling": result["ratio_to_ceiling"],
            "ratio_spread": result["ratio_spread"],
            "cold_refit": result["cold_refit"],
            "steady_refits": result["steady_refits"],
            "details": result,
        }
        write_json(args.json, demo)
        console.print(f"wrote {args.json}")
    if not result["bit_exact"]:
        console.print("[red]a rollout's weights differ from the trainers'[/]")
        return 1
    return 0
