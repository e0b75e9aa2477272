"""``policyworker bench --engine vllm --staging MODE|all``: each staging mode's memory and refit time.

For each mode, a fresh vLLM engine (so no mode inherits another's allocations) is
refitted ``refits`` times by the same kind of trainer processes as ``bench --engine
vllm``. Inside vLLM's worker process (``collective_rpc``) it reads, around the refits:

* ``VmRSS`` once the engine is up (before the backend allocates anything), with the
  peak (``VmHWM``) reset there (``/proc/self/clear_refs``);
* ``VmHWM`` after ``init_weight_transfer_engine`` (the peak at init: the staging set, and
  the one-time check of every parameter through vLLM's loaders, which holds scratch
  copies of one parameter at a time), reset again there;
* ``VmRSS`` after the refits (steady) and ``VmHWM`` (the refits' peak);
* the backend's own ``staging_report`` (staging bytes it holds that nothing live reads).

Extra memory is the difference to the engine-up figure: the staging set, plus what
a refit allocates on the way (the transport's buckets, vLLM's post-processing). Refit
time is the controller's wall time of the three weight-update calls, as in the main
bench. After the last refit of every mode vLLM's greedy tokens must equal HF's.
"""

from __future__ import annotations

import gc
import os
import statistics
from typing import Any

from policyworker.cli.vllm_bench import PROMPTS, _Engine, hf_kwargs
from policyworker.errors import ConfigError
from policyworker.models.config import get_preset
from policyworker.testing.vllm_world import WorldSpec, greedy_tokens, hf_model

__all__ = ["MODES", "run_vllm_staging_bench"]

#: "none-torch": staging "none" with ``cpu_linear="torch"`` (the linear layers read the received
#: tensors as they are, so every box lands in place; plain "none" prepacks them layer by layer).
MODES = ("device", "host", "none", "none-torch")


def _memory(worker: Any, reset: bool = False) -> dict[str, Any]:
    """Run in vLLM's worker (``collective_rpc``): its RSS and peak RSS (bytes), the staging report."""
    gc.collect()
    out: dict[str, Any] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)
    engine = getattr(worker, "weight_transfer_engine", None)
    out["report"] = getattr(engine, "staging_report", None)
    return out


def _one_mode(mode: str, spec: WorldSpec, *, tp: int, refits: int, executor: str, log) -> dict[str, Any]:
    engine = _Engine(spec, tp=tp, log=log, executor=executor)
    try:
        base = engine.llm.collective_rpc(_memory, kwargs={"reset": True})
        staging, _, cpu_linear = mode.partition("-")
        engine.connect(version=0, staging=staging, **({"cpu_linear": cpu_linear} if cpu_linear else {}))
        connected = engine.llm.collective_rpc(_memory, kwargs={"reset": True})  # the refits' peak from here
        rows = [engine.refit(v) for v in range(1, refits + 1)]
        after = engine.llm.collective_rpc(_memory)
        match = engine.tokens() == greedy_tokens(hf_model(spec, refits), PROMPTS, 8)
    finally:
        engine.close()
    report = after[0]["report"]
    if report is None or report["mode"] != mode.partition("-")[0]:
        raise ConfigError(f"the engine staged with {report and report['mode']!r}, the bench asked for {mode!r}")
    steady = [r["seconds"] for r in rows[1:]]
    out = {
        "mode": mode, "reason": report["reason"], "set_bytes": report["set_bytes"],
        "backend_extra_bytes_steady": report["extra_bytes_steady"],
        "backend_extra_bytes_peak": report["extra_bytes_peak"], "backend_extra_where": report["where"],
        "rss_engine_up_bytes": [m["VmRSS"] for m in base], "rss_after_refits_bytes": [m["VmRSS"] for m in after],
        "rss_extra_steady_bytes": max(a["VmRSS"] - b["VmRSS"] for a, b in zip(after, base)),
        "rss_extra_peak_bytes": max(max(a["VmHWM"], c["VmHWM"]) - b["VmRSS"] for a, b, c in zip(after, base, connected)),
        "rss_extra_peak_connect_bytes": max(c["VmHWM"] - b["VmRSS"] for c, b in zip(connected, base)),
        "rss_extra_peak_refits_bytes": max(a["VmHWM"] - b["VmRSS"] for a, b in zip(after, base)),
        "refits": rows, "refit_seconds_median": statistics.median(steady),
        "apply_seconds_median": statistics.median(r["apply_seconds"] for r in rows[1:]),
        "cold_refit_seconds": rows[0]["seconds"], "tokens_match_hf": match,
    }
    log(f"staging={mode}: +{out['rss_extra_steady_bytes'] / 1e6:.0f} MB steady, +{out['rss_extra_peak_bytes'] / 1e6:.0f} "
        f"MB peak (at init +{out['rss_extra_peak_connect_bytes'] / 1e6:.0f}, in the refits "
        f"+{out['rss_extra_peak_refits_bytes'] / 1e6:.0f}; worker RSS; backend holds {out['backend_extra_bytes_steady'] / 1e6:.0f} MB of a "
        f"{out['set_bytes'] / 1e6:.0f} MB set); refit {out['refit_seconds_median']:.3f} s; tokens == HF: {match}")
    return out


def run_vllm_staging_bench(*, modes: str = "all", preset: str = "small", train: str = "tp=2", tp: int = 1,
                           refits: int = 3, dtype: str = "float32", bucket_bytes: int = 16 << 20,
                           executor: str = "mp", timeout_s: float = 300.0, log=print) -> dict[str, Any]:
    """See the module docstring; ``modes``: one of :data:`MODES` or ``"all"``."""
    chosen = MODES if modes == "all" else (modes,)
    if any(m not in MODES for m in chosen):
        raise ConfigError(f"--staging must be one of {', '.join(MODES)} or all, got {modes!r}")
    if refits < 2:
        raise ConfigError("bench --staging needs --refits >= 2 (the first refit is cold, reported apart)")
    if executor != "mp":
        raise ConfigError("bench --staging measures vLLM's worker process: use --vllm-executor mp")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (mp executor)
    config = get_preset(preset)
    spec = WorldSpec(config=hf_kwargs(config), model_type=config.family, dtype=dtype, train=train,
                     timeout_s=timeout_s, refit_timeout_s=timeout_s, reshard_options={"bucket_bytes": bucket_bytes})
    rows = [_one_mode(m, spec, tp=tp, refits=refits, executor=executor, log=log) for m in chosen]
    return {"engine": "vllm", "bench": "staging", "device": "cpu", "preset": preset, "dtype": dtype, "train": train,
            "vllm_tp": tp, "refits_per_mode": refits, "bucket_bytes": bucket_bytes,
            "memory_method": "vLLM worker process: VmRSS once the engine is up (VmHWM reset there via "
                             "/proc/self/clear_refs) vs VmHWM after init_weight_transfer_engine (peak at init; "
                             "reset again), VmRSS after the refits (steady) and VmHWM (the refits' peak); max over "
                             "ranks; plus the backend's staging_report",
            "modes": rows, "tokens_match_hf": all(r["tokens_match_hf"] for r in rows)}
