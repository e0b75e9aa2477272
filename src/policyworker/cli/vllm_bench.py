"""``policyworker demo --engine vllm`` and ``policyworker bench --engine vllm``.

Both run a real vLLM engine (``LLM`` with ``weight_transfer_config={"backend":
"policyworker"}``) in this process and trainer processes (``TorchPolicyWorker`` over a
Hugging Face Qwen3, or Qwen3-MoE for an MoE preset such as ``small-moe``, built locally)
that refit it with new weights each round. The plan must move exactly the bytes vLLM's
ranks need (``bytes_minimum``), else the bench fails.

The bench measures, in the same run:

* **refit**: the controller's wall time of ``start_weight_update`` → ``update_weights``
  → ``finish_weight_update`` (the trainers send concurrently); ``transfer`` is the
  ``update_weights`` part (bytes on the wire + the verdict), ``apply`` the commit
  (each layer's own vLLM post-processing on a staged copy, then the swap);
* **ceiling**: plain gloo sends of exactly the plan's bytes, from the same trainer
  processes to a receiver per vLLM rank (in this process), all pairs at once;
* **checkpoint**: what users do without a sync library — trainer rank 0 saves a
  safetensors checkpoint (``save_pretrained``) and vLLM reloads it through its own
  loader (``collective_rpc("reload_weights", weights_path=...)``).

After the last refit vLLM's greedy tokens are compared with Hugging Face's on the same
weights (``tokens_match_hf``; exact in float32).
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
from policyworker.errors import ConfigError, PlanError
from policyworker.models.config import ModelConfig, get_preset
from policyworker.testing.vllm_world import (TrainerPool, WorldSpec, greedy_tokens, hf_model, save_hf_model,
                                             shutdown_llm)

__all__ = ["hf_kwargs", "run_vllm_bench", "run_vllm_demo"]

PROMPTS = [[1, 2, 3, 4], [100, 7, 8, 9, 11]]


def hf_kwargs(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face ``Qwen3Config``'s (``Qwen3MoeConfig``'s) keyword arguments for a qwen3
    (qwen3_moe, every layer sparse, no shared expert) preset."""
    moe = config.family == "qwen3_moe" and config.is_moe and not config.first_k_dense \
        and not config.num_shared_experts
    if config.family != "qwen3" and not moe:
        raise ValueError(f"the vLLM bench builds Qwen3 and Qwen3-MoE models; {config.name!r} is {config.family}"
                         f"{' with dense layers or shared experts' if config.is_moe else ''}")
    out = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
               intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
               num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
               head_dim=config.head_dim, tie_word_embeddings=config.tie_word_embeddings,
               rope_theta=config.rope_theta, max_position_embeddings=512, initializer_range=0.2)
    if moe:
        out.update(num_experts=config.num_experts, moe_intermediate_size=config.moe_intermediate_size,
                   num_experts_per_tok=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob)
    return out


def minimum_bytes(model: Any, tp: int) -> int:
    """The bytes one vLLM engine of ``tp`` ranks needs per refit: every parameter of the
    Hugging Face ``model`` once, and what each rank holds whole (norms, the MoE router)
    once more per further rank."""
    total = 0
    for name, p in model.named_parameters():
        whole = name.endswith("norm.weight") or name.endswith("mlp.gate.weight")
        total += p.numel() * p.element_size() * (tp if whole else 1)
    return total


def _await_background_prepack(worker: Any, timeout_s: float = 60.0) -> int:
    """Run in each vLLM worker (``collective_rpc``): wait for the background prepack; layers it installed."""
    engine = getattr(worker, "weight_transfer_engine", None)
    stage = getattr(engine, "_stage", None)
    if stage is None:
        return 0
    if not stage.prepack.wait(timeout_s):
        raise TimeoutError(f"the background prepack did not finish in {timeout_s} s")
    return stage.prepack.installed


