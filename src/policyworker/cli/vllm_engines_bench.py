"""``policyworker bench --engine vllm --engines 2``: two vLLM engines on one update group
against one engine, same trainers, same run.

Two real vLLM engines (``LLM``, tp=1 each, backend ``"policyworker"``) run in this
process beside the trainer processes. Each round, back to back:

* **one**: the trainers and engine A form an update group of one generation rank and
  refit A (the model's bytes once);
* **two**: the trainers and engines A and B (``rank_offset`` 0 and 1, ``gen_world_size``
  2) form a group and refit both together (each engine receives the whole model, so the
  bytes double).

The figure is the time per byte moved, two engines over one: ``(two_s / two_bytes) /
(one_s / one_bytes)``, the median over the steady rounds (the first, cold round apart).
Each group is formed afresh before its refit (outside the timed span), as a controller
re-forms groups when engines come and go. After the last round both engines' greedy tokens
are compared with Hugging Face's on the same weights (exact in float32).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from policyworker.cli.output import ratio_spread
from policyworker.cli.vllm_bench import PROMPTS, hf_kwargs, minimum_bytes
from policyworker.errors import ConfigError, PlanError
from policyworker.models.config import get_preset
from policyworker.testing.vllm_world import (TrainerPool, WorldSpec, greedy_tokens, hf_model, save_hf_model,
                                             shutdown_llm)

__all__ = ["run_vllm_engines_bench"]


class _Engines:
    """The controller: two LLMs plus the trainer pool."""

    def __init__(self, spec: WorldSpec, log) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.spec, self.log = spec, log
        self.dir = tempfile.mkdtemp(prefix="policyworker-vllm2-")
        self.llms: list[Any] = []
        self.pool: TrainerPool | None = None
        self.ex = concurrent.futures.ThreadPoolExecutor(2)
        try:
            path = os.path.join(self.dir, "model")
            save_hf_model(spec, 0, path)
            pool = self.ex.submit(TrainerPool, spec)
            from vllm import LLM

            for e in range(2):
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(e % (os.cpu_count() or 1))
                self.llms.append(LLM(path, skip_tokenizer_init=True, tensor_parallel_size=1, dtype=spec.dtype,
                                     enforce_eager=True, max_model_len=128, max_num_seqs=4, seed=0,
                                     weight_transfer_config={"backend": "policyworker"}))
            self.pool = pool.result(timeout=300)
        except BaseException:
            self.close()
            raise
        log(f"two vLLM engines up (tp=1 each); {spec.n_train} trainers ({spec.train})")

    def connect(self, version: int, engines: list[int]) -> list[dict[str, Any]]:
        n = len(engines)
        info = self.pool.connect(gen_world_size=n, version=version)
        futs = [self.ex.submit(self.llms[e].init_weight_transfer_engine,
                               {"init_info": {**info, "rank_offset": g, "gen_world_size": n}})
                for g, e in enumerate(engines)]
        replies = self.pool.replies(self.spec.timeout_s)
        for f in futs:
            f.result(timeout=self.spec.timeout_s)
        bad = [r for r in replies if not r["ok"]]
        if bad:
            raise RuntimeError(f"trainers failed to connect: {bad}")
        return replies

    def _update(self, e: int, version: int) -> dict[str, float]:
        llm = self.llms[e]
        t0 = time.perf_counter()
        llm.start_weight_update()
        t1 = time.perf_counter()
        llm.update_weights({"update_info": {"version": version}})
        t2 = time.perf_counter()
        llm.finish_weight_update(weight_version=str(version))
        t3 = time.perf_counter()
        return {"start_seconds": t1 - t0, "transfer_seconds": t2 - t1, "apply_seconds": t3 - t2}

    def refit(self, version: int, engines: list[int]) -> dict[str, Any]:
        """Load ``version`` into the trainers (untimed), then one timed refit into ``engines``."""
        self.pool.send({"cmd": "load", "version": version})
        bad = [r for r in self.pool.replies(self.spec.timeout_s) if not r["ok"]]
        if bad:
            raise RuntimeError(f"trainers failed to load version {version}: {bad}")
        self.pool.send({"cmd": "refit", "version": version, "load": False})
        t0 = time.perf_counter()
        futs = [self.ex.submit(self._update, e, version) for e in engines]
        per_engine = [f.result(timeout=self.spec.refit_timeout_s) for f in futs]
        seconds = time.perf_counter() - t0
        for e in engines:
            self.llms[e].reset_prefix_cache()
        replies = self.pool.replies(self.spec.refit_timeout_s)
        bad = [r for r in replies if not r["ok"]]
        if bad:
            raise RuntimeError(f"trainers failed refit {version}: {bad}")
        return {"version": version, "engines": len(engines), "seconds": seconds,
                "bytes": sum(r["bytes"] for r in replies), "per_engine": per_engine,
                "trainer_send_seconds": max(r["seconds"] for r in replies)}

    def tokens(self, e: int) -> list[list[int]]:
        from vllm import SamplingParams

        outs = self.llms[e].generate([{"prompt_token_ids": p} for p in PROMPTS],
                                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        try:
            self.ex.shutdown(wait=False, cancel_futures=True)
            if self.pool is not None:
                self.pool.close()
            for llm in self.llms:
                shutdown_llm(llm)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def run_vllm_engines_bench(*, preset: str = "small", train: str = "tp=2", rounds: int = 3, dtype: str = "float32",
                           bucket_bytes: int = 16 << 20, timeout_s: float = 300.0, log=print) -> dict[str, Any]:
    """See the module docstring; returns the JSON-ready result."""
    if rounds < 2:
        raise ConfigError("bench --engine vllm --engines 2 needs --refits >= 2 (the first round is cold, "
                          "reported apart)")
    config = get_preset(preset)
    spec = WorldSpec(config=hf_kwargs(config), model_type=config.family, dtype=dtype, train=train,
                     timeout_s=timeout_s, refit_timeout_s=timeout_s, reshard_options={"bucket_bytes": bucket_bytes})
    need = minimum_bytes(hf_model(spec, 0), 1)
    world = _Engines(spec, log)
    rows: list[dict[str, Any]] = []
    version = 0
    try:
        for r in range(rounds):
            for engines in ([0], [0, 1]):
                sends = world.connect(version, engines)
                total = sends[0]["total_bytes"]
                if total != need * len(engines):
                    raise PlanError(f"the plan moves {total} bytes a refit; {len(engines)} engine(s) of tp=1 "
                                    f"need {need * len(engines)}")
                version += 1
                row = world.refit(version, engines)
                if row["bytes"] != total:
                    raise PlanError(f"refit {version} moved {row['bytes']} bytes, the plan {total}")
                row["cold"] = r == 0
                rows.append(row)
                parts = "; ".join(f"transfer {p['transfer_seconds']:.3f} s, apply {p['apply_seconds']:.3f} s"
                                  for p in row["per_engine"])
                log(f"round {r + 1}, {len(engines)} engine(s): refit {version} {row['seconds']:.3f} s, "
                    f"{row['bytes'] / 1e6:.1f} MB ({parts}){' (cold)' if r == 0 else ''}")
        want = greedy_tokens(hf_model(spec, version), PROMPTS, 8)
        match = [world.tokens(e) == want for e in (0, 1)]
    finally:
        world.close()
    med = statistics.median
    ones = [x for x in rows if x["engines"] == 1 and not x["cold"]]
    twos = [x for x in rows if x["engines"] == 2 and not x["cold"]]
    # Pairs: each steady round's one-engine refit with the two-engine refit right after it.
    ratios = [(b["seconds"] / b["bytes"]) / (a["seconds"] / a["bytes"]) for a, b in zip(ones, twos)]
    return {
        "engine": "vllm", "backend": "policyworker", "transport": "nccl_reshard", "device": "cpu", "comm": "gloo",
        "preset": preset, "dtype": dtype, "train": train, "vllm_tp": 1, "engines": 2,
        "bytes_per_engine": need, "bucket_bytes": bucket_bytes, "refits": rows,
        "one_engine_seconds_median": med(x["seconds"] for x in ones),
        "two_engines_seconds_median": med(x["seconds"] for x in twos),
        "per_byte_ratio_two_vs_one": med(ratios), "ratio_spread": ratio_spread(ratios),
        "ratio_method": "median over steady rounds of (two_s / two_bytes) / (one_s / one_bytes); per round the "
                        "one-engine refit, then the two-engine refit; the cold first round excluded",
        "goal": {"per_byte_ratio_le_1.2": med(ratios) <= 1.2},
        "tokens_match_hf": all(match), "tokens_match_hf_per_engine": match,
    }
