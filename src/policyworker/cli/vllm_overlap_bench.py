"""``policyworker bench --engine vllm --overlap``: how long vLLM stops generating during a refit.

A vLLM ``AsyncLLM`` in this process serves a continuous generation load (``streams``
greedy requests, each resubmitted as it ends) before, during and after every refit.
Refits alternate between the overlapped path (``update_info.overlap=true``: the receive
and vLLM's post-processing run in the background while the engine steps; the controller
polls the version record (``receiving.ready``, :mod:`~policyworker.integrations.vllm.versions`)
and then calls ``finish_weight_update``, which only swaps)
and today's paused path (``overlap=false``: the receive runs inside ``update_weights``
and the post-processing inside ``finish_weight_update``, both collective RPCs between
engine steps), with the same engine, trainers and load, in the same run.

Measured per refit:

* the engine's steps and forward passes on vLLM's worker (``time.monotonic()``, read
  with ``collective_rpc``). A step is an ``execute_model`` call through the return of
  the ``sample_tokens`` call after it (:mod:`~policyworker.integrations.vllm.steps`); a
  forward pass is the model's ``forward`` (the backend's ``StepCounter`` ring), which a
  step contains along with its logits and sampling. The **stall** is the longest time
  between the end of one step and the start of the next (the engine idle: scheduling,
  the step RPCs' round trip and whatever else the worker ran between two steps) among
  the gaps that overlap the refit (controller's ``start_weight_update`` call to the
  return of ``finish_weight_update``). The **forward gap** is the same between two
  forward passes (it also holds the logits and sampling of the step, so it is at least
  the stall). Both statistics over the ``phase_s`` before the refit are the baseline;
* the load's tokens per second (arrival times of streamed tokens) in three phases:
  ``phase_s`` before the refit, during it, ``phase_s`` after it;
* the refit's duration and its parts (controller spans; the worker's phase times of an
  overlapped refit: receive end, post-processing end, swap).

After each commit the load is stopped and two prompts are generated greedily: their
tokens must equal Hugging Face transformers' with that version's weights (checked once
the engine is down; the command fails when any differs).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

from policyworker.errors import ConfigError, PlanError, RefitTimeout
from policyworker.integrations.vllm.versions import EXTENSION
from policyworker.models.config import get_preset
from policyworker.testing.vllm_world import TrainerPool, WorldSpec, greedy_tokens, hf_model, save_hf_model

__all__ = ["gaps_between", "longest_gap", "measure", "run_vllm_overlap_bench", "stall", "summarize",
           "tokens_per_second"]

PROMPTS = [[1, 2, 3, 4], [100, 7, 8, 9, 11]]
CHECK_TOKENS = 8
MODES = ("overlap", "paused")


# -- statistics ---------------------------------------------------------------------------
def stall(passes: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of the :func:`longest_gap`."""
    a, b = longest_gap(passes, start, end)
    return b - a


def longest_gap(passes: list[tuple[float, float]], start: float, end: float) -> tuple[float, float]:
    """(end of a pass, start of the next): the longest such gap among the gaps
    that overlap [start, end], whole (a gap that began before ``start`` or ends after
    ``end`` counts in full; one still open when the passes run out counts up to ``end``).
    ConfigError if no pass ended before ``start`` (nothing to measure from)."""
    ended = [e for _, e in passes if e <= start]
    if not ended:
        raise ConfigError("no engine step ended before the window: the load did not run")
    longest, last_end = (0.0, 0.0), max(ended)
    for s, e in sorted(passes):
        if e <= last_end:
            continue  # ended before the gap being measured
        if s > start and s - last_end > longest[1] - longest[0]:  # the gap (last_end, s) overlaps the window
            longest = (last_end, s)
        if s >= end:
            return longest
        last_end = e
    return longest if longest[1] - longest[0] >= end - last_end else (last_end, end)


def gaps_between(spans: list[tuple[float, float]], start: float, end: float) -> list[float]:
    """Seconds from the end of each span to the start of the next, for the pairs whose gap lies
    inside [start, end] (a phase's baseline)."""
    ordered = sorted(spans)
    return [s2 - e1 for (_, e1), (s2, _) in zip(ordered, ordered[1:]) if start <= e1 and s2 <= end]


