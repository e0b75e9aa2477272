"""A delta-refit world for tests: trainers and rollouts as real processes over gloo.

Weights change by ``fractions[v-1]`` of their elements at version v (lowest bits
flipped, :func:`policyworker.testing.delta_weights.perturb_`), replayed in every
process; each rollout checks its tensors bit for bit against ``dest_shards`` of the
full state after every commit (an oracle computed apart from the transport).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from policyworker import PolicyWorkerError, RolloutWorker
from policyworker.runtime.comm import CommGroup
from policyworker.testing import faults
from policyworker.layout import Parallelism, build_plan, dest_shards, source_shards
from policyworker.models import get_preset, seeded_state_dict
from policyworker.testing.delta_weights import perturb_

from .helpers import ShardTrainer, same_bits


@dataclass
class DeltaSpec:
    preset: str = "tiny"
    train: str = "tp=2"
    gen: str = "tp=2"
    dtype: str = "bfloat16"
    fractions: list[float] = field(default_factory=lambda: [1.0, 0.01, 0.02, 0.0])
    options: dict[str, Any] = field(default_factory=lambda: {"delta": True})
    full_at: tuple[int, ...] = ()  # versions the trainers refit with delta=False
    corrupt: tuple[int, int] | None = None  # (rollout rank, version): a live byte flipped after its commit
    receiver_options: dict[int, dict[str, Any]] = field(default_factory=dict)  # version -> the rollouts' options
    refit_timeout_s: float | None = None
    stall: tuple[int, int, int, float] | None = None  # (train rank, version, its k-th group wait, seconds)
    update_port: int = 0
    stage_ports: list[int] = field(default_factory=list)
    timeout_s: float = 60.0

    @property
    def train_par(self) -> Parallelism:
        return Parallelism.parse(self.train)

    @property
    def gen_par(self) -> Parallelism:
        return Parallelism.parse(self.gen)


def _row(rep) -> dict[str, Any]:
    return {"ok": True, "version": rep.version, "bytes": rep.bytes, "wire_bytes": rep.wire_bytes,
            "shadow_bytes": rep.shadow_bytes, "notes": list(rep.notes), "delta": rep.notes[-1].startswith("delta")}


def delta_rank(rank: int, spec: DeltaSpec) -> dict[str, Any]:
    torch.set_num_threads(1)
    dtype = getattr(torch, spec.dtype)
    config = get_preset(spec.preset)
    train, gen = spec.train_par, spec.gen_par
    n_train, n_gen = train.world_size, gen.world_size
    plan = build_plan(config, train, spec.gen, n_train, n_gen, dtype=dtype)
    state = seeded_state_dict(config, seed=0, dtype=dtype)
    trainer = rank < n_train

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"outcomes": []}
        if trainer:
            local = source_shards(plan, rank, state)
            w: Any = ShardTrainer(local_params=local, source=config, rank=rank, world_size=n_train, device="cpu",
                                  timeout_s=spec.timeout_s)
            await w.init_collective("127.0.0.1", spec.update_port, n_train + n_gen, train_world_size=n_train)
            stage = train.coords(rank).pp_stage
            members = list(train.stage_ranks(stage))
            await w.init_nccl_reshard_comm_group(["127.0.0.1"] * train.pp, spec.stage_ports, train.pp, stage,
                                                 len(members) + n_gen, members.index(rank))
            info = await w.prepare_nccl_reshard_refit_info(train, spec.gen, n_train, n_gen)
            await w.attach_transport("nccl_reshard", connect=False, plan=info, group=w.pp_comm_group, stage=stage,
                                     **spec.options)
        else:
            g = rank - n_train
            w = RolloutWorker(rank=g, gen_world_size=n_gen, device="cpu", timeout_s=spec.timeout_s)
            await w.init_collective("127.0.0.1", spec.update_port, n_train + n_gen, train_world_size=n_train)
            await w.init_nccl_reshard_comm_groups(["127.0.0.1"] * train.pp, spec.stage_ports,
                                                  [len(train.stage_ranks(s)) for s in range(train.pp)])
            w.load_refit_plan(plan.refit_info())
            await w.attach_transport("nccl_reshard", connect=False, plan=plan, groups=w.stage_groups, **spec.options)
        for v, fraction in enumerate(spec.fractions, start=1):
            before = {k: t.clone() for k, t in state.items()}
            perturb_(state, fraction, v)
            if trainer and spec.stall is not None and spec.stall[:2] == (rank, v):
                faults.after_calls(CommGroup, "wait", spec.stall[2], lambda: time.sleep(spec.stall[3]))
            try:
                if trainer:
                    for name, t in source_shards(plan, rank, state).items():
                        local[name].copy_(t)
                    if v == 1:
                        rep = await w.nccl_reshard_refit(refit_timeout_s=spec.refit_timeout_s)
                    else:
                        extra = {"delta": False} if v in spec.full_at else {}
                        rep = await w.refit("nccl_reshard", version=v, refit_timeout_s=spec.refit_timeout_s,
                                            **extra)
                    out["outcomes"].append(_row(rep))
                else:
                    if v in spec.receiver_options:
                        rep = await w.refit("nccl_reshard", refit_timeout_s=spec.refit_timeout_s,
                                            **spec.receiver_options[v])
                    else:
                        rep = await w.receive_nccl_reshard_refit(refit_timeout_s=spec.refit_timeout_s)
                    row = _row(rep)
                    want, have = dest_shards(plan, g, state), w.weights()
                    row["exact"] = set(want) == set(have) and all(same_bits(have[k], want[k]) for k in want)
                    row["expected_bytes"] = plan.recv_bytes_per_dst_rank()[g]
                    out["outcomes"].append(row)
                    if spec.corrupt == (g, v):
                        first = next(iter(w.params.values()))
                        first.view(-1)[:1].view(torch.uint8)[0] ^= 0x10  # outside any refit: the base diverges
            except PolicyWorkerError as exc:
                row = {"ok": False, "version": v, "error": type(exc).__name__, "message": str(exc)[:300]}
                if not trainer:
                    row["torn"], row["weight_version"] = w.torn, w.weight_version
                    if not w.torn and w.weight_version == v - 1:  # serves its old version, intact?
                        have, want = w.weights(), dest_shards(plan, g, before)
                        row["intact"] = all(same_bits(have[k], want[k]) for k in want)
                out["outcomes"].append(row)
                if exc.__class__.__name__ in ("RefitTimeout", "RefitAborted", "PeerLost"):
                    break  # the groups were aborted: recovery is the drill's business
        await w.shutdown()
        return out

    return asyncio.run(main())
