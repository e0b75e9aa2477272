"""sglang_ipc vs zmq, CPU or one GPU: refit throughput against a same-run copy ceiling. Prints JSON.

``.venv/bin/python benchmarks/bench_sglang_vs_zmq.py --preset small --dtype bfloat16 --refits 4``
``python3 benchmarks/bench_sglang_vs_zmq.py --device cuda --preset qwen3-8b --refits 10 --json out.json``

CPU (``--device cpu``), sglang_ipc: two trainer processes (``TorchPolicyWorker``, whose base carries ``SglangIpcMixin``), one
engine of 2 "GPUs" whose tp ranks are ``RolloutWorker`` s behind the in-process adapter
on trainer rank 0 (rank 1's buffer is opened across processes through its shared-memory
handle). Per refit: new weights (outside the timing), a barrier, then
``sglang_refit``; seconds = the slowest rank. Bytes = bytes landed in the engine (model
bytes × tp ranks). Each byte is copied twice (pack into the flattened buffer, load
into the rollout), like SGLang's own path. The ceiling is one plain ``copy_`` of the
same byte count between two preallocated, touched buffers, in the same run.

GPU (``--device cuda``), sglang_ipc: the layout of the zmq benchmark — one trainer, one
engine of tp=1 on the same GPU (``engine_gpu_counts=[1]``): the in-process adapter lives
in the trainer's process, so the trainer's own CUDA buffer is used directly. The trainer
is only its parameters (the preset's shapes, allocated on the GPU and refilled from a
seeded generator per version, outside the timing); the rollout holds a full copy. The
timed region is ``sglang_refit`` (it returns after the engine's copies finished on the
GPU); the rollout is compared with the trainer's tensors afterwards. The ceiling is one
flat device-to-device ``copy_`` of the same byte count, in the same process. The engine
answers each bucket once its copies are queued (the trainer orders its repack after
them on the device; the last bucket waits for every copy before it commits);
``--answer-finished`` makes it answer after they finished, as SGLang does.

zmq: ``policyworker.cli.zmq_bench.run_zmq_bench`` (one trainer, one rollout, same device)
when it can be imported; its own same-run ceiling is reported beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch


def _rank(rank: int, a: dict[str, Any]) -> dict[str, Any]:
    from policyworker import RolloutWorker, TorchPolicyWorker
    from policyworker.models import get_preset, seeded_state_dict
    from policyworker.models.toy_model import build_model
    from policyworker.integrations.sglang.engine import InProcessSglangEngine

    torch.set_num_threads(1)
    Trainer = TorchPolicyWorker  # AbstractPolicyWorker carries SglangIpcMixin

    async def main() -> dict[str, Any]:
        config, dtype = get_preset(a["preset"]), getattr(torch, a["dtype"])
        model = build_model(config, seed=0, dtype=dtype)
        w = Trainer(model, rank=rank, world_size=2, device="cpu", timeout_s=120.0)
        await w.init_collective("127.0.0.1", a["port"], 2, train_world_size=2)
        await w.attach_transport("sglang_ipc", engine_gpu_counts=(2,), bucket_bytes=a["bucket_bytes"],
                                 buffers=a["buffers"])
        engine = workers = None
        if rank == 0:
            workers = [RolloutWorker(rank=i, gen_world_size=2, device="cpu") for i in range(2)]
            for r in workers:
                r.params = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            engine = InProcessSglangEngine(workers)
        rows = []
        for version in range(1, a["refits"] + 1):
            new = seeded_state_dict(config, seed=version, dtype=dtype)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(new[n])
            await w._run(w.model_update_group.barrier)
            t0 = time.perf_counter()
            rep = await w.sglang_refit(engine=engine)
            secs = time.perf_counter() - t0
            t = torch.tensor([secs], dtype=torch.float64)
            await w._run(w.model_update_group.all_reduce, t, op=torch.distributed.ReduceOp.MAX)
            row = {"version": rep.version, "seconds": float(t.item()), "buffer_bytes": rep.peak_extra_bytes}
            if workers is not None:
                row["bit_exact"] = all(torch.equal(r.params[n], new[n]) for r in workers for n in new)
                row["bytes"] = sum(r.last_report.bytes for r in workers)
            rows.append(row)
        ceiling = []
        if rank == 0:
            nbytes = rows[-1]["bytes"]
            src = torch.ones(nbytes, dtype=torch.uint8)
            dst = torch.zeros(nbytes, dtype=torch.uint8)
            for _ in range(a["ceiling_rounds"]):
                t0 = time.perf_counter()
                dst.copy_(src)
                ceiling.append(time.perf_counter() - t0)
        for r in workers or []:
            await r.shutdown()
        await w.shutdown()
        return {"rows": rows, "ceiling_s": ceiling}

    return asyncio.run(main())


def _fill_(params: dict[str, torch.Tensor], version: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(params.values()):
            g = torch.Generator(device=p.device).manual_seed(version * 1_000_003 + i)
            p.copy_(torch.empty(p.shape, dtype=torch.float32, device=p.device).normal_(generator=g))


def _gpu_rank(rank: int, a: dict[str, Any]) -> dict[str, Any]:
    from policyworker import RolloutWorker, TorchPolicyWorker
    from policyworker.models import get_preset, param_specs
    from policyworker.integrations.sglang.engine import InProcessSglangEngine

    class ParamsTrainer(TorchPolicyWorker):
        """A trainer that is only its parameters; SGLang loads them (the documented hook)."""

        def __init__(self, params: dict[str, torch.Tensor], **kw: Any) -> None:
            super().__init__(torch.nn.Linear(1, 1), **kw)  # no model to build: only the refit is measured
            self._bench_params = params

        def _named_tensors(self) -> dict[str, torch.Tensor]:
            return self._bench_params

    cuda = a.get("device", "cuda") == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)

    async def main() -> dict[str, Any]:
        specs = param_specs(get_preset(a["preset"]), getattr(torch, a["dtype"]))
        params = {n: torch.empty(s, dtype=d, device=dev) for n, (s, d) in specs.items()}
        w = ParamsTrainer(params, rank=0, world_size=1, device=dev, timeout_s=120.0)
        await w.init_collective("127.0.0.1", a["port"], 1, train_world_size=1)
        await w.attach_transport("sglang_ipc", engine_gpu_counts=(1,), bucket_bytes=a["bucket_bytes"],
                                 buffers=a["buffers"])
        r = RolloutWorker(rank=0, gen_world_size=1, device=dev)
        if a.get("flat_rollout"):
            # The rollout's params are views of one arena in the buckets' (sorted-name) order:
            # the adapter then loads each bucket with one copy instead of one per tensor.
            arena = torch.zeros(sum(p.numel() * p.element_size() for p in params.values()), dtype=torch.uint8,
                                device=dev)
            r.params, at = {}, 0
            for n in sorted(params):
                p = params[n]
                at = -(-at // p.element_size()) * p.element_size()
                nb = p.numel() * p.element_size()
                r.params[n] = arena[at:at + nb].view(p.dtype).view(p.shape)
                at += nb
        else:
            r.params = {n: torch.zeros_like(p) for n, p in params.items()}
        engine = InProcessSglangEngine([r], answer_queued=a.get("answer_queued", True))
        rows = []
        for version in range(1, a["refits"] + 1):
            _fill_(params, version)
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            mem0 = torch.cuda.memory_allocated(dev) if cuda else 0
            t0 = time.perf_counter()
            rep = await w.sglang_refit(engine=engine, refit_timeout_s=120.0)
            sync()  # the engine already waited for its copies; this is a no-op check
            secs = time.perf_counter() - t0
            rows.append({"version": rep.version, "seconds": secs, "buffer_bytes": rep.peak_extra_bytes,
                         "buckets": rep.buckets, "bytes": r.last_report.bytes,
                         "spans": dict(w._refit_transport_state("sglang_ipc").get("last_spans", {})),
                         "engine_spans": dict(getattr(engine, "spans", {})),
                         "peak_extra_bytes": (torch.cuda.max_memory_allocated(dev) - mem0) if cuda else 0,
                         "bit_exact": all(torch.equal(r.params[n], p) for n, p in params.items())})
        engine.close()
        await r.shutdown()
        await w.shutdown()
        del engine, r
        if cuda:
            torch.cuda.empty_cache()
        nbytes = rows[-1]["bytes"]
        src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        ceiling = []
        for _ in range(a["ceiling_rounds"] + 1):  # the first one warms up
            sync()
            t0 = time.perf_counter()
            dst.copy_(src)
            sync()
            ceiling.append(time.perf_counter() - t0)
        return {"rows": rows, "ceiling_s": ceiling[1:]}

    return asyncio.run(main())


def _median_spans(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    steps = sorted({k for r in rows for k in r.get(key, {})})
    return {k: statistics.median(r.get(key, {}).get(k, 0.0) for r in rows) for k in steps}


def run_sglang_gpu(preset: str, dtype: str, refits: int, bucket_bytes: int, ceiling_rounds: int = 5,
                   buffers: int = 2, device: str = "cuda", flat_rollout: bool = False,
                   answer_queued: bool = True) -> dict[str, Any]:
    from policyworker.runtime.procs import free_port, run_world

    a = dict(preset=preset, dtype=dtype, refits=refits, bucket_bytes=bucket_bytes, port=free_port(),
             ceiling_rounds=ceiling_rounds, buffers=buffers, device=device, flat_rollout=flat_rollout,
             answer_queued=answer_queued)
    (res,) = run_world(_gpu_rank, 1, (a,), timeout_s=600)
    rows = res["rows"]
    nbytes = rows[-1]["bytes"]
    steady = [r["seconds"] for r in rows[1:]] or [rows[0]["seconds"]]
    gbps = statistics.median(nbytes / s / 1e9 for s in steady)
    ceiling = nbytes / statistics.median(res["ceiling_s"]) / 1e9
    return {"transport": "sglang_ipc", "engine": "in-process, tp=1, in the trainer's process (engine_gpu_counts=[1])",
            "device": "cuda:0" if device == "cuda" else "cpu",
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None,
            "preset": preset, "dtype": dtype, "bytes_landed": nbytes, "bucket_bytes": bucket_bytes, "buffers": buffers,
            "flat_rollout": flat_rollout, "answer_queued": answer_queued, "buckets": rows[-1]["buckets"], "buffer_bytes_per_rank": rows[-1]["buffer_bytes"],
            "peak_extra_bytes": max(r["peak_extra_bytes"] for r in rows[1:] or rows),
            "first_refit_s": rows[0]["seconds"], "refits_s": steady, "gbps_median": gbps,
            "ceiling_s": res["ceiling_s"], "ceiling_gbps": ceiling, "ratio_to_ceiling": gbps / ceiling,
            "spans_median_s": _median_spans(rows[1:] or rows, "spans"),
            "engine_spans_median_s": _median_spans(rows[1:] or rows, "engine_spans"),
            "bit_exact": all(r["bit_exact"] for r in rows)}


def run_sglang(preset: str, dtype: str, refits: int, bucket_bytes: int, ceiling_rounds: int = 5,
               buffers: int = 2) -> dict[str, Any]:
    from policyworker.runtime.procs import free_port, run_world

    a = dict(preset=preset, dtype=dtype, refits=refits, bucket_bytes=bucket_bytes, port=free_port(),
             ceiling_rounds=ceiling_rounds, buffers=buffers)
    src, _ = run_world(_rank, 2, (a,), timeout_s=600)
    rows = src["rows"]
    nbytes = rows[-1]["bytes"]
    steady = [r["seconds"] for r in rows[1:]] or [rows[0]["seconds"]]
    gbps = statistics.median(nbytes / s / 1e9 for s in steady)
    ceiling = nbytes / statistics.median(src["ceiling_s"]) / 1e9
    return {"transport": "sglang_ipc", "engine": "in-process, tp=2 (2 trainer processes)", "device": "cpu",
            "preset": preset, "dtype": dtype, "bytes_landed": nbytes, "bucket_bytes": bucket_bytes, "buffers": buffers,
            "buffer_bytes_per_rank": rows[-1]["buffer_bytes"], "first_refit_s": rows[0]["seconds"],
            "refits_s": steady, "gbps_median": gbps, "ceiling_gbps": ceiling, "ratio_to_ceiling": gbps / ceiling,
            "bit_exact": all(r["bit_exact"] for r in rows)}


def run_zmq(preset: str, dtype: str, refits: int, device: str = "cpu") -> dict[str, Any]:
    try:
        from policyworker.cli.zmq_bench import run_zmq_bench
    except ImportError as exc:  # written concurrently; absent in some checkouts
        return {"transport": "zmq", "skipped": f"policyworker.cli.zmq_bench not importable: {exc}"}
    res = run_zmq_bench(preset, dtype, refits, device, baseline=False)
    keep = ("transport", "device", "preset", "dtype", "bytes", "refits", "first_refit_s", "gbps_median",
            "ceiling_gbps", "ratio_to_ceiling", "bit_exact", "peak_extra_bytes")
    return {k: res.get(k) for k in keep}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--refits", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--bucket-bytes", type=int, default=None, help="default: 64 MiB on cpu, 1 GiB on cuda")
    p.add_argument("--no-zmq", action="store_true")
    p.add_argument("--buffers", type=int, default=2, help="sglang_ipc pipeline buffers per rank (1: no overlap)")
    p.add_argument("--flat-rollout", action="store_true",
                   help="single/cuda: the rollout's params are views of one arena (one load copy per bucket)")
    p.add_argument("--answer-finished", action="store_true",
                   help="single/cuda: the in-process engine answers a bucket after its copies finished "
                        "(SGLang's behaviour) instead of once they are queued")
    p.add_argument("--single", action="store_true",
                   help="on cpu: the GPU layout (one trainer, tp=1 engine in its process) instead of 2 processes")
    p.add_argument("--json", default=None, help="also write the JSON here")
    ns = p.parse_args(argv)
    if ns.device == "cuda":
        bucket = (1 << 30) if ns.bucket_bytes is None else ns.bucket_bytes
        out = {"sglang_ipc": run_sglang_gpu(ns.preset, ns.dtype, ns.refits, bucket, buffers=ns.buffers,
                                            flat_rollout=ns.flat_rollout, answer_queued=not ns.answer_finished)}
    elif ns.single:
        bucket = (64 << 20) if ns.bucket_bytes is None else ns.bucket_bytes
        out = {"sglang_ipc": run_sglang_gpu(ns.preset, ns.dtype, ns.refits, bucket, buffers=ns.buffers, device="cpu",
                                            flat_rollout=ns.flat_rollout, answer_queued=not ns.answer_finished)}
    else:
        bucket = (64 << 20) if ns.bucket_bytes is None else ns.bucket_bytes
        out = {"sglang_ipc": run_sglang(ns.preset, ns.dtype, ns.refits, bucket, buffers=ns.buffers)}
    if not ns.no_zmq:
        out["zmq"] = run_zmq(ns.preset, ns.dtype, ns.refits, ns.device)
        z = out["zmq"]
        if z.get("ratio_to_ceiling"):
            out["sglang_ratio_over_zmq_ratio"] = out["sglang_ipc"]["ratio_to_ceiling"] / z["ratio_to_ceiling"]
    text = json.dumps(out, indent=2)
    print(text)
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