def _stats(gaps: list[float]) -> dict[str, float]:
    ordered = sorted(gaps)
    return {"median_ms": 1e3 * statistics.median(ordered), "p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
            "max_ms": 1e3 * ordered[-1], "count": len(ordered)}


def tokens_per_second(arrivals: list[tuple[float, int]], start: float, end: float) -> float:
    return sum(n for t, n in arrivals if start <= t < end) / (end - start)


# -- the load --------------------------------------------------------------------------------
class _Load:
    """``streams`` greedy requests kept in flight; the arrival time of every streamed token."""

    def __init__(self, engine: Any, streams: int, max_tokens: int, vocab: int) -> None:
        self.engine, self.streams, self.max_tokens, self.vocab = engine, streams, max_tokens, vocab
        self.arrivals: list[tuple[float, int]] = []
        self._tasks: list[asyncio.Task] = []
        self._n = 0
        self._rng = random.Random(0)

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._stream(i)) for i in range(self.streams)]

    async def running(self, timeout_s: float) -> None:
        """Return once a token arrived after this call (the load runs); raise what a stream raised."""
        since, end = time.monotonic(), time.monotonic() + timeout_s
        while not (self.arrivals and self.arrivals[-1][0] > since):
            for task in self._tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            if time.monotonic() > end:
                raise RefitTimeout(f"the generation load produced no token within {timeout_s} s")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()  # AsyncLLM aborts a request whose consumer is cancelled
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []

    async def _stream(self, i: int) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        while True:
            self._n += 1
            prompt = [self._rng.randrange(1, self.vocab) for _ in range(8)]
            async for out in self.engine.generate({"prompt_token_ids": prompt}, params, f"load-{i}-{self._n}"):
                self.arrivals.append((time.monotonic(), len(out.outputs[0].token_ids)))


async def _check_tokens(engine: Any, tag: str) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True)

    async def one(j: int, prompt: list[int]) -> list[int]:
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, f"check-{tag}-{j}"):
            final = out
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(j, p) for j, p in enumerate(PROMPTS))))