class _Engine:
    """The controller's side: the LLM plus the trainer pool."""

    def __init__(self, spec: WorldSpec, *, tp: int, log, executor: str = "mp", cpu_linear: str = "prepack",
                 llm_kwargs: dict[str, Any] | None = None) -> None:
        if executor not in ("mp", "uni") or (executor == "uni" and tp != 1):
            raise ConfigError(f"vLLM executor {executor!r} with tp={tp}: 'mp' (any tp) or 'uni' (tp=1)")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                    for i in range(tp)))
        extra: dict[str, Any] = {}
        if executor == "uni":
            # vLLM's worker in this process: no engine-core process, whose reader of the
            # workers' replies busy-polls (sched_yield) through every long call — on a
            # 2-core host that takes a core away from the refit for its whole duration.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            extra["distributed_executor_backend"] = "uni"
        if cpu_linear == "background" and executor == "mp":
            # The bench waits for each background prepack before its next ceiling round
            # (collective_rpc with a function: vLLM's mp executor pickles it only then).
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        self.spec, self.tp, self.log, self.executor, self.cpu_linear = spec, tp, log, executor, cpu_linear
        self.dir = tempfile.mkdtemp(prefix="policyworker-vllm-")
        self.path = os.path.join(self.dir, "model")
        try:
            save_hf_model(spec, 0, self.path)
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                pool = ex.submit(TrainerPool, spec)
                from vllm import LLM

                t0 = time.perf_counter()
                self.llm = LLM(self.path, skip_tokenizer_init=True, tensor_parallel_size=tp, dtype=spec.dtype,
                               enforce_eager=True, max_model_len=128, max_num_seqs=4, seed=0,
                               **{"weight_transfer_config": {"backend": "policyworker"}, **extra,
                                  **(llm_kwargs or {})})
                self.startup_s = time.perf_counter() - t0
                self.pool = pool.result(timeout=300)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        log(f"vLLM engine up in {self.startup_s:.1f} s (tp={tp}); {spec.n_train} trainers ({spec.train})")

    def tokens(self) -> list[list[int]]:
        from vllm import SamplingParams

        outs = self.llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def settle(self) -> list[int] | None:
        """``cpu_linear="background"``: wait until every rank's prepack ended; layers installed per rank."""
        if self.cpu_linear != "background":
            return None
        return list(self.llm.collective_rpc(_await_background_prepack, kwargs={"timeout_s": 60.0}))

    def connect(self, version: int, **init: Any) -> list[dict[str, Any]]:
        info = {**self.pool.connect(gen_world_size=self.tp, version=version), **init}
        self.llm.init_weight_transfer_engine({"init_info": info})
        replies = self.pool.replies(self.spec.timeout_s)
        bad = [r for r in replies if not r["ok"]]
        if bad:
            raise RuntimeError(f"trainers failed to connect: {bad}")
        return replies

    def load(self, version: int, ranks: list[int] | None = None) -> None:
        """Trainers take version ``version``'s weights (outside every timed span)."""
        self.pool.send({"cmd": "load", "version": version}, ranks)
        bad = [r for r in self.pool.replies(self.spec.timeout_s, ranks) if not r["ok"]]
        if bad:
            raise RuntimeError(f"trainers failed to load version {version}: {bad}")

    def refit(self, version: int, load: bool = True) -> dict[str, Any]:
        if load:
            self.load(version)
        self.pool.send({"cmd": "refit", "version": version, "load": False})
        t0 = time.perf_counter()
        self.llm.start_weight_update()
        t1 = time.perf_counter()
        self.llm.update_weights({"update_info": {"version": version}})
        t2 = time.perf_counter()
        self.llm.finish_weight_update(weight_version=str(version))
        t3 = time.perf_counter()
        self.llm.reset_prefix_cache()
        replies = self.pool.replies(self.spec.refit_timeout_s)
        bad = [r for r in replies if not r["ok"]]
        if bad:
            raise RuntimeError(f"trainers failed refit {version}: {bad}")
        return {"version": version, "seconds": t3 - t0, "start_seconds": t1 - t0, "transfer_seconds": t2 - t1,
                "apply_seconds": t3 - t2, "trainer_send_seconds": max(r["seconds"] for r in replies)}

    def ceiling(self, send_bytes: list[dict[int, int]], rounds: int) -> list[float]:
        """Wall seconds per round of plain gloo sends of the plan's bytes (slowest receiver)."""
        import torch

        from policyworker.runtime.comm import new_group
        from policyworker.runtime.procs import free_port

        n_train = self.spec.n_train
        port, world = free_port(), n_train + self.tp
        self.pool.send({"cmd": "ceiling", "port": port, "world_size": world, "n_train": n_train, "rounds": rounds})

        def receiver(g: int) -> list[float]:
            bufs = [(r, torch.ones(sb[g], dtype=torch.uint8)) for r, sb in enumerate(send_bytes) if sb.get(g)]
            group = new_group(host="127.0.0.1", port=port, rank=n_train + g, world_size=world, name="ceiling",
                              timeout_s=self.spec.timeout_s)
            try:
                out = []
                for _ in range(rounds):
                    group.barrier()
                    t0 = time.perf_counter()
                    group.wait_all([group.irecv(b, r) for r, b in bufs])
                    out.append(time.perf_counter() - t0)
                return out
            finally:
                group.close()

        with concurrent.futures.ThreadPoolExecutor(self.tp) as ex:
            per_rank = list(ex.map(receiver, range(self.tp)))
        trainer = [r["seconds"] for r in self.pool.replies(self.spec.timeout_s)]
        return [max(vals) for vals in zip(*per_rank, *trainer)]

    def checkpoint_round(self, version: int) -> dict[str, float]:
        """Trainer 0 saves a safetensors checkpoint of ``version``; vLLM reloads it from disk."""
        path = os.path.join(self.dir, f"ckpt-{version}")
        self.load(version, [0])
        self.pool.send({"cmd": "save", "path": path}, [0])
        save = self.pool.reply(0, self.spec.timeout_s)
        if not save["ok"]:
            raise RuntimeError(f"trainer 0 failed to save checkpoint {version}: {save}")
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        reload_s = time.perf_counter() - t0
        self.llm.reset_prefix_cache()
        shutil.rmtree(path, ignore_errors=True)  # a checkpoint of the bench model per round: not kept
        return {"save_seconds": save["seconds"], "reload_seconds": reload_s, "seconds": save["seconds"] + reload_s}

    def close(self) -> None:
        try:
            self.pool.close()
            shutdown_llm(self.llm)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)  # the model and any checkpoint left


