"""LoRA adapter refits into RolloutWorkers: trainers tp=2 (real processes, gloo), rollouts tp=1 and tp=2.

Each rollout checks, after every commit, its factors bit for bit against its shard of
the adapter (unmerged), and its merged weights ``W0 + s·B·A`` against Hugging Face
PEFT's own merge (``merge_and_unload``) of the same adapter (float32: bit for bit).
Also: the rules' placement of the factors, the plan's bytes (the adapter's, each byte
once), the base hash against the checkpoint's, and the bf16 merge bound.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

pytest.importorskip("peft")

from policyworker import PolicyWorkerError, RolloutWorker  # noqa: E402
from policyworker.runtime.procs import free_port, run_world  # noqa: E402
from policyworker.errors import ConfigError, PlanMismatch  # noqa: E402
from policyworker.integrations.peft import (  # noqa: E402
    LoraMerger, LoraPolicyWorker, adapter_tensors, base_hash, base_tensors, lora_meta, lora_plan, merge_lora,
    tensor_hash)
from policyworker.integrations.vllm.lora_plan import LoraEngineInfo, check_engines, plan_for_vllm_lora  # noqa: E402
from policyworker.testing.vllm_lora_world import LoraWorldSpec, adapter_weights, peft_model  # noqa: E402
from policyworker.layout import dest_shards  # noqa: E402
from policyworker.layout.rules import match_rule  # noqa: E402
from policyworker.models import ModelConfig  # noqa: E402

from .helpers import same_bits  # noqa: E402

CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.2)
N_TRAIN, REFITS = 2, 2


def _spec() -> LoraWorldSpec:
    return LoraWorldSpec(config=CONFIG, r=4, alpha=8.0, timeout_s=60.0)


def _merged_oracle(spec: LoraWorldSpec, version: int) -> dict[str, torch.Tensor]:
    """PEFT's merge of version ``version``'s adapter into the base, by plain name."""
    merged = peft_model(spec, version).merge_and_unload()
    return {n: p.detach() for n, p in merged.named_parameters()}


def _rank(rank: int, spec: LoraWorldSpec, gen: str, n_gen: int, ports: tuple[int, int]) -> dict:
    torch.set_num_threads(1)
    model = peft_model(spec, 0)
    plan = lora_plan({n: (tuple(t.shape), t.dtype) for n, t in adapter_tensors(model).items()},
                     ModelConfig.from_hf(model.get_base_model().config), "tp=2", gen, N_TRAIN, n_gen)

    async def trainer() -> dict:
        w = LoraPolicyWorker(model, rank=rank, world_size=N_TRAIN, device="cpu", timeout_s=spec.timeout_s)
        await w.init_collective("127.0.0.1", ports[0], N_TRAIN + n_gen, train_world_size=N_TRAIN)
        await w.init_nccl_reshard_comm_group(["127.0.0.1"], [ports[1]], 1, 0, N_TRAIN + n_gen, rank)
        info = await w.prepare_nccl_reshard_refit_info("tp=2", gen, N_TRAIN, n_gen)
        sent = []
        for version in range(1, REFITS + 1):
            spec.load(w, version)
            sent.append((await w.nccl_reshard_refit(refit_timeout_s=30.0)).bytes)
        await w.shutdown()
        return {"hash": info["hash"], "sent": sent}

    async def rollout(g: int) -> dict:
        w = RolloutWorker(rank=g, gen_world_size=n_gen, device="cpu", timeout_s=spec.timeout_s)
        await w.init_collective("127.0.0.1", ports[0], N_TRAIN + n_gen, train_world_size=N_TRAIN)
        await w.init_nccl_reshard_comm_groups(["127.0.0.1"], [ports[1]], [N_TRAIN])
        w.load_refit_plan(plan.refit_info())
        # This rank's serving weights of the targeted linears, as the same rules shard them.
        bases = {f"{n.rsplit('.lora_', 1)[0]}.weight" for n in adapter_tensors(model)}
        base = {n: t.detach() for n, t in base_tensors(model).items()}
        from policyworker.layout.planner import build_plan

        base_plan = build_plan(ModelConfig.from_hf(model.get_base_model().config), "tp=1", gen, 1, n_gen,
                               gen_fused=False, dtype=torch.float32)
        serving = {n: t.clone() for n, t in dest_shards(base_plan, g, base).items() if n in bases}
        merger = LoraMerger(serving, lora_meta(model).scaling)
        out = {"exact": [], "merged_exact": [], "versions": []}
        for version in range(1, REFITS + 1):
            rep = await w.receive_nccl_reshard_refit(refit_timeout_s=30.0)
            want = dest_shards(plan, g, adapter_weights(spec, version, model))
            have = w.weights()
            out["exact"].append(set(have) == set(want) and all(same_bits(have[k], want[k]) for k in want))
            merger.merge(have)
            oracle = dest_shards(base_plan, g, _merged_oracle(spec, version))
            out["merged_exact"].append(all(same_bits(serving[k], oracle[k]) for k in serving))
            out["versions"].append(rep.version)
        out["recv"] = plan.recv_bytes_per_dst_rank()[g]
        await w.shutdown()
        return out

    return asyncio.run(trainer() if rank < N_TRAIN else rollout(rank - N_TRAIN))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_adapter_refits_into_rollouts_unmerged_and_merged_like_peft():
    gen, n_gen = "tp=2", 2  # sharded factors and sharded merges (vLLM's test covers whole ones)
    spec = _spec()
    results = run_world(_rank, N_TRAIN + n_gen, (spec, gen, n_gen, (free_port(), free_port())), timeout_s=150.0)
    trainers, rollouts = results[:N_TRAIN], results[N_TRAIN:]
    assert len({t["hash"] for t in trainers}) == 1
    adapter = sum(t.numel() * t.element_size() for t in adapter_tensors(peft_model(spec, None)).values())
    for r in rollouts:
        assert r["versions"] == list(range(1, REFITS + 1))
        assert all(r["exact"]) and all(r["merged_exact"]), r
    # Each rollout receives exactly its shard of the adapter, each byte once.
    for version in range(REFITS):
        assert sum(t["sent"][version] for t in trainers) == sum(r["recv"] for r in rollouts)
    # What is sharded arrives once; what is replicated (A of column layers, B of row layers) once per rank.
    assert adapter < sum(r["recv"] for r in rollouts) < n_gen * adapter


def test_rules_place_factors_like_their_base():
    config = ModelConfig.from_hf(peft_model(_spec(), None).get_base_model().config)
    a, b = (match_rule(f"model.layers.0.self_attn.k_proj.lora_{x}.weight", config) for x in "AB")
    assert (a.kind, a.dim) == ("replicated", None) and (b.kind, b.dim, b.heads) == ("column", 0, "kv")
    a, b = (match_rule(f"model.layers.1.mlp.down_proj.lora_{x}.weight", config) for x in "AB")
    assert (a.kind, a.dim) == ("row", 1) and (b.kind, b.dim) == ("replicated", None)
    with pytest.raises(PolicyWorkerError, match="LoRA on vocab"):
        match_rule("model.embed_tokens.lora_A.weight", config)


def test_vllm_plan_moves_the_adapter_once_and_the_base_hash_is_the_checkpoints(tmp_path):
    spec = _spec()
    model = peft_model(spec, 1)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in adapter_tensors(model).items()}
    config = ModelConfig.from_hf(model.get_base_model().config)
    adapter = sum(t.numel() * t.element_size() for t in adapter_tensors(model).values())
    for n_gen in (1, 2):  # every vLLM rank receives the whole adapter (its LoRA layers slice it)
        plan = plan_for_vllm_lora(specs, config, "tp=2", N_TRAIN, n_gen)
        assert plan.total_bytes == n_gen * adapter
        assert sum(t.nbytes for t in plan.sends(0)) == sum(t.nbytes for t in plan.sends(1))
    # The base PEFT wraps hashes like the checkpoint it came from (base_layer names mapped).
    from policyworker.testing.vllm_world import hf_model

    hf_model(spec, 0).save_pretrained(tmp_path, safe_serialization=True)
    from safetensors.torch import load_file

    assert base_hash(model) == tensor_hash(load_file(str(tmp_path / "model.safetensors")))
    other = LoraWorldSpec(config=dict(CONFIG, initializer_range=0.1), r=4)
    assert base_hash(peft_model(other, 0)) != base_hash(model)
    meta = LoraPolicyWorker(model, timeout_s=5.0)
    try:
        good = LoraEngineInfo(rank=0, tp_size=1, base_hash=base_hash(model), max_lora_rank=8)
        assert check_engines([good], base_hash(model), meta.meta) is False
        other = LoraEngineInfo(rank=0, tp_size=1, base_hash="0" * 64, max_lora_rank=8)
        with pytest.raises(PlanMismatch, match="another base.*send_if_different"):
            check_engines([other], base_hash(model), meta.meta)
        with pytest.raises(ConfigError, match="max_lora_rank"):
            check_engines([LoraEngineInfo(rank=0, tp_size=1, base_hash=good.base_hash, max_lora_rank=2)],
                          base_hash(model), meta.meta)
        # Asked to, the trainers send their base to an engine on another base, if it can take it.
        with pytest.raises(ConfigError, match="cannot receive the trainers' base: block-FP8"):
            check_engines([msgspec.structs.replace(other, base_refusal="block-FP8")], base_hash(model), meta.meta,
                          "send_if_different")
        needs = _whole_needs(meta.base_specs(), 0)
        assert check_engines([msgspec.structs.replace(other, base_needs=needs)], base_hash(model), meta.meta,
                             "send_if_different") is True
        assert check_engines([good], base_hash(model), meta.meta, "send_if_different") is False
        with pytest.raises(ConfigError, match="base must be one of"):
            check_engines([good], base_hash(model), meta.meta, "always")
    finally:
        asyncio.run(meta.shutdown())


def _whole_needs(base_specs, rank: int):
    from policyworker.integrations.vllm.plan import Need, Needs

    return Needs(rank=rank, tp_rank=0, tp_size=1, dtype="float32",
                 needs=[Need(n, tuple(s), (0,) * len(s), tuple(s)) for n, (s, _) in base_specs.items()])


def test_the_first_plan_that_sends_the_base_moves_base_and_adapter_each_byte_once(tmp_path):
    spec = _spec()
    model = peft_model(spec, 1)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in adapter_tensors(model).items()}
    base_specs = {n: (tuple(t.shape), t.dtype) for n, t in base_tensors(model).items()}
    config = ModelConfig.from_hf(model.get_base_model().config)
    adapter = sum(t.numel() * t.element_size() for t in adapter_tensors(model).values())
    base = sum(t.numel() * t.element_size() for t in base_tensors(model).values())
    for n_gen in (1, 2):  # two engines of tp=1: each receives the whole base and the whole adapter
        needs = [_whole_needs(base_specs, g) for g in range(n_gen)]
        first = plan_for_vllm_lora(specs, config, "tp=2", N_TRAIN, n_gen, base=(base_specs, needs))
        only = plan_for_vllm_lora(specs, config, "tp=2", N_TRAIN, n_gen)
        assert first.total_bytes == n_gen * (base + adapter) and only.total_bytes == n_gen * adapter
        # The factors travel as in the adapter-only plan; each trainer sends its shard of the base.
        def boxes(plan, g):
            return {n: (t.shape, t.dtype, [(p.start, p.stop) for p in t.pieces])
                    for n, t in plan.local_tensors("dst", g).items() if n in specs}

        for g in range(n_gen):
            assert boxes(first, g) == boxes(only, g) and len(boxes(only, g)) == len(specs)
        assert sum(t.nbytes for t in first.sends(0)) == sum(t.nbytes for t in first.sends(1))
    with pytest.raises(PolicyWorkerError, match="names both"):
        plan_for_vllm_lora(specs, config, "tp=2", N_TRAIN, 1, base=({**base_specs, **specs}, [needs[0]]))


def test_merge_is_peft_exact_in_float32_and_within_one_rounding_in_bf16():
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(s, generator=g) for s in ((48, 32), (4, 32), (48, 4)))
    assert torch.equal(merge_lora(w, a, b, 2.0), w + (b @ a) * 2.0)
    exact = w.double() + (b.double() @ a.double()) * 2.0
    got = merge_lora(w.bfloat16(), a.bfloat16(), b.bfloat16(), 2.0)
    ref = w.bfloat16().double() + (b.bfloat16().double() @ a.bfloat16().double()) * 2.0
    assert got.dtype == torch.bfloat16
    assert ((got.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6).all()
    assert not torch.equal(got.double(), exact)  # bf16 inputs are not the fp32 ones: the bound is the contract
    with pytest.raises(ConfigError, match="do not fit"):
        LoraMerger({"x.weight": w.clone()}, 2.0).merge({"x.lora_A.weight": a, "x.lora_B.weight": b[:5]})


def test_bench_lora_needs_the_vllm_engine():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "policyworker.cli", "bench", "--lora", "16"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode != 0 and "ConfigError: bench --lora RANK refits into vLLM" in proc.stderr


def test_the_vllm_lora_backend_refuses_tensor_parallel_engines(monkeypatch):
    # Its tp ranks install without agreeing first, so a tp=2 engine is refused at start
    # (a typed error naming the limit), not half-updated at some later commit.
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import vllm.distributed as vd

    from policyworker.integrations.vllm.lora import PolicyworkerLoraEngine

    monkeypatch.setattr(vd, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vd, "get_tensor_model_parallel_world_size", lambda: 2)
    model = torch.nn.Linear(2, 2)
    model.lora_manager = SimpleNamespace(remove_all_adapters=lambda: None)
    vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_lora_rank=16), model_config=None,
                                  parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    with pytest.raises(ConfigError, match="tensor_parallel_size=1 only"):
        PolicyworkerLoraEngine(None, vllm_config, torch.device("cpu"), model)