# -- the run ---------------------------------------------------------------------------------
class _Bench:
    def __init__(self, engine: Any, pool: TrainerPool, spec: WorldSpec, *, tp: int, phase_s: float,
                 load: _Load, log) -> None:
        self.engine, self.pool, self.spec, self.tp, self.phase_s, self.load, self.log = \
            engine, pool, spec, tp, phase_s, load, log
        self.timeout_s = spec.refit_timeout_s

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        # By name: the worker extension (versions.EXTENSION) adds the methods.
        return await asyncio.wait_for(self.engine.collective_rpc(method, args=args), self.timeout_s)

    async def replies(self, ranks: list[int] | None = None) -> list[dict[str, Any]]:
        replies = await asyncio.to_thread(self.pool.replies, self.spec.refit_timeout_s, ranks)
        bad = [r for r in replies if not r["ok"]]
        if bad:
            raise RuntimeError(f"trainers failed: {bad}")
        return replies

    async def connect(self, cpu_linear: str, version: int) -> int:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = {**self.pool.connect(gen_world_size=self.tp, version=version), "cpu_linear": cpu_linear}
        await asyncio.wait_for(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
                               self.spec.timeout_s * 3)
        replies = await self.replies()
        await self.rpc("policyworker_engine_steps")  # starts recording the worker's engine steps
        return replies[0]["total_bytes"]

    async def refit(self, version: int, mode: str) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.pool.send({"cmd": "load", "version": version})
        await self.replies()
        await self.load.running(self.timeout_s)
        await asyncio.sleep(self.phase_s)  # the "before" phase, load running, trainers idle
        self.pool.send({"cmd": "refit", "version": version, "load": False})
        e = self.engine
        t0 = time.monotonic()
        await asyncio.wait_for(e.start_weight_update(), self.timeout_s)
        t1 = time.monotonic()
        update = {"version": version, "overlap": mode == "overlap"}
        await asyncio.wait_for(e.update_weights(WeightTransferUpdateRequest(update_info=update)), self.timeout_s)
        t2 = time.monotonic()
        polls = 0
        if mode == "overlap":
            while not all(r["receiving"] is None or r["receiving"]["ready"]
                          for r in await self.rpc("policyworker_weight_versions")):
                polls += 1
                if time.monotonic() - t2 > self.timeout_s:
                    raise RefitTimeout(f"the overlapped refit of version {version} was not ready within "
                                       f"{self.timeout_s} s")
                await asyncio.sleep(0.005)
        t3 = time.monotonic()
        await asyncio.wait_for(e.finish_weight_update(weight_version=str(version)), self.timeout_s)
        t4 = time.monotonic()
        replies = await self.replies()
        await asyncio.sleep(self.phase_s)  # the "after" phase
        passes = [tuple(p) for p in (await self.rpc("policyworker_step_times", t0 - self.phase_s - 1.0))[0]]
        steps = [tuple(p) for p in (await self.rpc("policyworker_engine_steps", t0 - self.phase_s - 1.0))[0]]
        worker = (await self.rpc("policyworker_refit_times"))[0] if mode == "overlap" else {}
        await self.load.stop()
        tokens = await _check_tokens(e, str(version))  # alone: HF runs each prompt alone too
        self.load.start()
        arrivals, ph = self.load.arrivals, self.phase_s
        in_refit = [p for p in steps if t0 <= p[0] < t4]
        before_gaps = gaps_between(steps, t0 - ph, t0)
        before_forward = gaps_between(passes, t0 - ph, t0)
        if not before_gaps or not before_forward:
            raise ConfigError(f"refit {version}: no engine steps in the {ph} s before it: the load did not run")
        gap = longest_gap(steps, t0, t4)
        fgap = longest_gap(passes, t0, t4)
        calls = {"start_weight_update": (0.0, t1 - t0), "update_weights": (t1 - t0, t2 - t0),
                 **({"ready polls": (t2 - t0, t3 - t0)} if mode == "overlap" else {}),
                 "finish_weight_update": (t3 - t0, t4 - t0)}
        row = {"version": version, "mode": mode, "refit_seconds": t4 - t0, "start_call_seconds": t1 - t0,
               "update_call_seconds": t2 - t1, "ready_wait_seconds": t3 - t2, "ready_polls": polls,
               "finish_call_seconds": t4 - t3, "trainer_send_seconds": max(r["seconds"] for r in replies),
               "stall_seconds": gap[1] - gap[0],
               "stall_excess_seconds": gap[1] - gap[0] - statistics.median(before_gaps),
               "stall_from_seconds": gap[0] - t0, "stall_to_seconds": gap[1] - t0,
               "stall_in": [name for name, (a, b) in calls.items() if a <= gap[1] - t0 and b >= gap[0] - t0],
               "forward_gap_seconds": fgap[1] - fgap[0],
               "baseline_gap_max_seconds": max(before_gaps),
               "baseline_gap_median_seconds": statistics.median(before_gaps),
               "baseline_gaps": _stats(before_gaps),
               "baseline_forward_gaps": _stats(before_forward),
               "longest_step_seconds": max(e - s for s, e in in_refit) if in_refit else 0.0,
               "baseline_step_median_seconds": statistics.median(
                   e - s for s, e in steps if t0 - ph <= s and e <= t0),
               "steps_during_refit": len(in_refit),
               "tokens_per_second": {"before": tokens_per_second(arrivals, t0 - ph, t0),
                                     "during": tokens_per_second(arrivals, t0, t4),
                                     "after": tokens_per_second(arrivals, t4, t4 + ph)},
               "tokens": tokens}
        if worker:
            row["worker_phase_seconds"] = {k: v - t0 for k, v in worker.items()}
        # What a timeline needs, relative to t0 (kept for the plotted refits only).
        row["_timeline"] = {"passes": [(s - t0, en - t0) for s, en in passes if t0 - 0.25 <= en and s <= t4 + 0.25],
                            "steps": [(s - t0, en - t0) for s, en in steps if t0 - 0.25 <= en and s <= t4 + 0.25],
                            "calls": calls,
                            "worker": row.get("worker_phase_seconds", {})}
        self.log(f"refit {version} ({mode}): {row['refit_seconds'] * 1e3:.0f} ms, stall "
                 f"{row['stall_seconds'] * 1e3:.1f} ms in {'+'.join(row['stall_in'])}, forward gap "
                 f"{row['forward_gap_seconds'] * 1e3:.1f} ms (baseline gap median "
                 f"{row['baseline_gap_median_seconds'] * 1e3:.1f} ms, "
                 f"max {row['baseline_gap_max_seconds'] * 1e3:.1f} ms), "
                 f"tokens/s before {row['tokens_per_second']['before']:.0f} during "
                 f"{row['tokens_per_second']['during']:.0f} after {row['tokens_per_second']['after']:.0f}")
        return row