def run_vllm_bench(*, preset: str = "small", train: str = "tp=2", tp: int = 1, refits: int = 3,
                   dtype: str = "float32", bucket_bytes: int = 16 << 20, executor: str = "mp",
                   cpu_linear: str = "prepack", timeout_s: float = 300.0, log=print) -> dict[str, Any]:
    """See the module docstring; returns the JSON-ready result.

    Ceiling and refit are interleaved (one ceiling round right before each refit, in the
    same processes); ratios are medians of the per-pair ``ceiling_s / refit_s`` over the
    steady refits (the first, cold one is reported apart).
    """
    if refits < 2:
        raise ConfigError("bench --engine vllm needs --refits >= 2 (the first refit is cold, reported apart)")
    config = get_preset(preset)
    spec = WorldSpec(config=hf_kwargs(config), model_type=config.family, dtype=dtype, train=train,
                     timeout_s=timeout_s, refit_timeout_s=timeout_s, reshard_options={"bucket_bytes": bucket_bytes})
    need = minimum_bytes(hf_model(spec, 0), tp)
    engine = _Engine(spec, tp=tp, log=log, executor=executor, cpu_linear=cpu_linear)
    try:
        replies = engine.connect(version=0, cpu_linear=cpu_linear)
        total = replies[0]["total_bytes"]
        if total != need:
            raise PlanError(f"the plan moves {total} bytes a refit; vLLM's {tp} ranks need {need}")
        send_bytes = [r["send_bytes"] for r in replies]
        rows, ckpt = [], []
        for version in range(1, refits + 1):
            engine.load(version)
            ceiling_s = engine.ceiling(send_bytes, 1)[0]
            row = engine.refit(version, load=False)
            t0 = time.perf_counter()
            installed = engine.settle()
            if installed is not None:  # after the refit was timed: vLLM served the new weights already
                row.update(background_prepack_layers=installed, background_prepack_wait_seconds=time.perf_counter() - t0)
            row.update(ceiling_seconds=ceiling_s, ratio_to_ceiling=ceiling_s / row["seconds"],
                       transfer_ratio_to_ceiling=ceiling_s / row["transfer_seconds"], cold=version == 1)
            rows.append(row)
            log(f"refit {version}: {row['seconds']:.3f} s (transfer {row['transfer_seconds']:.3f} s, "
                f"apply {row['apply_seconds']:.3f} s); ceiling right before it {ceiling_s:.3f} s: "
                f"{row['ratio_to_ceiling']:.2f} x{' (cold)' if version == 1 else ''}")
        tokens = engine.tokens()
        match = tokens == greedy_tokens(hf_model(spec, refits), PROMPTS, 8)
        engine.settle()
        generate_s = []
        for _ in range(3):
            t0 = time.perf_counter()
            engine.tokens()
            generate_s.append(time.perf_counter() - t0)
        for i in range(refits):
            ckpt.append(engine.checkpoint_round(refits + 1 + i))
            log(f"checkpoint round {i + 1}: save {ckpt[-1]['save_seconds']:.3f} s + vLLM reload "
                f"{ckpt[-1]['reload_seconds']:.3f} s")
        reload_match = engine.tokens() == greedy_tokens(hf_model(spec, 2 * refits), PROMPTS, 8)
    finally:
        engine.close()
    med = statistics.median
    steady = [r for r in rows if not r["cold"]]
    ceiling_s = [r["ceiling_seconds"] for r in steady]
    ceiling_gbps = total / med(ceiling_s) / 1e9
    refit_s, transfer_s = med(r["seconds"] for r in steady), med(r["transfer_seconds"] for r in steady)
    ckpt_s = med(c["seconds"] for c in ckpt)
    ratios = [r["ratio_to_ceiling"] for r in steady]
    return {
        "engine": "vllm", "backend": "policyworker", "transport": "nccl_reshard", "device": "cpu",
        "comm": "gloo", "preset": preset, "dtype": dtype, "train": train, "vllm_tp": tp,
        "vllm_executor": executor, "cpu_linear": cpu_linear,
        "bytes_per_refit": total, "bytes_minimum": need, "moe": config.is_moe, "bucket_bytes": bucket_bytes, "engine_startup_seconds": engine.startup_s,
        "refits": rows, "ceiling_seconds": ceiling_s, "ceiling_gbps": ceiling_gbps,
        "refit_seconds_median": refit_s, "refit_gbps": total / refit_s / 1e9,
        "transfer_seconds_median": transfer_s, "transfer_gbps": total / transfer_s / 1e9,
        "ratio_to_ceiling": med(ratios), "ratio_spread": ratio_spread(ratios),
        "ratio_method": "median over steady (ceiling, refit) pairs of ceiling_s / refit_s; one ceiling round "
                        "right before each refit, same processes; the cold first refit excluded",
        "transfer_ratio_to_ceiling": med(r["transfer_ratio_to_ceiling"] for r in steady),
        "cold_refit": rows[0],
        "checkpoint_reload": ckpt, "checkpoint_seconds_median": ckpt_s,
        "speedup_over_checkpoint": ckpt_s / refit_s,
        "generate_seconds_median": med(generate_s),
        "tokens_match_hf": match, "checkpoint_tokens_match_hf": reload_match,
    }


def run_vllm_demo(*, refits: int = 3, log=print) -> dict[str, Any]:
    """Tiny Qwen3, 2 trainers (tp=2) -> vLLM tp=1; after each refit vLLM's tokens vs HF's."""
    config = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                  initializer_range=0.2)
    spec = WorldSpec(config=config, timeout_s=60.0, refit_timeout_s=60.0)
    engine = _Engine(spec, tp=1, log=log)
    rows = []
    try:
        engine.connect(version=0)
        for version in range(1, refits + 1):
            row = engine.refit(version)
            got, want = engine.tokens(), greedy_tokens(hf_model(spec, version), PROMPTS, 8)
            row.update(tokens=got, tokens_match_hf=got == want, weight_version=engine.llm.get_weight_version())
            rows.append(row)
            log(f"refit {version}: {row['seconds'] * 1e3:.0f} ms, vLLM weight_version={row['weight_version']}, "
                f"greedy tokens {'==' if row['tokens_match_hf'] else '!='} Hugging Face's: {got[0]}")
    finally:
        engine.close()
    return {"engine": "vllm", "refits": rows, "passed": all(r["tokens_match_hf"] for r in rows)}
