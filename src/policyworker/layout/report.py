"""`policyworker plan`: what a reshard plan would move, without moving anything."""

from __future__ import annotations

import time
from typing import Any

from policyworker.layout.fabric import Fabric, fabric_report, format_fabric_report
from policyworker.layout.formats import LAYOUT_OPTIONS, layout_fields, split_gen_layout
from policyworker.layout.parallelism import Parallelism
from policyworker.layout.planner import as_parallelism, build_plan
from policyworker.models.config import ModelConfig, get_preset

__all__ = ["format_plan_report", "plan_report"]


def plan_report(preset: str | ModelConfig, train: Parallelism | str, gen: Parallelism | str, *,
                gen_fused: bool = True, fabric: Fabric | None = None,
                bucket_bytes: int | None = None) -> dict[str, Any]:
    """Plan ``preset`` (a preset's name or a `ModelConfig`) from layout ``train`` to ``gen``
    and summarise it (JSON-safe).

    ``gen`` may carry a destination-format option (:mod:`.formats`); byte counts are
    then the format's sizes (its converted bytes and extra tensors).

    Keys: preset, train, gen, train_world_size, gen_world_size, gen_fused, one per
    format option (its value or None), params, hash,
    total_bytes, min_bytes, recv_bytes_per_dst_rank, send_bytes_per_src_rank,
    messages, copies, wire_bytes, seconds_to_plan. Per-rank dicts are keyed by
    the rank as a string (JSON object keys). With a `Fabric`, also ``fabric_model``:
    :func:`.fabric.fabric_report` of the plan (a model, not a measurement).
    """
    config = get_preset(preset) if isinstance(preset, str) else preset
    preset = config.name if not isinstance(preset, str) else preset
    gen, target = split_gen_layout(gen)
    t, g = as_parallelism(train, "train"), as_parallelism(gen, "gen")
    began = time.perf_counter()
    plan = build_plan(config, t, g, t.world_size, g.world_size, gen_fused=gen_fused, gen_format=target)
    seconds = time.perf_counter() - began
    out = {
        "preset": preset,
        "train": t.to_dict(),
        "gen": g.to_dict(),
        "train_world_size": t.world_size,
        "gen_world_size": g.world_size,
        "gen_fused": gen_fused,
        **layout_fields(target),
        "params": len(plan.params),
        "hash": plan.hash,
        "total_bytes": plan.total_bytes,
        "min_bytes": plan.min_bytes,
        "recv_bytes_per_dst_rank": {str(r): n for r, n in plan.recv_bytes_per_dst_rank().items()},
        "send_bytes_per_src_rank": {str(r): n for r, n in plan.send_bytes_per_src_rank().items()},
        "messages": plan.messages,
        "copies": plan.num_copies,
        "wire_bytes": len(plan.to_wire()),
        "seconds_to_plan": round(seconds, 4),
    }
    if fabric is not None:
        out["fabric_model"] = fabric_report(plan, fabric, bucket_bytes=bucket_bytes)
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def _row_block(title: str, per_rank: dict[str, int], width: int = 4) -> list[str]:
    lines = [title]
    items = list(per_rank.items())
    for i in range(0, len(items), width):
        lines.append("  " + "  ".join(f"{r:>4}: {_size(n):>11}" for r, n in items[i:i + width]))
    return lines


def format_plan_report(d: dict[str, Any]) -> str:
    """A human table of `plan_report`'s dict."""
    def lay(p: dict[str, int]) -> str:
        return ",".join(f"{k}={v}" for k, v in p.items())

    ratio = d["total_bytes"] / d["min_bytes"] if d["min_bytes"] else 1.0
    sends = [n for n in d["send_bytes_per_src_rank"].values() if n]
    lines = [
        f"plan for {d['preset']}: train {lay(d['train'])} ({d['train_world_size']} ranks)"
        f" -> gen {lay(d['gen'])} ({d['gen_world_size']} ranks)"
        f"{' [fused]' if d.get('gen_fused') else ''}"
        + "".join(f" [{key}={d[key]}]" for key in LAYOUT_OPTIONS if d.get(key)),
        f"  hash            {d['hash'][:16]}",
        f"  params          {d['params']}",
        f"  total bytes     {_size(d['total_bytes'])} ({d['total_bytes']})",
        f"  minimum bytes   {_size(d['min_bytes'])} (ratio {ratio:.3f})",
        f"  messages        {d['messages']} ({d['copies']} copies)",
        f"  senders         {len(sends)} of {d['train_world_size']}"
        + (f", max/mean send {max(sends) / (sum(sends) / len(sends)):.2f}" if sends else ""),
        f"  plan wire size  {_size(d['wire_bytes'])}",
        f"  time to plan    {d['seconds_to_plan']:.3f} s",
    ]
    lines += _row_block("  received per generation rank:", d["recv_bytes_per_dst_rank"])
    lines += _row_block("  sent per training rank:", d["send_bytes_per_src_rank"])
    if "fabric_model" in d:
        lines.append(format_fabric_report(d["fabric_model"]))
    return "\n".join(lines)
