"""Benchmark of the ``zmq`` colocated refit: two processes (trainer, rollout) on one device.

``python -m policyworker.cli.zmq_bench --preset qwen3-8b --device cuda --json out.json``

The trainer holds the preset's full parameters (allocated on the device, filled
from a seeded generator per version: the stand-in for a training step, outside
the timed region); the rollout holds its generation-layout tensors (one flat
allocation). Per measured refit both meet at a barrier, then the trainer's
``stream_weights_via_ipc_zmq`` is timed (it returns after the rollout's Done, so it
covers the rollout's copies); the rollout checks every byte afterwards.

Same run, same processes: the ceiling is the refit's own copies between its own
buffers (the trainer's exported storage → the rollout's tensors, the runs the refit
compiled; ``ceiling_kind`` "own") whenever the refit is nothing but those copies, else
one flat copy of the same byte count between two preallocated, touched private buffers
(``ceiling_kind`` "private"; that one is always reported too, as ``private_ceiling_*``:
on CPU it ran *slower* than the refit's copy out of shared memory, so it is no upper
bound there). D2D ``copy_`` on a GPU, memcpy through ``copy_`` on CPU, same thread
count, done by the rollout right before
each refit while the trainer waits (the median of ``ceiling_rounds`` = 3 back-to-back
copies) — ceiling, refit, ceiling, refit … — so that each
refit is compared with a ceiling of the same moment. ``ratio_to_ceiling`` is the
median over measured refits of (ceiling seconds ÷ refit seconds), ``ratio_spread``
its min / quartiles / max; the first refit (connect, export, open: cold) is left out
and reported apart (``first_refit_s``, ``cold_refit``). The baseline is
``policyworker.cli.nemo_baseline`` (NeMo RL's staged protocol) moving the same
tensors into the same rollout tensors. Loop lag: a 1 ms ticker task on the
trainer's event loop during the measured refits; ``loop_lag_ms_p50`` /
``loop_lag_ms_p99`` over ``loop_lag_ticks`` ticks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import zlib
from typing import Any

import torch

from policyworker.errors import TransportError
from policyworker.cli import nemo_baseline
from policyworker.cli.output import ratio_spread, write_json

__all__ = ["run_zmq_bench"]


def _seeded_(t: torch.Tensor, name: str, version: int) -> None:
    g = torch.Generator(device=t.device).manual_seed((zlib.crc32(name.encode()) * 1000003 + version) % (2**62))
    with torch.no_grad():
        t.copy_(torch.empty(t.shape, dtype=torch.float32, device=t.device).normal_(generator=g))


def _workers():
    from policyworker.workers.rollout import RolloutWorker
    from policyworker.workers.trainer import AbstractPolicyWorker

    class BenchTrainer(AbstractPolicyWorker):
        """A trainer that is only its (seeded) parameters: no model, no reference copy."""

        def __init__(self, params, config, dtype, **kw):
            super().__init__(**kw)
            self._params, self._config, self._dtype = params, config, dtype

        def _named_tensors(self):
            return dict(self._params)

        def _refit_model_source(self):
            return self._config

        async def get_reference_policy_logprobs(self, *, data, micro_batch_size=None):
            raise NotImplementedError("a bench trainer has no model")

        def _refit_dtype(self):
            return self._dtype

    return BenchTrainer, RolloutWorker


def _peak_delta(dev: torch.device, before: int) -> int:
    if dev.type != "cuda":
        return 0
    return max(0, torch.cuda.max_memory_allocated(dev) - before)


def _verify(plan, rank: int, params, version: int, dev: torch.device) -> bool:
    from policyworker.layout.apply import _region

    names = plan.body.tensor_names
    for t in plan.receives(rank):
        for c in t.all_copies():
            name = names[c.src_tensor]
            spec = plan.local_tensors("src", 0)[name]
            full = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=dev)
            _seeded_(full, name, version)
            want = _region(full, c.src_at, c.start, c.stop)
            if not torch.equal(_region(params[names[c.dst_tensor]], c.dst_at, c.start, c.stop), want):
                return False
    return True


def _rank_main(rank: int, a: dict[str, Any], barrier) -> dict[str, Any]:
    from policyworker.layout import build_plan
    from policyworker.models import get_preset, param_specs

    dev = torch.device(a["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    config = get_preset(a["preset"])
    dtype = getattr(torch, a["dtype"])
    BenchTrainer, BenchRollout = _workers()
    base = nemo_baseline if a["baseline"] else None
    endpoint_base = None
    out: dict[str, Any] = {"rank": rank}

    async def main() -> dict[str, Any]:
        nonlocal endpoint_base
        opts = {"flatten": a["flatten"], "bucket_bytes": a["bucket_bytes"]}
        if rank == 0:
            params = [(n, torch.nn.Parameter(torch.empty(s, dtype=d, device=dev), requires_grad=False))
                      for n, (s, d) in param_specs(config, dtype).items()]
            w: Any = BenchTrainer(params, config, dtype, rank=0, world_size=1, device=dev, cpu_index=0,
                                  zmq_timeout_s=a["timeout_s"])
            wired: Any = await w.prepare_zmq_refit_info(a["gen"], 1)
        else:
            w = BenchRollout(rank=0, gen_world_size=1, device=dev, cpu_index=0, zmq_timeout_s=a["timeout_s"])
            plan = build_plan(config, "tp=1", a["gen"], 1, 1, dtype=dtype)
            w.load_colocated_plan(plan)
            wired = plan
        # The setup, given through the road with the plan just wired (the shims keep it).
        await w.attach_transport("zmq", connect=False, plan=wired, timeout_s=w.zmq_timeout_s, **opts)
        endpoint_base = f"ipc://{w.runtime_dir}/nemo-baseline-{w.device_facts.device_id}.sock"
        rows, lags, ok = [], [], True
        ceiling_s: list[float] = []
        own_ceiling_s: list[float | None] = []
        if rank == 1:  # the ceiling's buffers: allocated and touched once, before any refit
            n = plan.recv_bytes_per_dst_rank()[0]
            src = torch.ones(n, dtype=torch.uint8, device=dev)
            dst = torch.zeros(n, dtype=torch.uint8, device=dev)
        for version in range(1, a["refits"] + 2):  # version 1: warm-up (connect, export, open)
            if rank == 0:
                for n, p in params:
                    _seeded_(p, n, version)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            # This refit's ceiling, while the trainer waits at the barrier.
            await asyncio.to_thread(barrier.wait, a["timeout_s"])
            if rank == 1:
                # On the refit executor's kind of thread, as the rollout's own copies run.
                rounds = max(1, a["ceiling_rounds"])
                ceiling_s.append(await asyncio.to_thread(
                    lambda: statistics.median(_flat_copy(src, dst, dev) for _ in range(rounds))))
                runs = _own_runs(w)
                own_ceiling_s.append(None if runs is None else await asyncio.to_thread(
                    lambda: statistics.median(_runs_copy(runs, dev) for _ in range(rounds))))
            await asyncio.to_thread(barrier.wait, a["timeout_s"])
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            mem0 = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            await asyncio.to_thread(barrier.wait, a["timeout_s"])
            ticks: list[float] = []
            running = True

            async def ticker() -> None:
                while running:
                    t = time.perf_counter()
                    await asyncio.sleep(0.001)
                    ticks.append(time.perf_counter() - t - 0.001)

            tick = asyncio.create_task(ticker())
            t0 = time.perf_counter()
            if rank == 0:
                rep = await w.stream_weights_via_ipc_zmq(refit_timeout_s=a["timeout_s"])
            else:
                rep = await w.update_weights_via_ipc_zmq(refit_timeout_s=a["timeout_s"])
            seconds = time.perf_counter() - t0
            running = False
            await tick
            row = {"version": version, "seconds": seconds, "bytes": rep.bytes, "notes": list(rep.notes),
                   "peak_extra": max(rep.peak_extra_bytes, _peak_delta(dev, mem0))}
            if version > 1:
                lags += ticks
            if rank == 1:
                row["bit_exact"] = await asyncio.to_thread(_verify, plan, 0, w.params, version, dev)
                ok = ok and row["bit_exact"]
            rows.append(row)
        out.update(rows=rows, lags=lags, bit_exact=ok)
        await asyncio.to_thread(barrier.wait, a["timeout_s"])
        if rank == 1:
            out["ceiling_s"] = ceiling_s
            out["own_ceiling_s"] = own_ceiling_s
            del src, dst
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if base is not None:
            out["baseline"] = await asyncio.to_thread(_baseline, base, rank, a, barrier, endpoint_base, w,
                                                      params if rank == 0 else None, plan if rank == 1 else None)
        await w.shutdown()
        return out

    return asyncio.run(main())


def _flat_copy(src: torch.Tensor, dst: torch.Tensor, dev: torch.device) -> float:
    """Seconds of one flat ``copy_`` of ``src`` into ``dst`` (synchronised on a GPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    dst.copy_(src)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _own_runs(w) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The rollout's compiled copy runs (trainer storage → its own tensors), once the
    first refit built them, when the refit is nothing but those runs (no staged buckets,
    no format launch); else None."""
    program = w._refit_transport_state("zmq").get("program")  # a zmq_program.CopyProgram
    if program is None:
        return None
    runs = program.runs
    return list(runs) if runs and not program.buckets and not len(program.launch) else None


def _runs_copy(runs: list[tuple[torch.Tensor, torch.Tensor]], dev: torch.device) -> float:
    """Seconds of the refit's own copies, nothing else: the same source and destination
    memory the refit reads and writes (writing the trainer's current bytes, which the
    next refit writes again)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for src, dst in runs:
        dst.copy_(src, non_blocking=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _baseline(base, rank, a, barrier, endpoint, w, params, plan) -> dict[str, Any]:
    dev = torch.device(a["device"])
    if rank == 0:
        side = base.baseline_trainer(params, endpoint, bucket_bytes=a["baseline_bucket_bytes"], timeout_s=a["timeout_s"])
    else:
        side = base.baseline_rollout(base.plan_writer(plan, 0, w.params), endpoint, device=dev, timeout_s=a["timeout_s"])
    times, exact = [], True
    barrier.wait(a["timeout_s"])
    for i in range(a["baseline_refits"] + 1):
        version = 1000 + i
        if rank == 0:
            for n, p in params:
                _seeded_(p, n, version)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        barrier.wait(a["timeout_s"])
        seconds, _ = base.timed(side.refit)
        if i:
            times.append(seconds)
        if rank == 1 and i == a["baseline_refits"]:
            exact = _verify(plan, 0, w.params, version, dev)
    side.close()
    return {"seconds": times, "bit_exact": exact, "bucket_bytes": getattr(side, "bucket_bytes", None)}


def run_zmq_bench(preset: str = "small", dtype: str = "bfloat16", refits: int = 5, device: str = "cpu", *,
                  gen: str = "tp=1", flatten: bool = True, bucket_bytes: int = 64 << 20, baseline: bool = True,
                  baseline_bucket_bytes: int | None = None, baseline_refits: int | None = None,
                  ceiling_rounds: int = 3, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run the two-process benchmark; return the JSON-ready summary (module docstring)."""

    from policyworker.runtime.procs import process_context, start_world

    if device == "cuda":
        device = "cuda:0"
    if baseline_bucket_bytes is None:
        baseline_bucket_bytes = (2 << 30) if device.startswith("cuda") else (32 << 20)
    args = dict(preset=preset, dtype=dtype, refits=refits, device=device, gen=gen, flatten=flatten,
                bucket_bytes=bucket_bytes, baseline=baseline, baseline_bucket_bytes=baseline_bucket_bytes,
                baseline_refits=refits if baseline_refits is None else baseline_refits,
                ceiling_rounds=ceiling_rounds, timeout_s=timeout_s)
    barrier = process_context().Barrier(2)
    world = start_world(_rank_main, 2, (args, barrier))
    res = world.collect(timeout_s * (refits + 6))
    t, r = res[0], res[1]
    nbytes = t["rows"][-1]["bytes"]
    secs = [x["seconds"] for x in t["rows"][1:]]
    gbps = statistics.median(nbytes / s / 1e9 for s in secs)
    private = r["ceiling_s"][1:]   # paired with the measured refits; [0] with the cold one
    own = r["own_ceiling_s"][1:]
    # The ceiling is the refit's own copies between its own buffers where the refit is
    # only copies (the honest upper bound: on CPU a copy between two private buffers ran
    # slower than the refit's copy out of shared memory); else one flat private copy.
    ceiling_kind = "own" if own and all(x is not None for x in own) else "private"
    ceilings = own if ceiling_kind == "own" else private
    ceiling = statistics.median(nbytes / s / 1e9 for s in ceilings)
    ratios = [c / s for c, s in zip(ceilings, secs)]
    private_ratios = [c / s for c, s in zip(private, secs)]
    lags = sorted(t["lags"])

    def lag_ms(q: float) -> float | None:
        return 1e3 * lags[min(len(lags) - 1, int(q * len(lags)))] if lags else None

    out: dict[str, Any] = {
        "transport": "zmq", "device": device, "preset": preset, "dtype": dtype, "gen": gen, "flatten": flatten,
        "bytes": nbytes, "refits": secs, "first_refit_s": t["rows"][0]["seconds"],
        "rollout_refits": [x["seconds"] for x in r["rows"][1:]],
        "gbps_median": gbps, "ceiling_gbps": ceiling, "ratio_to_ceiling": statistics.median(ratios),
        "ratio_spread": ratio_spread(ratios),
        "ratio_method": "median over measured refits of ceiling_s / refit_s, the ceiling measured right "
                        "before each refit in the same processes: 'own' = the refit's own copy runs between "
                        "its own buffers (trainer storage -> rollout tensors), 'private' = one flat copy of "
                        "the same byte count between two private buffers",
        "ceiling_kind": ceiling_kind,
        "ceiling_seconds": ceilings,
        "private_ceiling_seconds": private,
        "private_ceiling_gbps": statistics.median(nbytes / s / 1e9 for s in private),
        "ratio_to_private_ceiling": statistics.median(private_ratios),
        "cold_refit": {"seconds": t["rows"][0]["seconds"], "ceiling_seconds": r["ceiling_s"][0],
                       "ratio_to_ceiling": r["ceiling_s"][0] / t["rows"][0]["seconds"]},
        "peak_extra_bytes": max(x["peak_extra"] for x in t["rows"][1:] + r["rows"][1:]),
        "loop_lag_ms_p50": lag_ms(0.50), "loop_lag_ms_p99": lag_ms(0.99), "loop_lag_ticks": len(lags),
        "bit_exact": bool(r["bit_exact"]), "notes": {"trainer": t["rows"][-1]["notes"], "rollout": r["rows"][-1]["notes"],
                                                     "first_trainer": t["rows"][0]["notes"],
                                                     "first_rollout": r["rows"][0]["notes"]},
    }
    if "baseline" in t:
        bs = t["baseline"]["seconds"]
        out["baseline_refits"] = bs
        out["baseline_gbps_median"] = statistics.median(nbytes / s / 1e9 for s in bs)
        out["speedup_vs_baseline"] = gbps / out["baseline_gbps_median"]
        out["baseline_bucket_bytes"] = t["baseline"]["bucket_bytes"]
        out["baseline_bit_exact"] = bool(r["baseline"]["bit_exact"])
        out["bit_exact"] = out["bit_exact"] and out["baseline_bit_exact"]
    elif baseline:
        raise TransportError("zmq bench: the NeMo-protocol baseline was asked for but did not run")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m policyworker.cli.zmq_bench", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--refits", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gen", default="tp=1")
    p.add_argument("--no-flatten", action="store_true")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    res = run_zmq_bench(ns.preset, ns.dtype, ns.refits, ns.device, gen=ns.gen, flatten=not ns.no_flatten,
                        baseline=not ns.no_baseline)
    write_json(ns.json, res, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
