"""``policyworker bench --engine vllm --lora RANK``: adapter refits against full refits, same run.

Two vLLM engines, one after the other, on the same bench model (a Qwen3 preset) and the
same trainer layout:

* **full**: the dense backend refits the whole model (what a LoRA run without an adapter
  path does: merge, then move every weight), ``refits`` times;
* **lora**: a LoRA-enabled engine with backend ``"policyworker-lora"``; the trainers
  (``LoraPolicyWorker`` over PEFT, rank ``RANK`` on q/k/v/o and the MLP) refit only the
  adapter, ``refits`` times. ``install_seconds`` is vLLM's own adapter install inside
  ``finish_weight_update`` (``LoRAModel`` built from the received factors, registered and
  activated), apart from the wire.

Seconds are the controller's wall time of ``start_weight_update`` → ``update_weights`` →
``finish_weight_update``; medians over the steady refits (the first, cold one apart).
After the last adapter refit vLLM's greedy tokens with the adapter are compared with
Hugging Face PEFT's (``tokens_match_peft``; exact in float32).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from policyworker.errors import ConfigError
from policyworker.models.config import get_preset
from policyworker.cli.vllm_bench import PROMPTS, _Engine, hf_kwargs
from policyworker.testing.vllm_world import WorldSpec, greedy_tokens

__all__ = ["run_vllm_lora_bench"]


def _install_seconds(worker: Any) -> float | None:
    """Run in each vLLM worker (``collective_rpc``): the last commit's adapter install time."""
    return getattr(getattr(worker, "weight_transfer_engine", None), "last_install_s", None)


def _rounds(engine: _Engine, refits: int, log, what: str, after=None) -> list[dict[str, Any]]:
    rows = []
    for version in range(1, refits + 1):
        row = engine.refit(version)
        row["cold"] = version == 1
        if after is not None:
            row.update(after())
        rows.append(row)
        install = f", install {row['install_seconds']:.4f} s" if "install_seconds" in row else ""
        log(f"{what} refit {version}: {row['seconds']:.3f} s (transfer {row['transfer_seconds']:.3f} s, "
            f"apply {row['apply_seconds']:.3f} s{install}){' (cold)' if version == 1 else ''}")
    return rows


def run_vllm_lora_bench(*, rank: int = 16, preset: str = "small", train: str = "tp=2", refits: int = 4,
                        dtype: str = "float32", bucket_bytes: int = 16 << 20, timeout_s: float = 300.0,
                        executor: str = "mp", log=print) -> dict[str, Any]:
    """See the module docstring; returns the JSON-ready result (ConfigError on bad arguments)."""
    from policyworker.integrations.vllm.lora import BACKEND_LORA, lora_request
    from policyworker.testing.vllm_lora_world import LoraWorldSpec, peft_model

    if refits < 2:
        raise ConfigError("bench --engine vllm --lora needs --refits >= 2 (the first refit is cold, reported apart)")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"--lora must be a LoRA rank >= 1, got {rank!r}")
    config = hf_kwargs(get_preset(preset))
    options = {"bucket_bytes": bucket_bytes}
    med = statistics.median

    full_spec = WorldSpec(config=config, dtype=dtype, train=train, timeout_s=timeout_s, refit_timeout_s=timeout_s,
                          reshard_options=options)
    engine = _Engine(full_spec, tp=1, log=log, executor=executor)
    try:
        full_bytes = engine.connect(version=0)[0]["total_bytes"]
        full = _rounds(engine, refits, log, "full")
    finally:
        engine.close()

    # The install time is read in the worker through collective_rpc with a function.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    lora_spec = LoraWorldSpec(config=config, dtype=dtype, train=train, timeout_s=timeout_s,
                              refit_timeout_s=timeout_s, reshard_options=options, r=rank, alpha=2.0 * rank)
    engine = _Engine(lora_spec, tp=1, log=log, executor=executor, llm_kwargs={
        "weight_transfer_config": {"backend": BACKEND_LORA}, "enable_lora": True, "max_lora_rank": rank,
        "max_loras": 1})
    try:
        replies = engine.connect(version=0)
        lora_bytes = replies[0]["total_bytes"]
        lora = _rounds(engine, refits, log, "lora",
                       after=lambda: {"install_seconds": max(engine.llm.collective_rpc(_install_seconds))})
        from vllm import SamplingParams

        t0 = time.perf_counter()
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                                   lora_request=lora_request())
        generate_s = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        oracle = peft_model(lora_spec, refits)
        match = tokens == greedy_tokens(oracle, PROMPTS, 8)
        adapter_bytes = sum(p.numel() * p.element_size() for n, p in oracle.named_parameters() if ".lora_" in n)
    finally:
        engine.close()

    steady_full = [r for r in full if not r["cold"]]
    steady_lora = [r for r in lora if not r["cold"]]
    full_s, lora_s = med(r["seconds"] for r in steady_full), med(r["seconds"] for r in steady_lora)
    ratio = lora_s / full_s
    log(f"rank-{rank} adapter: {lora_bytes} B in {lora_s:.3f} s; full model: {full_bytes} B in {full_s:.3f} s; "
        f"ratio {ratio:.3f} (goal <= 0.1)")
    return {
        "engine": "vllm", "backend": BACKEND_LORA, "transport": "nccl_reshard", "device": "cpu", "comm": "gloo",
        "preset": preset, "dtype": dtype, "train": train, "vllm_tp": 1, "vllm_executor": executor, "lora_rank": rank,
        "bucket_bytes": bucket_bytes,
        "adapter_bytes": adapter_bytes, "lora_bytes_per_refit": lora_bytes,
        "bytes_equal_adapter": lora_bytes == adapter_bytes,
        "full_bytes_per_refit": full_bytes, "bytes_ratio": lora_bytes / full_bytes,
        "lora_refits": lora, "full_refits": full,
        "lora_refit_seconds_median": lora_s, "full_refit_seconds_median": full_s,
        "lora_transfer_seconds_median": med(r["transfer_seconds"] for r in steady_lora),
        "lora_apply_seconds_median": med(r["apply_seconds"] for r in steady_lora),
        "lora_install_seconds_median": med(r["install_seconds"] for r in steady_lora),
        "time_ratio_lora_to_full": ratio, "goal_ratio": 0.1, "goal_met": ratio <= 0.1 and lora_bytes == adapter_bytes,
        "ratio_method": "median of steady refits (the cold first refit excluded), each engine alone, same run",
        "generate_seconds": generate_s, "tokens_match_peft": match,
    }