def _start_engine(path: str, spec: WorldSpec, tp: int, streams: int) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=path, skip_tokenizer_init=True, tensor_parallel_size=tp, dtype=spec.dtype,
                           enforce_eager=True, max_model_len=128, max_num_seqs=max(streams, len(PROMPTS)), seed=0,
                           enable_prefix_caching=False,  # a check prompt must not reuse KV of older weights
                           weight_transfer_config={"backend": "policyworker"}, worker_extension_cls=EXTENSION)
    return AsyncLLM.from_engine_args(args)


async def measure(engine: Any, pool: TrainerPool, spec: WorldSpec, *, tp: int = 1, refits: int = 3,
                  version: int = 0, streams: int = 4, phase_s: float = 1.0, max_tokens: int = 96,
                  cpu_linear: str = "prepack", log=print) -> dict[str, Any]:
    """The measurement on a running ``AsyncLLM`` (started with ``worker_extension_cls=EXTENSION``)
    and its trainers, which hold version ``version``: connect, one cold refit, then ``refits``
    of each path, alternating. Returns the raw rows for :func:`summarize`."""
    load = _Load(engine, streams, max_tokens, spec.config["vocab_size"])
    bench = _Bench(engine, pool, spec, tp=tp, phase_s=phase_s, load=load, log=log)
    total = await bench.connect(cpu_linear, version)
    load.start()
    try:
        cold = await bench.refit(version + 1, "paused")  # the first refit attaches the plan: reported apart
        rows = []
        for i in range(refits):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                rows.append(await bench.refit(version + 2 + len(rows), mode))
    finally:
        await load.stop()
    return {"rows": rows, "cold": cold, "bytes_per_refit": total, "tp": tp, "streams": streams,
            "phase_s": phase_s, "max_tokens": max_tokens, "cpu_linear": cpu_linear}


async def _run(spec: WorldSpec, path: str, *, tp: int, streams: int, log, **options: Any) -> dict[str, Any]:
    pool_task = asyncio.ensure_future(asyncio.to_thread(TrainerPool, spec))
    t0 = time.perf_counter()
    engine = await asyncio.to_thread(_start_engine, path, spec, tp, streams)
    startup_s = time.perf_counter() - t0
    pool = None
    try:
        pool = await asyncio.wait_for(pool_task, 300)
        log(f"AsyncLLM up in {startup_s:.1f} s (tp={tp}); {spec.n_train} trainers ({spec.train})")
        return {**await measure(engine, pool, spec, tp=tp, streams=streams, log=log, **options),
                "startup_s": startup_s}
    finally:
        if pool is not None:
            pool.close()
        engine.shutdown()


def run_vllm_overlap_bench(*, preset: str = "small", train: str = "tp=2", tp: int = 1, refits: int = 3,
                           dtype: str = "float32", bucket_bytes: int = 16 << 20, cpu_linear: str = "prepack",
                           streams: int = 4, phase_s: float = 1.0, max_tokens: int = 96, timeout_s: float = 300.0,
                           qwen3: dict[str, Any] | None = None, log=print) -> dict[str, Any]:
    """See the module docstring; ``refits`` of each path, alternating. Returns the JSON-ready result
    (the timelines of the first overlapped and the first paused refit under ``timelines``).
    ``qwen3``: a Hugging Face ``Qwen3Config``'s keyword arguments instead of ``preset``'s."""
    from policyworker.cli.vllm_bench import hf_kwargs, minimum_bytes

    if refits < 1:
        raise ConfigError("bench --engine vllm --overlap needs --refits >= 1 (refits of each path)")
    if qwen3 is not None:
        preset, kwargs, family = "custom", dict(qwen3), "qwen3"
    else:
        config = get_preset(preset)
        kwargs, family = hf_kwargs(config), config.family
    spec = WorldSpec(config=kwargs, model_type=family, dtype=dtype, train=train,
                     timeout_s=timeout_s, refit_timeout_s=timeout_s, reshard_options={"bucket_bytes": bucket_bytes})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    directory = tempfile.mkdtemp(prefix="policyworker-vllm-overlap-")
    try:
        path = os.path.join(directory, "model")
        save_hf_model(spec, 0, path)
        out = asyncio.run(_run(spec, path, tp=tp, refits=refits, streams=streams, phase_s=phase_s,
                               max_tokens=max_tokens, cpu_linear=cpu_linear, log=log))
    finally:
        gc.collect()  # the AsyncLLM (shut down) goes now, not at interpreter exit
        shutil.rmtree(directory, ignore_errors=True)
    need = minimum_bytes(hf_model(spec, 0), tp)
    if out["bytes_per_refit"] != need:
        raise PlanError(f"the plan moves {out['bytes_per_refit']} bytes a refit; vLLM's {tp} ranks need {need}")
    return {"engine": "vllm", "api": "AsyncLLM", "backend": "policyworker", "transport": "nccl_reshard",
            "device": "cpu", "comm": "gloo", "preset": preset, "dtype": dtype, "train": train, "vllm_tp": tp,
            "cpu_linear": cpu_linear, "bytes_minimum": need, "engine_startup_seconds": out["startup_s"],
            "refits_per_path": refits, **summarize(out, spec)}


