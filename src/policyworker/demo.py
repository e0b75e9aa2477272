"""``policyworker demo``: a real world of trainer and rollout processes on this host.

Two trainer and two rollout processes (CPU, gloo) form the update group, run the
warm-up broadcast every rank checks, and report their device facts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from .procs import free_port, run_world

__all__ = ["main", "run_demo"]


def _demo_rank(rank: int, n_train: int, n_gen: int, port: int, timeout_s: float) -> dict[str, Any]:
    from .rollout import RolloutWorker
    from .torch_worker import TorchPolicyWorker

    async def run() -> dict[str, Any]:
        world = n_train + n_gen
        t0 = time.perf_counter()
        if rank < n_train:
            worker: Any = TorchPolicyWorker.for_demo(rank=rank, world_size=n_train, timeout_s=timeout_s)
        else:
            worker = RolloutWorker(rank=rank - n_train, gen_world_size=n_gen, device="cpu", timeout_s=timeout_s)
        await worker.init_collective("127.0.0.1", port, world, train_world_size=n_train)
        info = worker.get_gpu_info()
        info["group_rank"] = worker.model_update_group.rank
        info["joined_s"] = round(time.perf_counter() - t0, 3)
        info["zmq_address"] = worker.get_zmq_address()
        await worker.shutdown()
        return info

    return asyncio.run(run())


def run_demo(*, n_train: int = 2, n_gen: int = 2, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Start the world, join the update group, return each rank's device facts."""
    port = free_port()
    return run_world(_demo_rank, n_train + n_gen, (n_train, n_gen, port, timeout_s), timeout_s=timeout_s + 30)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    with console.status("starting 2 trainer + 2 rollout processes (CPU, gloo) and forming the update group…"):
        t0 = time.perf_counter()
        infos = run_demo(timeout_s=args.timeout)
        elapsed = time.perf_counter() - t0
    table = Table(title=f"update group formed and verified in {elapsed:.1f}s (warm-up broadcast checked by every rank)")
    for col in ("group rank", "role", "rank", "device id", "node ip", "free memory", "peak RSS", "pid"):
        table.add_column(col)
    for info in sorted(infos, key=lambda i: i["group_rank"]):
        table.add_row(
            str(info["group_rank"]), info["role"], str(info["rank"]), info["device_id"], info["node_ip"],
            f"{info['free_memory_bytes'] / 2**30:.1f} GiB", f"{info['peak_memory_bytes'] / 2**20:.0f} MiB",
            str(info["pid"]),
        )
    console.print(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"ranks": infos, "seconds": elapsed}, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0
