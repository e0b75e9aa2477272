"""``policyworker bench --transport nccl_reshard --delta``: delta refits against full ones, same run.

One world of real processes (trainers holding flat training-layout shards, rollouts in
the generation layout, gloo), as in :mod:`.refit_bench`. Weights change by a chosen
fraction of their elements per version (:func:`~policyworker.testing.delta_weights.perturb_`),
or follow real optimizer steps: before the world starts, the parent trains the preset's
toy model (fp32 master weights, AdamW, random tokens) and writes the bf16 copy after each
step to a scratch directory; the fraction of bf16 elements that changed per step is
reported. Per fraction the same processes run, back to back:

* ``full`` ×3 — the plain transport (``delta`` off): the same-run baseline;
* ``forced`` ×3 — delta on with ``delta_max_fraction=1``: what a delta costs at this fraction
  (the rollouts check every byte they hold, ``delta_verify="full"``);
* ``incremental`` ×3 — the same with ``delta_verify="incremental"`` (the rollouts update
  the checksums they verified at their last commit from the changed units; the first
  counted refit of the block is already incremental: the warm one was checked in full);
* ``auto`` ×2 — delta on with the default threshold: a delta, or the full fallback.

Each mode's block starts with one *warm* refit of unchanged weights that is not
counted: a mode switch re-attaches the transport, so that refit pays the connect (the
groups' checks, the schedule) and, in delta mode, the full refit that refreshes the
trainers' shadows; the counted refits are the steady ones, as in a training run.

Every refit is checked bit for bit on every rollout against ``dest_shards`` of the full
state. Times are the slowest rank's wall time (medians over the counted refits; every
sample is in the JSON); bytes are the wire bytes of all ranks. The crossover is where
``forced`` stops being faster than ``full`` (interpolated).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from policyworker.errors import TransportError
from policyworker.layout import Parallelism, build_plan, dest_shards, empty_local_tensors, source_shards
from policyworker.runtime.procs import free_port, start_world

__all__ = ["DeltaBenchSpec", "run_delta_bench"]

_MODES = {"full": {"delta": False}, "forced": {"delta": True, "delta_max_fraction": 1.0},
          "incremental": {"delta": True, "delta_max_fraction": 1.0, "delta_verify": "incremental"},
          "auto": {"delta": True}}
_PLAN = (("full", 3), ("forced", 3), ("incremental", 3), ("auto", 2))


@dataclass
class DeltaBenchSpec:
    preset: str = "small"
    train: str = "tp=2,pp=2"
    gen: str = "tp=2,dp=2"
    dtype: str = "bfloat16"
    fractions: tuple[float, ...] = (0.001, 0.01, 0.1, 0.5, 1.0)
    real_steps: int = 3  # optimizer steps for the measured fraction (0: none)
    lr: float = 1e-6
    timeout_s: float = 300.0
    schedule: list[tuple[str, str, float]] = field(default_factory=list)  # (mode, "synthetic"|"real", f or step)
    ports: dict[str, Any] = field(default_factory=dict)
    real_dir: str = ""


def real_steps(preset: str, steps: int, lr: float, out_dir: str) -> list[float]:
    """Train the preset's toy model ``steps`` AdamW steps (fp32 master weights); write the bf16
    copy before and after each step (``real{i}.safetensors``); return the changed fraction per step."""
    from safetensors.torch import save_file

    from policyworker.models import get_preset
    from policyworker.models.toy_model import build_model

    torch.manual_seed(0)
    config = get_preset(preset)
    model = build_model(config, seed=0, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    fractions = []

    def snapshot(i: int) -> dict[str, torch.Tensor]:
        state = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
        save_file(state, os.path.join(out_dir, f"real{i}.safetensors"))
        return state

    prev = snapshot(0)
    for i in range(1, steps + 1):
        ids = torch.randint(0, config.vocab_size, (2, 33))
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        cur = snapshot(i)
        changed = sum(int((cur[n].view(torch.int16) != prev[n].view(torch.int16)).sum()) for n in cur)
        fractions.append(changed / sum(t.numel() for t in cur.values()))
        prev = cur
    return fractions


def _schedule(spec: DeltaBenchSpec) -> list[tuple[str, str, float]]:
    out = [("full", "synthetic", 1.0)]  # cold: first touch of every buffer, not counted
    for f in spec.fractions:
        for mode, n in _PLAN:
            out += [(mode, "warm", 0.0)] + [(mode, "synthetic", f)] * n
    if spec.real_steps:
        # real0 in full, then one optimizer step per refit: forced (the refresh), forced
        # (counted, the second step), auto (the third step); full ones of the same weights.
        steps = spec.real_steps
        out += [("full", "warm", 0.0), ("full", "real", 0), ("forced", "real", 1)]
        if steps >= 2:
            # incremental: step 2 backwards (real1: the same elements change; checked in
            # full after the re-attach, not counted), then forwards again (counted)
            out += [("forced", "real", 2), ("incremental", "real", 1), ("incremental", "real", 2)]
        if steps >= 3:
            out += [("auto", "warm", 0.0), ("auto", "real", 3)]
        out += [("full", "warm", 0.0), ("full", "real", min(steps, 3))]
    return out


def _max_over(group, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    group.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _rank_main(rank: int, spec: DeltaBenchSpec) -> dict[str, Any]:
    from safetensors.torch import load_file

    from policyworker.models import get_preset, seeded_state_dict
    from policyworker.workers.rollout import RolloutWorker
    from policyworker.testing.delta_weights import perturb_
    from policyworker.models.toy_model import build_model
    from policyworker.workers.torch_trainer import TorchPolicyWorker

    torch.set_num_threads(1)
    config = get_preset(spec.preset)
    dtype = getattr(torch, spec.dtype)
    train, gen = Parallelism.parse(spec.train), Parallelism.parse(spec.gen)
    n_train, n_gen = train.world_size, gen.world_size
    trainer = rank < n_train
    plan = build_plan(config, train, spec.gen, n_train, n_gen, dtype=dtype)
    ip, stage_ports = "127.0.0.1", spec.ports["stages"]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"rank": rank, "rows": []}
        if trainer:
            shards = empty_local_tensors(plan, "src", rank, flat=True)
            w: Any = TorchPolicyWorker(build_model(config, seed=0, dtype=dtype), rank=rank, world_size=n_train,
                                       device="cpu", timeout_s=spec.timeout_s, refit_params=shards)
            await w.init_collective(ip, spec.ports["update"], n_train + n_gen, train_world_size=n_train)
            stage = train.coords(rank).pp_stage
            members = list(train.stage_ranks(stage))
            await w.init_nccl_reshard_comm_group([ip] * train.pp, stage_ports, train.pp, stage,
                                                 len(members) + n_gen, members.index(rank))
            info = await w.prepare_nccl_reshard_refit_info(train, spec.gen, n_train, n_gen)
            wiring: dict[str, Any] = {"plan": info, "group": w.pp_comm_group, "stage": stage}
        else:
            w = RolloutWorker(rank=rank - n_train, gen_world_size=n_gen, device="cpu", timeout_s=spec.timeout_s)
            await w.init_collective(ip, spec.ports["update"], n_train + n_gen, train_world_size=n_train)
            await w.init_nccl_reshard_comm_groups([ip] * train.pp, stage_ports,
                                                  [len(train.stage_ranks(s)) for s in range(train.pp)])
            w.load_refit_plan(plan.refit_info())
            wiring = {"plan": plan.refit_info(), "groups": w.stage_groups}
        state = seeded_state_dict(config, seed=0, dtype=dtype)
        attached = None
        for step, (mode, source, value) in enumerate(spec.schedule):
            if mode != attached:  # a mode is a setup: attached through the road when it changes
                await w.attach_transport("nccl_reshard", connect=False, **wiring, **_MODES[mode])
                attached = mode
            if source == "real":
                state = load_file(os.path.join(spec.real_dir, f"real{int(value)}.safetensors"))
            elif source == "synthetic":
                perturb_(state, value, step + 1)  # "warm": the weights stay as they are
            if trainer:
                for name, t in source_shards(plan, rank, state).items():
                    shards[name].copy_(t)
            await w._run(w.model_update_group.barrier)
            t0, c0 = time.perf_counter(), time.process_time()
            rep = await (w.nccl_reshard_refit() if trainer else w.receive_nccl_reshard_refit())
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            wall = await w._run(_max_over, w.model_update_group, seconds)
            row = {"step": step, "mode": mode, "source": source, "value": value, "wall_seconds": wall, "cpu": cpu,
                   "bytes": rep.bytes, "wire_bytes": rep.wire_bytes if rep.wire_bytes is not None else rep.bytes,
                   "shadow_bytes": rep.shadow_bytes, "delta": bool(rep.notes) and rep.notes[-1].startswith("delta"),
                   "note": rep.notes[-1] if rep.notes else ""}
            if not trainer:
                want, have = dest_shards(plan, rank - n_train, state), w.weights()
                row["bit_exact"] = all(torch.equal(have[k].view(torch.uint8), want[k].view(torch.uint8))
                                       for k in want)
            out["rows"].append(row)
        await w.shutdown()
        return out

    return asyncio.run(main())


def run_delta_bench(spec: DeltaBenchSpec, *, log=None) -> dict[str, Any]:
    """Run the world; return the JSON-ready summary. Raises when a promised comparison is missing."""
    train, gen = Parallelism.parse(spec.train), Parallelism.parse(spec.gen)
    n = train.world_size + gen.world_size
    real_fractions: list[float] = []
    with tempfile.TemporaryDirectory(prefix="pw-delta-bench-") as real_dir:
        if spec.real_steps:
            t0 = time.perf_counter()
            real_fractions = real_steps(spec.preset, spec.real_steps, spec.lr, real_dir)
            if log:
                log(f"real steps: changed fractions {real_fractions} ({time.perf_counter() - t0:.1f} s)")
        spec.real_dir = real_dir
        spec.schedule = _schedule(spec)
        spec.ports = {"update": free_port(), "stages": [free_port() for _ in range(train.pp)]}
        load = {"before": os.getloadavg()}
        world = start_world(_rank_main, n, (spec,))
        results = world.collect(spec.timeout_s * 3)
        load["after"] = os.getloadavg()
    ranks = [results[r] for r in range(n)]
    steps = []
    for i, (mode, source, value) in enumerate(spec.schedule):
        rows = [r["rows"][i] for r in ranks]
        steps.append({"mode": mode, "source": source, "value": value, "seconds": rows[0]["wall_seconds"],
                      "cpu_seconds": sum(r["cpu"] for r in rows),
                      "wire_bytes": sum(r["wire_bytes"] for r in rows[:train.world_size]),
                      "landed_bytes": sum(r["bytes"] for r in rows[train.world_size:]),
                      "delta": rows[0]["delta"], "note": rows[0]["note"],
                      "checked": [r["note"] for r in rows[train.world_size:]],
                      "shadow_bytes_per_trainer": max(r["shadow_bytes"] for r in rows[:train.world_size]),
                      "bit_exact": all(r["bit_exact"] for r in rows[train.world_size:])})
    points = _points(spec, steps, real_fractions)
    return _summary(spec, steps, points, real_fractions, load)


def _points(spec: DeltaBenchSpec, steps: list[dict], real_fractions: list[float]) -> list[dict[str, Any]]:
    groups: list[tuple[str, Any, float]] = [("synthetic", f, f) for f in spec.fractions]
    if spec.real_steps >= 2:
        groups.append(("real", 2, real_fractions[1]))
    points = []
    for source, value, fraction in groups:
        # a block's steps: synthetic ones at this fraction, or every real one
        mine = [s for s in steps[1:] if s["source"] == source and (source == "real" or s["value"] == value)]
        full = [s for s in mine if s["mode"] == "full"]
        forced = [s for s in mine if s["mode"] == "forced" and (source == "synthetic" or s["value"] == value)]
        incremental = [s for s in mine if s["mode"] == "incremental" and (source == "synthetic" or s["value"] == value)]
        auto = [s for s in mine if s["mode"] == "auto"]
        if not full or not forced or not incremental or not all(s["delta"] for s in forced + incremental):
            raise TransportError(f"delta bench: no full baseline or no delta refit at {source} {value}")
        full_s = statistics.median(s["seconds"] for s in full)
        forced_s = statistics.median(s["seconds"] for s in forced)
        point = {"source": source, "changed_fraction": fraction,
                 "full_seconds": full_s, "full_wire_bytes": full[0]["wire_bytes"],
                 "delta_seconds": forced_s, "delta_wire_bytes": int(statistics.median(s["wire_bytes"] for s in forced)),
                 "delta_time_ratio": forced_s / full_s,
                 "delta_bytes_ratio": statistics.median(s["wire_bytes"] for s in forced) / full[0]["wire_bytes"],
                 "samples": {"full": [s["seconds"] for s in full], "delta": [s["seconds"] for s in forced],
                             "incremental": [s["seconds"] for s in incremental],
                             "auto": [s["seconds"] for s in auto]},
                 # CPU seconds of every process (all threads, user + system) per refit: what
                 # the refit costs the host, much less sensitive to other load than wall time
                 "full_cpu_seconds": statistics.median(s["cpu_seconds"] for s in full),
                 "delta_cpu_seconds": statistics.median(s["cpu_seconds"] for s in forced)}
        point["delta_cpu_ratio"] = point["delta_cpu_seconds"] / point["full_cpu_seconds"]
        inc_s = statistics.median(s["seconds"] for s in incremental)
        inc_cpu = statistics.median(s["cpu_seconds"] for s in incremental)
        point.update(incremental_seconds=inc_s, incremental_time_ratio=inc_s / full_s, incremental_cpu_seconds=inc_cpu,
                     incremental_cpu_ratio=inc_cpu / point["full_cpu_seconds"],
                     # how the rollouts checked them (a raw encoding, at ~100%, is always a full pass)
                     incremental_checked=sorted({c.rsplit("; checked ", 1)[-1] for s in incremental
                                                 for c in s["checked"]}))
        if auto:
            auto_s = statistics.median(s["seconds"] for s in auto)
            point.update(auto_seconds=auto_s, auto_was_delta=all(s["delta"] for s in auto),
                         auto_cpu_ratio=statistics.median(s["cpu_seconds"] for s in auto) / point["full_cpu_seconds"],
                         auto_time_ratio=auto_s / full_s, auto_note=auto[-1]["note"])
        points.append(point)
    return points


def _crossover(points: list[dict]) -> float | None:
    syn = sorted((p for p in points if p["source"] == "synthetic"), key=lambda p: p["changed_fraction"])
    for a, b in zip(syn, syn[1:]):
        ra, rb = a["delta_time_ratio"], b["delta_time_ratio"]
        if ra < 1.0 <= rb:
            return a["changed_fraction"] + (1.0 - ra) * (b["changed_fraction"] - a["changed_fraction"]) / (rb - ra)
    if syn and syn[0]["delta_time_ratio"] >= 1.0:
        return syn[0]["changed_fraction"]
    return None  # a delta beat the full refit at every measured fraction


def _summary(spec: DeltaBenchSpec, steps, points, real_fractions, load) -> dict[str, Any]:
    at = {p["changed_fraction"]: p for p in points if p["source"] == "synthetic"}
    one, hundred = at.get(0.01), at.get(1.0)
    goals = {}
    if one is not None:
        goals["bytes_at_1pct_le_5pct"] = one["delta_bytes_ratio"] <= 0.05
        goals["time_at_1pct_le_0.25x"] = one["delta_time_ratio"] <= 0.25
        goals["time_at_1pct_le_0.25x_incremental"] = one["incremental_time_ratio"] <= 0.25
    if hundred is not None and "auto_time_ratio" in hundred:
        goals["auto_at_100pct_le_1.1x"] = hundred["auto_time_ratio"] <= 1.1
    goals["every_refit_bit_exact"] = all(s["bit_exact"] for s in steps)
    return {
        "transport": "nccl_reshard", "mode": "delta", "device": "cpu", "backend": "gloo",
        "loadavg": load, "cpus": os.cpu_count(),
        "preset": spec.preset, "dtype": spec.dtype, "layouts": {"train": spec.train, "gen": spec.gen},
        "real_steps": {"optimizer": "AdamW", "lr": spec.lr, "master": "float32", "compared": "bfloat16",
                       "changed_fraction_per_step": real_fractions},
        "points": points,
        "crossover_fraction": _crossover(points),
        "sender_shadow_bytes_per_trainer": max(s["shadow_bytes_per_trainer"] for s in steps),
        "goals": goals,
        "bit_exact": goals["every_refit_bit_exact"],
        "steps": steps,
        "spec": {k: v for k, v in asdict(spec).items() if k not in ("ports", "schedule", "real_dir")},
    }
