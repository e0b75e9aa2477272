"""A refit world for tests, the demo and benchmarks: trainers and rollouts as processes.

``refit_rank`` is the body of one process. Trainers hold seeded shards of a preset in
the training layout, rollouts receive them in the generation layout; every refit
uses new weights (seed = version) and each rollout checks its tensors bit for bit.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from policyworker import RolloutWorker
from policyworker.layout import Parallelism, build_plan, dest_shards, source_shards
from policyworker.models import get_preset, seeded_state_dict

from .helpers import ShardTrainer


@dataclass
class RefitSpec:
    preset: str
    train: str
    gen: str
    refits: int = 2
    dtype: str = "float32"
    update_port: int = 0
    stage_ports: list[int] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 60.0
    refit_timeout_s: float | None = None

    @property
    def train_par(self) -> Parallelism:
        return Parallelism.parse(self.train)

    @property
    def gen_par(self) -> Parallelism:
        return Parallelism.parse(self.gen)


def refit_rank(rank: int, spec: RefitSpec) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = get_preset(spec.preset)
    dtype = getattr(torch, spec.dtype)
    train, gen = spec.train_par, spec.gen_par
    n_train, n_gen = train.world_size, gen.world_size
    plan = build_plan(config, train, gen, n_train, n_gen, dtype=dtype)

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"reports": [], "exact": []}
        world = n_train + n_gen
        if rank < n_train:
            full = seeded_state_dict(config, seed=0, dtype=dtype)
            local = source_shards(plan, rank, full)
            w = ShardTrainer(local_params=local, source=config, rank=rank, world_size=n_train,
                             device="cpu", timeout_s=spec.timeout_s)
            w.reshard_options = dict(spec.options)
            await w.init_collective("127.0.0.1", spec.update_port, world, train_world_size=n_train)
            stage = train.coords(rank).pp_stage
            members = list(train.stage_ranks(stage))
            await w.init_nccl_reshard_comm_group(["127.0.0.1"] * train.pp, spec.stage_ports, train.pp, stage,
                                                 len(members) + n_gen, members.index(rank))
            info = await w.prepare_nccl_reshard_refit_info(train, gen, n_train, n_gen)
            out["hash"] = info["hash"]
            for version in range(1, spec.refits + 1):
                full = seeded_state_dict(config, seed=version, dtype=dtype)
                for name, t in source_shards(plan, rank, full).items():
                    local[name].copy_(t)
                rep = await w.nccl_reshard_refit(kv_scales={"layer0.k": 0.5 * version},
                                                 refit_timeout_s=spec.refit_timeout_s)
                out["reports"].append({"version": rep.version, "bytes": rep.bytes, "seconds": rep.seconds,
                                       "peak_extra_bytes": rep.peak_extra_bytes})
        else:
            g = rank - n_train
            w = RolloutWorker(rank=g, gen_world_size=n_gen, device="cpu", timeout_s=spec.timeout_s,
                              reshard_options=spec.options)
            await w.init_collective("127.0.0.1", spec.update_port, world, train_world_size=n_train)
            await w.init_nccl_reshard_comm_groups(["127.0.0.1"] * train.pp, spec.stage_ports,
                                                  [len(train.stage_ranks(s)) for s in range(train.pp)])
            w.load_refit_plan(plan.refit_info())
            out["hash"] = plan.hash
            for version in range(1, spec.refits + 1):
                t0 = time.perf_counter()
                rep = await w.receive_nccl_reshard_refit(refit_timeout_s=spec.refit_timeout_s)
                want = dest_shards(plan, g, seeded_state_dict(config, seed=version, dtype=dtype))
                have = w.weights()
                exact = set(want) == set(have) and all(torch.equal(have[k], want[k]) for k in want)
                out["exact"].append(exact)
                out["reports"].append({"version": rep.version, "bytes": rep.bytes,
                                       "seconds": time.perf_counter() - t0, "kv_scales": w.kv_scales,
                                       "peak_extra_bytes": rep.peak_extra_bytes})
            out["weight_version"] = w.weight_version
            out["recv_expected"] = plan.recv_bytes_per_dst_rank()[g]
        await w.shutdown()
        return out

    return asyncio.run(main())
