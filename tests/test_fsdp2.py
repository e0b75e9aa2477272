"""A real FSDP2 model (``fully_shard`` over gloo, 2 ranks) under TorchPolicyWorker.

Every service: reference log-probs (equal to the unsharded model's), async save and
load of its (sharded, per-rank) checkpoint, and an nccl_reshard refit to a rollout
that checks its weights bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from policyworker.runtime.procs import free_port, run_world

pytestmark = [pytest.mark.multiprocess]


def _rank(rank: int, ports: dict, tmp: str) -> dict:
    import torch.distributed as dist

    from policyworker import RolloutWorker, TorchPolicyWorker
    from policyworker.layout import dest_shards, placement_layout, plan_from_layouts, rule_layout
    from policyworker.models import get_preset, param_specs, seeded_state_dict
    from policyworker.models.toy_model import build_model

    torch.set_num_threads(1)
    config = get_preset("tiny")
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([9, 5, 7])
    n_train, n_gen = 2, 1

    async def trainer() -> dict:
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['train']}", rank=rank, world_size=2)
        model = build_model(config, seed=0)
        plain = TorchPolicyWorker(build_model(config, seed=0), device="cpu")
        want = (await plain.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths}))
        await plain.shutdown()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        w = TorchPolicyWorker(model, rank=rank, world_size=n_train, device="cpu", timeout_s=60)
        out: dict = {}
        got = await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths})
        out["logprobs_close"] = torch.allclose(got["reference_logprobs"], want["reference_logprobs"], atol=1e-5)
        path = f"{tmp}/ckpt-{rank}.pt"
        await w.save_checkpoint(path)
        await w.finalize_async_save()
        before = {n: p.to_local().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(1.0)
        await w.load_checkpoint(path)
        out["checkpoint_roundtrip"] = all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters())
        await w.init_collective("127.0.0.1", ports["update"], n_train + n_gen, train_world_size=n_train)
        await w.init_nccl_reshard_comm_group(["127.0.0.1"], [ports["stage"]], 1, 0, n_train + n_gen, rank)
        info = await w.prepare_nccl_reshard_refit_info("dp=2", "tp=1", n_train, n_gen)
        out["hash"] = info["hash"]
        rep = await w.nccl_reshard_refit(refit_timeout_s=60)
        out["version"] = rep.version
        await w.shutdown()
        dist.destroy_process_group()
        return out

    async def rollout() -> dict:
        from torch.distributed.tensor import Shard

        # The plan the FSDP2 trainers compute from their DTensors: Shard(0) over 2 ranks.
        specs = {n: (tuple(s), "float32") for n, (s, _) in param_specs(config, torch.float32).items()}
        entries = {n: (s, torch.float32, torch.arange(n_train), [Shard(0)]) for n, (s, _) in specs.items()}
        src = placement_layout(entries, world_size=n_train)
        dst = rule_layout(specs, _par("tp=1"), config=config, fused=True)
        plan = plan_from_layouts(specs, src, dst, train=_par("dp=2"), gen=_par("tp=1"), gen_fused=True)
        r = RolloutWorker(rank=0, gen_world_size=n_gen, device="cpu", timeout_s=60)
        await r.init_collective("127.0.0.1", ports["update"], n_train + n_gen, train_world_size=n_train)
        await r.init_nccl_reshard_comm_groups(["127.0.0.1"], [ports["stage"]], [n_train])
        r.load_refit_plan(plan.refit_info())
        rep = await r.receive_nccl_reshard_refit(refit_timeout_s=60)
        want = dest_shards(plan, 0, seeded_state_dict(config, seed=0))
        have = r.weights()
        exact = set(want) == set(have) and all(torch.equal(have[k], want[k]) for k in want)
        await r.shutdown()
        return {"hash": plan.hash, "version": rep.version, "exact": exact}

    return asyncio.run(trainer() if rank < n_train else rollout())


def _par(text: str):
    from policyworker.layout import Parallelism

    return Parallelism.parse(text)


@pytest.mark.timeout(180)
def test_fsdp2_model_serves_logprobs_checkpoints_and_refit(tmp_path) -> None:
    ports = {"train": free_port(), "update": free_port(), "stage": free_port()}
    t0, t1, r = run_world(_rank, 3, (ports, str(tmp_path)), timeout_s=150)
    for t in (t0, t1):
        assert t["logprobs_close"] and t["checkpoint_roundtrip"]
        assert t["hash"] == r["hash"] and t["version"] == 1
    assert r["exact"] and r["version"] == 1