def summarize(out: dict[str, Any], spec: WorldSpec) -> dict[str, Any]:
    """:func:`measure`'s rows with Hugging Face's verdict per commit, the per-path summary and
    the timelines of the first overlapped and the first paused refit (JSON-ready)."""
    rows, cold = out["rows"], out["cold"]
    for row in [cold, *rows]:  # the oracle, once the engine is down (HF needs the cores)
        row["tokens_match_hf"] = row["tokens"] == greedy_tokens(hf_model(spec, row["version"]), PROMPTS, CHECK_TOKENS)
    timelines = {}
    for mode in MODES:
        first = next(r for r in rows if r["mode"] == mode)
        timelines[mode] = {"version": first["version"], **first["_timeline"]}
    for row in [cold, *rows]:
        del row["_timeline"]
    med = statistics.median
    summary = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {
            "stall_ms_median": 1e3 * med(r["stall_seconds"] for r in mine),
            "stall_ms_max": 1e3 * max(r["stall_seconds"] for r in mine),
            "stall_excess_ms_max": 1e3 * max(r["stall_excess_seconds"] for r in mine),
            "forward_gap_ms_median": 1e3 * med(r["forward_gap_seconds"] for r in mine),
            "forward_gap_ms_max": 1e3 * max(r["forward_gap_seconds"] for r in mine),
            "refit_ms_median": 1e3 * med(r["refit_seconds"] for r in mine),
            "tokens_per_second_median": {ph: med(r["tokens_per_second"][ph] for r in mine)
                                         for ph in ("before", "during", "after")}}
    baseline = max(r["baseline_gap_max_seconds"] for r in rows)
    pooled = {kind: {"median_ms": med(r[kind]["median_ms"] for r in rows),
                     "p90_ms_max": max(r[kind]["p90_ms"] for r in rows),
                     "max_ms": max(r[kind]["max_ms"] for r in rows)}
              for kind in ("baseline_gaps", "baseline_forward_gaps")}
    return {
        "bytes_per_refit": out["bytes_per_refit"], "load_streams": out["streams"],
        "load_max_tokens": out["max_tokens"], "phase_seconds": out["phase_s"],
        "order": "alternating, overlap first in even rounds, paused first in odd ones",
        "stall_method": "longest gap between the end of one engine step (the worker's sample_tokens return) and the "
                        "start of the next (its execute_model call), vLLM worker's monotonic clock, among the gaps "
                        "overlapping the controller's start_weight_update call .. finish_weight_update return; "
                        "baseline: the same gaps in the phase before each refit (no refit running); excess: the "
                        "stall minus that refit's median baseline gap",
        "forward_gap_method": "the same between the end of one forward pass and the start of the next (includes "
                              "each step's logits and sampling)",
        "baseline": pooled,
        "cold_refit": cold, "refits": rows, "summary": summary,
        "baseline_gap_max_ms": 1e3 * baseline,
        "overlap_stall_goal_ms": 10.0, "overlap_stall_goal_met": summary["overlap"]["stall_ms_max"] <= 10.0,
        "tokens_match_hf": all(r["tokens_match_hf"] for r in [cold, *rows]),
        "timelines": timelines,
    }
