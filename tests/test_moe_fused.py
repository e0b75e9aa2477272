"""Hugging Face MoE models whose experts are fused (transformers >= 5) refit like per-expert ones.

The oracle is the checkpoint transformers itself writes (``save_pretrained``: per-expert
names on disk): every generation rank must end with exactly its shard of those tensors,
each byte sent once, from trainers at tp=2, dp=2 x ep=2 and tp=2 x ep=2 (full models,
views of the fused tensors, no copies) and from FSDP2 DTensors (a real refit over gloo).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from policyworker.runtime.procs import free_port, run_world

pytest.importorskip("transformers")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
              num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64)


def _model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **CONFIG), dtype=torch.float32)


def _disk_state(model, path) -> dict[str, torch.Tensor]:
    """What transformers writes to disk: its own per-expert names and bytes."""
    from safetensors.torch import load_file

    model.save_pretrained(str(path), safe_serialization=True)
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_fused_experts_are_views_named_per_expert():
    from policyworker.layout.experts import expert_specs, expert_views

    model = _model()
    named = dict(model.named_parameters())
    fused = named["model.layers.0.mlp.experts.gate_up_proj"]
    assert tuple(fused.shape) == (4, 64, 64)  # [E, 2I, H]: the layout this test is about
    views = expert_views(named)
    specs = expert_specs({n: (tuple(p.shape), p.dtype) for n, p in named.items()})
    assert list(views) == list(specs)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in views
    up = views["model.layers.0.mlp.experts.2.up_proj.weight"]
    assert torch.equal(up, fused[2, 32:]) and up.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert specs["model.layers.1.mlp.experts.3.down_proj.weight"] == ((64, 32), torch.float32)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("train", ["tp=2", "dp=2,ep=2", "tp=2,ep=2"])
@pytest.mark.parametrize("gen", ["tp=1", "tp=2"])
def test_fused_trainers_send_each_generation_rank_its_checkpoint_shard(tmp_path, train, gen):
    from policyworker import TorchPolicyWorker
    from policyworker.layout import Parallelism, apply_plan, dest_shards, empty_local_tensors
    from policyworker.layout.local import plan_for_source

    model = _model()
    disk = _disk_state(model, tmp_path)
    n_gen = Parallelism.parse(gen).world_size

    async def run() -> None:
        workers = [TorchPolicyWorker(model, rank=r, world_size=2, device="cpu", timeout_s=30) for r in range(2)]
        try:
            plan = plan_for_source(workers[0]._refit_model_source(), train, gen, 2, n_gen, dtype=torch.float32)
            src = {}
            for r, w in enumerate(workers):
                w._adopt_plan("nccl_reshard", plan)  # this rank's tensors are the plan's
                src[r] = w._local_tensors(plan)
            dst = {g: empty_local_tensors(plan, "dst", g) for g in range(n_gen)}
            moved = apply_plan(plan, src, dst)
            need = 0
            for g in range(n_gen):
                want = dest_shards(plan, g, disk)
                assert set(want) == set(dst[g])
                for name, t in want.items():
                    assert torch.equal(dst[g][name], t), (g, name)
                    need += t.numel() * t.element_size()
            assert moved == plan.total_bytes == need  # each byte a rank needs, once
            params = dict(model.named_parameters())
            sent = 0
            for r in src:  # an expert's shard is sent from the fused tensor's own storage
                for n, t in src[r].items():
                    if ".mlp.experts." in n:
                        layer, kind = n.split(".mlp.experts.")[0], n.rsplit(".", 2)[-2]
                        fused = params[f"{layer}.mlp.experts.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"]
                        assert t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr(), n
                        sent += 1
            assert sent >= 2 * 4 * 3
        finally:
            for w in workers:
                await w.shutdown()

    asyncio.run(run())


def test_bare_fused_specs_plan_as_per_expert_specs():
    from policyworker.layout import build_plan
    from policyworker.layout.experts import expert_specs

    named = dict(_model().named_parameters())
    fused = {n: (tuple(p.shape), "float32") for n, p in named.items()}
    per_expert = expert_specs(fused)
    a = build_plan(fused, "tp=2", "tp=1", 2, 1)
    b = build_plan(per_expert, "tp=2", "tp=1", 2, 1)
    assert a.hash == b.hash and "model.layers.0.mlp.experts.1.gate_proj.weight" in {p.name for p in a.params}


def _fsdp_rank(rank: int, ports: dict, disk_path: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from policyworker import RolloutWorker, TorchPolicyWorker
    from policyworker.layout import dest_shards

    torch.set_num_threads(1)
    n_train, n_gen = 2, 1

    async def trainer() -> dict:
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['train']}", rank=rank, world_size=2)
        model = _model()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        w = TorchPolicyWorker(model, rank=rank, world_size=n_train, device="cpu", timeout_s=60)
        await w.init_collective("127.0.0.1", ports["update"], n_train + n_gen, train_world_size=n_train)
        await w.init_nccl_reshard_comm_group(["127.0.0.1"], [ports["stage"]], 1, 0, n_train + n_gen, rank)
        info = await w.prepare_nccl_reshard_refit_info("dp=2", "tp=1", n_train, n_gen)
        if rank == 0:
            w.model_update_group.store.set("plan", w._refit_transport_state("nccl_reshard")["seed_plan"].to_wire())
        rep = await w.nccl_reshard_refit(refit_timeout_s=60)
        await w.shutdown()
        dist.destroy_process_group()
        return {"hash": info["hash"], "version": rep.version}

    async def rollout() -> dict:
        from policyworker.layout.plan import ReshardPlan

        r = RolloutWorker(rank=0, gen_world_size=n_gen, device="cpu", timeout_s=60)
        await r.init_collective("127.0.0.1", ports["update"], n_train + n_gen, train_world_size=n_train)
        await r.init_nccl_reshard_comm_groups(["127.0.0.1"], [ports["stage"]], [n_train])
        # The trainers' plan (from their DTensors), published by trainer 0.
        plan = ReshardPlan.from_wire(bytes(r.model_update_group.store.get("plan")))
        r.load_refit_plan(plan.refit_info())
        rep = await r.receive_nccl_reshard_refit(refit_timeout_s=60)
        want = dest_shards(plan, 0, load_file(disk_path))
        have = r.weights()
        exact = set(want) == set(have) and all(torch.equal(have[k], want[k]) for k in want)
        experts = sum(".mlp.experts." in p.name for p in plan.params)
        await r.shutdown()
        return {"hash": plan.hash, "version": rep.version, "exact": exact, "experts": experts,
                "bytes": rep.bytes, "total": plan.total_bytes,
                "need": sum(t.numel() * t.element_size() for t in want.values())}

    return asyncio.run(trainer() if rank < n_train else rollout())


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_fsdp2_fused_experts_refit_exact(tmp_path) -> None:
    disk = _disk_state(_model(), tmp_path)
    path = tmp_path / "disk.safetensors"
    from safetensors.torch import save_file

    save_file(disk, str(path))
    ports = {"train": free_port(), "update": free_port(), "stage": free_port()}
    t0, t1, r = run_world(_fsdp_rank, 3, (ports, str(path)), timeout_s=150)
    assert t0["hash"] == t1["hash"] == r["hash"] and t0["version"] == t1["version"] == r["version"] == 1
    assert r["exact"] and r["experts"] == 2 * 4 * 3
    assert r["total"] == r["need"]


def test_fused_experts_split_inside_an_expert_are_refused():
    from torch.distributed.tensor import Shard

    from policyworker.errors import PlanError
    from policyworker.layout.dtensor import placement_layout
    from policyworker.layout.experts import split_expert_layout

    name = "model.layers.0.mlp.experts.gate_up_proj"
    rows = {name: ((4, 64, 64), torch.float32, torch.arange(2), [Shard(1)])}
    with pytest.raises(PlanError, match=r"shard fused experts over experts") as info:
        split_expert_layout({name: ((4, 64, 64), "float32")}, placement_layout(rows, world_size=2))
    assert info.value.param == name
    experts = {name: ((4, 64, 64), torch.float32, torch.arange(2), [Shard(0)])}
    specs, layout = split_expert_layout({name: ((4, 64, 64), "float32")}, placement_layout(experts, world_size=2))
    assert sorted(layout.tensors[1]) == sorted(f"model.layers.0.mlp.experts.{e}.{m}_proj.weight"
                                                for e in (2, 3) for m in ("gate", "up"))
    assert specs["model.layers.0.mlp.experts.3.up_proj.weight"] == ((32, 64), "float32")
