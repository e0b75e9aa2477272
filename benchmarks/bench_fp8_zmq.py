"""FP8 refit vs BF16 refit vs "transfer BF16, then quantize on the receiver" — zmq colocated.

``PYTHONPATH=src python benchmarks/bench_fp8_zmq.py --preset qwen3-8b --device cuda --json out.json``

Two processes on one device (trainer with the preset's full bf16 parameters, its
colocated rollout), one run, the same processes for every mode:

* ``bf16``: the plain refit (gen ``tp=1``): the rollout pulls bf16 bytes.
* ``bf16_then_quantize``: the same bf16 refit, then the rollout quantizes what landed
  into fp8 tensors + scales (the bolted-on way), with the *same* fused kernel — so
  the difference is where quantization happens, not how well.
* ``bf16_then_quantize_torch``: the bolted-on way without a custom kernel — the same
  landed bytes quantized per tensor in vectorized eager torch (pad, amax per block,
  divide, clamp, cast; checked bit for bit against the oracle), timed once on the
  last refit after a warm-up pass.
* ``fp8``: gen ``tp=1,fp8=block128``: the pull itself quantizes (one fused read of
  the trainer's bf16 storage; fp8 + scales written in place).

The modes run in ``--rounds`` interleaved rounds (bf16, fp8, bf16, fp8, ...; each with
two warm-up refits after the switch, then ``--refits`` timed ones), so that a drift of
the device or the host lands in both; ``fp8_over_bf16`` and ``then_quantize_over_fp8``
are medians of the per-round ratios (``per_round``, ``fp8_over_bf16_spread``), the
pooled medians ride along (``pooled``). Times are the rollout's wall clock per refit
(from the barrier to its weights being usable, quantization included)
(``rollout_phases_ms``: the same wall clock cut into the pull's phases, from the
transport's ``state["timing"]`` stamps: to the executor, waiting for the Offer, torch's
copies issued, the fp8 launch issued, waiting for the GPU, Done -> Commit, return); both
processes meet at a barrier after every refit too, so the trainer's next "training
step" (reseeding its weights) never overlaps the rollout's work; the
trainer's ``stream_weights_via_ipc_zmq`` times ride along. Same run: ``ceiling_s`` is one
flat device copy of the bf16 byte count. Every mode's last refit (last round) is checked bit
for bit against weights regenerated on the rollout (fp8: against the band-loop quantizer
in plain torch, an implementation independent of the kernel).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from policyworker.cli.output import write_json  # noqa: E402
from policyworker.cli.zmq_bench import _seeded_, _workers  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _quantize_eager(src: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int = 128) -> None:
    """Block-FP8 in vectorized eager torch, one tensor at a time (what a framework without a
    custom kernel writes): pad to whole blocks, amax per block, divide, clamp, cast."""
    n, k = src.shape
    nb, kb = -(-n // block), -(-k // block)
    x = torch.zeros((nb * block, kb * block), dtype=torch.float32, device=src.device)
    x[:n, :k] = src
    blocks = x.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    out = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).view(nb * block, kb * block)
    q.copy_(out[:n, :k].to(torch.float8_e4m3fn))
    s.copy_(scale)


def _receiver_quant_jobs(fp8_plan, bf16_params, fp8_params):
    """(bf16 landed tensor region, fp8 region, scale region) per quantized copy."""
    from policyworker.layout.formats import block_fp8_grid as f
    from policyworker.layout.formats.block_fp8 import is_fp8_copy
    from policyworker.layout.formats.block_fp8_pack import _region

    names = fp8_plan.body.tensor_names
    jobs = []
    for t in fp8_plan.receives(0):
        for c in t.copies:
            if not is_fp8_copy(fp8_plan, c):
                continue
            name = names[c.dst_tensor]
            br, bc = f.blocks(c.start, c.stop, fp8_plan.dest_format.block)
            sr, sc = f.scale_at(fp8_plan, c)
            jobs.append((_region(bf16_params[name], c.dst_at, c.start, c.stop),
                         _region(fp8_params[name], c.dst_at, c.start, c.stop),
                         fp8_params[f.scale_name(name)].narrow(0, sr, br).narrow(1, sc, bc)))
    return jobs


def _check(plan, params, version: int, dev: torch.device, only_fp8: bool = False) -> bool:
    """Every landed byte (and scale) equals the regenerated source (quantized in plain
    torch); ``only_fp8``: the quantized tensors alone (the receiver-side quantization)."""
    from policyworker.layout.formats import block_fp8_grid as f
    from policyworker.layout.formats.block_fp8 import is_fp8_copy
    from policyworker.layout.formats.block_fp8_pack import _region, quantize_bands

    names = plan.body.tensor_names
    srcs = plan.local_tensors("src", 0)
    for t in plan.receives(0):
        for c in t.copies:
            name = names[c.src_tensor]
            full = torch.empty(srcs[name].shape, dtype=getattr(torch, srcs[name].dtype), device=dev)
            _seeded_(full, name, version)
            if only_fp8 and not is_fp8_copy(plan, c):
                continue
            want = _region(full, c.src_at, c.start, c.stop)
            have = _region(params[names[c.dst_tensor]], c.dst_at, c.start, c.stop)
            if is_fp8_copy(plan, c):
                br, bc = f.blocks(c.start, c.stop, plan.dest_format.block)
                q = torch.empty(want.shape, dtype=torch.float8_e4m3fn, device=dev)
                s = torch.empty((br, bc), dtype=torch.float32, device=dev)
                quantize_bands(want, q, s)
                sr, sc = f.scale_at(plan, c)
                hs = params[f.scale_name(names[c.dst_tensor])].narrow(0, sr, br).narrow(1, sc, bc)
                if not (torch.equal(have.view(torch.uint8), q.view(torch.uint8)) and torch.equal(hs, s)):
                    return False
            elif not torch.equal(have, want):
                return False
    return True


# The rollout's pull, phase by phase: (name, stamp it ends at, stamp it starts at);
# stamps from the transport's state["timing"] (time.perf_counter, this process), plus
# "t0" (the barrier) and "t1" (weights usable, after the bench's own sync).
_PHASES = (
    ("to_transport", "begin", "t0"),  # worker.refit -> the executor's _receive
    ("offer_wait", "offer", "begin"),  # Ready -> Offer (the trainer's pre-Offer work too)
    ("program", "program", "offer"),  # handles, the cached copy program
    ("torch_copies_issue", "copies_issued", "program"),  # fence + the copies torch makes
    ("launch_issue", "launch_issued", "copies_issued"),  # the fp8 launch (copy tiles in it)
    ("buckets", "buckets_done", "launch_issued"),  # staged buckets (none here) + the join
    ("device_wait", "device_done", "buckets_done"),  # polling the GPU's event
    ("done_commit", "commit", "device_done"),  # Done -> Commit round trip
    ("return", "t1", "commit"),  # back to the caller: ledger, asyncio, the bench's sync
    ("start_to_launch_issued", "launch_issued", "t0"),
)


def _phases(t0: float, stamps: dict[str, float], t1: float) -> dict[str, float]:
    """Per-phase milliseconds of one pull (phases whose stamps are missing are left out)."""
    st = dict(stamps, t0=t0, t1=t1)
    return {name: round((st[end] - st[start]) * 1e3, 4) for name, end, start in _PHASES if end in st and start in st}


def _rank_main(rank: int, a: dict[str, Any], barrier) -> dict[str, Any]:
    from policyworker.layout import build_plan
    from policyworker.layout.formats.block_fp8_pack import QuantJobs
    from policyworker.models import get_preset, param_specs
    from policyworker.layout.local import flat_local_tensors

    dev = torch.device(a["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        if a["kernel"]:
            from policyworker.ops import fp8_triton

            fp8_triton.configure_from_string(a["kernel"])
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    config = get_preset(a["preset"])
    dtype = torch.bfloat16
    Trainer, Rollout = _workers()
    gens = {"bf16": "tp=1", "fp8": "tp=1,fp8=block128"}
    wait = lambda: asyncio.to_thread(barrier.wait, a["timeout_s"])  # noqa: E731

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"rank": rank, "modes": {}}
        opts = {"flatten": True, "bucket_bytes": 64 << 20}
        if rank == 0:
            params = [(n, torch.nn.Parameter(torch.empty(s, dtype=d, device=dev), requires_grad=False))
                      for n, (s, d) in param_specs(config, dtype).items()]
            w: Any = Trainer(params, config, dtype, rank=0, world_size=1, device=dev, cpu_index=0,
                             zmq_timeout_s=a["timeout_s"])
        else:
            w = Rollout(rank=0, gen_world_size=1, device=dev, cpu_index=0, zmq_timeout_s=a["timeout_s"])
        version = 0
        out["modes"] = {"bf16": [], "fp8": []}
        # Interleaved rounds (bf16 then fp8, `rounds` times; each round's first refit
        # after a switch is its warm-up): a drift of the device or host between the two
        # modes' refits lands in both, and every round gives one fp8 / bf16 ratio.
        for rnd in range(a["rounds"]):
            for mode in ("bf16", "fp8"):
                gen = gens[mode]
                if rank == 0:
                    wired: Any = await w.prepare_zmq_refit_info(gen, 1)
                else:
                    plan = build_plan(config, "tp=1", gen, 1, 1, dtype=dtype)
                    w.params = {}
                    quant = None
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                    w.load_colocated_plan(plan)
                    if mode == "bf16":  # the receiver-side quantization targets (bolted-on way)
                        fp8_plan = build_plan(config, "tp=1", gens["fp8"], 1, 1, dtype=dtype)
                        if rnd == 0:
                            fp8_params = flat_local_tensors(fp8_plan, 0, dev)
                        quant = QuantJobs(_receiver_quant_jobs(fp8_plan, w.params, fp8_params))
                    wired = plan
                # The setup, through the road with the plan just wired.
                await w.attach_transport("zmq", connect=False, plan=wired, timeout_s=w.zmq_timeout_s, **opts)
                last_round = rnd == a["rounds"] - 1
                for i in range(a["refits"] + 2):  # two warm-ups: the first builds, the second captures
                    version += 1
                    if rank == 0:
                        for n, p in params:
                            _seeded_(p, n, version)
                    _sync(dev)
                    await wait()
                    t0 = time.perf_counter()
                    if rank == 0:
                        rep = await w.stream_weights_via_ipc_zmq(refit_timeout_s=a["timeout_s"])
                        out["modes"][mode].append({"seconds": time.perf_counter() - t0, "bytes": rep.bytes,
                                                   "round": rnd, "warm": i > 1})
                        await wait()  # the rollout is done (its quantization too) before the next step
                        continue
                    rep = await w.update_weights_via_ipc_zmq(refit_timeout_s=a["timeout_s"])
                    _sync(dev)
                    t1 = time.perf_counter()
                    row = {"seconds": t1 - t0, "bytes": rep.bytes, "notes": list(rep.notes), "round": rnd,
                           "warm": i > 1, "phases_ms": _phases(t0, w._peek_state("zmq").get("timing") or {}, t1)}
                    if mode == "bf16":
                        quant.run()
                        _sync(dev)
                        row["quantize_s"] = time.perf_counter() - t1
                    if i == a["refits"] + 1 and last_round:
                        row["bit_exact"] = await asyncio.to_thread(_check, plan, w.params, version, dev)
                        if mode == "bf16":
                            row["quantized_bit_exact"] = await asyncio.to_thread(
                                _check, fp8_plan, fp8_params, version, dev, True)
                            # The bolted-on way without a custom kernel: the same landed bytes
                            # quantized by vectorized eager torch (checked bit for bit against
                            # the oracle); a warm-up pass, then the timed one.
                            for _ in range(2):
                                for z in (q for _, q, _s in quant.jobs):
                                    z.zero_()
                                _sync(dev)
                                tq = time.perf_counter()
                                for src, q8, sc in quant.jobs:
                                    _quantize_eager(src, q8, sc)
                                _sync(dev)
                                row["quantize_torch_s"] = time.perf_counter() - tq
                            row["quantized_torch_bit_exact"] = await asyncio.to_thread(
                                _check, fp8_plan, fp8_params, version, dev, True)
                    out["modes"][mode].append(row)
                    await wait()
        if rank == 1:
            del fp8_params, quant
        await wait()
        if rank == 1:  # the ceiling: one flat copy of the bf16 byte count, touched buffers
            n = out["modes"]["bf16"][-1]["bytes"]
            w.params = {}
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            src = torch.ones(n, dtype=torch.uint8, device=dev)
            dst = torch.zeros(n, dtype=torch.uint8, device=dev)
            times = []
            for _ in range(5):
                _sync(dev)
                t0 = time.perf_counter()
                dst.copy_(src)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            out["ceiling_s"] = statistics.median(times)
        await w.shutdown()
        return out

    return asyncio.run(main())


def run(preset: str, device: str, refits: int, timeout_s: float, kernel: str = "", rounds: int = 3) -> dict[str, Any]:
    import multiprocessing as mp

    from policyworker.cli.output import ratio_spread
    from policyworker.runtime.procs import start_world

    args = dict(preset=preset, device="cuda:0" if device == "cuda" else device, refits=refits, timeout_s=timeout_s,
                kernel=kernel, rounds=rounds)
    barrier = mp.get_context("spawn").Barrier(2)
    world = start_world(_rank_main, 2, (args, barrier))
    res = world.collect(timeout_s * (2 * rounds * (refits + 2) + 8))
    trainer, rollout = res[0], res[1]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    r = {m: [x for x in rows if x["warm"]] for m, rows in rollout["modes"].items()}
    t = {m: [x for x in rows if x["warm"]] for m, rows in trainer["modes"].items()}
    last = {m: rows[-1] for m, rows in r.items()}
    bf16_s = med([x["seconds"] for x in r["bf16"]])
    then_q = med([x["seconds"] + x["quantize_s"] for x in r["bf16"]])
    fp8_s = med([x["seconds"] for x in r["fp8"]])
    torch_q = last["bf16"]["quantize_torch_s"]
    per_round = []
    for k in range(rounds):
        b = med([x["seconds"] for x in r["bf16"] if x["round"] == k])
        f = med([x["seconds"] for x in r["fp8"] if x["round"] == k])
        q = med([x["seconds"] + x["quantize_s"] for x in r["bf16"] if x["round"] == k])
        per_round.append({"bf16": b, "fp8": f, "bf16_then_quantize": q, "fp8_over_bf16": f / b,
                          "then_quantize_over_fp8": q / f})
    return {
        "benchmark": "fp8 refit, zmq colocated", "preset": preset, "device": args["device"], "refits": refits,
        "rounds": rounds, "kernel": kernel or "defaults",
        "bytes": {"bf16": last["bf16"]["bytes"], "fp8": last["fp8"]["bytes"]},
        # medians over every warm refit of every round
        "seconds": {"bf16": bf16_s, "fp8": fp8_s, "bf16_then_quantize": then_q,
                    "receiver_quantize_only": med([x["quantize_s"] for x in r["bf16"]]),
                    "bf16_then_quantize_torch": bf16_s + torch_q, "receiver_quantize_torch_only": torch_q,
                    "flat_copy_ceiling_bf16_bytes": rollout["ceiling_s"]},
        "trainer_seconds": {m: med([x["seconds"] for x in rows]) for m, rows in t.items()},
        # the headline ratios: median over rounds of each round's own ratio (bf16 and fp8
        # refits of one round are minutes apart at most, seconds here)
        "fp8_over_bf16": med([x["fp8_over_bf16"] for x in per_round]),
        "then_quantize_over_fp8": med([x["then_quantize_over_fp8"] for x in per_round]),
        "then_quantize_torch_over_fp8": (bf16_s + torch_q) / fp8_s,
        "fp8_over_bf16_spread": ratio_spread([x["fp8_over_bf16"] for x in per_round]),
        "pooled": {"fp8_over_bf16": fp8_s / bf16_s, "then_quantize_over_fp8": then_q / fp8_s},
        "per_round": per_round,
        "all_rollout_seconds": {m: [round(x["seconds"], 6) for x in rows] for m, rows in r.items()},
        "bit_exact": {"bf16": last["bf16"]["bit_exact"], "fp8": last["fp8"]["bit_exact"],
                      "bf16_then_quantize": last["bf16"]["quantized_bit_exact"],
                      "bf16_then_quantize_torch": last["bf16"]["quantized_torch_bit_exact"]},
        "notes": {m: rows[-1]["notes"] for m, rows in r.items()},
        # the rollout's host timeline per refit, median per phase (ms): where the time that
        # is neither copy nor kernel goes ("device_wait" holds the GPU's work)
        "rollout_phases_ms": {m: {k: round(med([x["phases_ms"][k] for x in rows if k in x["phases_ms"]]), 4)
                                  for k in rows[-1]["phases_ms"]} for m, rows in r.items()},
        "first_refit_notes": {m: rows[0]["notes"] for m, rows in rollout["modes"].items()},
    }

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--refits", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--kernel", default="", help="fp8 kernel variant as bench_fp8_kernel.py names it, e.g. "
                   "kernel=persist,warps=8,stages=1,prefetch=1,grid=2,fast_div=1,stream=0")
    p.add_argument("--rounds", type=int, default=3, help="interleaved bf16/fp8 rounds (each: warm-ups + --refits)")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    if ns.refits < 1 or ns.rounds < 1:
        p.error("--refits and --rounds must be >= 1")
    res = run(ns.preset, ns.device, ns.refits, ns.timeout_s, ns.kernel, ns.rounds)
    write_json(ns.json, res, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
