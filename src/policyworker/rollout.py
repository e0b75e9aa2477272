"""RolloutWorker: the generation-side peer of the trainer workers.

It joins the same groups as the trainers — the update group as rank
``train_world_size + rank`` and every pipeline stage's reshard group after that
stage's trainers — receives refits, and keeps ``weight_version``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .comm import CommGroup, new_group
from .core import WorkerCore
from .errors import ConfigError
from .worker import SUPPORTED_NCCL_PEERS, _check_int

__all__ = ["RolloutWorker"]


class RolloutWorker(WorkerCore):
    """Generation-side worker. ``rank`` is its rank among the generation ranks."""

    role = "rollout"

    def __init__(self, *, rank: int = 0, gen_world_size: int = 1, **kwargs: Any) -> None:
        super().__init__(rank=rank, **kwargs)
        _check_int(gen_world_size, "gen_world_size", minimum=1)
        if rank >= gen_world_size:
            raise ConfigError(f"rollout rank {rank} is outside the generation world [0, {gen_world_size})")
        self.gen_world_size = gen_world_size
        self.stage_groups: dict[int, CommGroup] = {}
        self.weight_version = 0

    def _zmq_binds(self) -> bool:
        return False  # the colocated trainer binds the device's endpoint

    async def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int, nccl_peer: str = "nemo"
    ) -> None:
        """Join the update group as rank ``train_world_size + rank`` (re-entrant)."""
        if nccl_peer not in SUPPORTED_NCCL_PEERS:
            raise ConfigError(f"unknown nccl_peer {nccl_peer!r}; supported: {', '.join(SUPPORTED_NCCL_PEERS)}")
        _check_int(world_size, "world_size", minimum=1)
        _check_int(train_world_size, "train_world_size", minimum=1)
        if train_world_size + self.gen_world_size != world_size:
            raise ConfigError(
                f"world_size {world_size} != train_world_size {train_world_size} + gen_world_size {self.gen_world_size}"
            )
        self._ensure_open()
        self._replace_group("model_update_group", None)
        group = await self._run(
            new_group,
            host=ip,
            port=port,
            rank=train_world_size + self.rank,
            world_size=world_size,
            name="model_update",
            timeout_s=self.timeout_s,
        )
        self._replace_group("model_update_group", group)

    async def init_nccl_reshard_comm_groups(
        self, pp_ips: Sequence[str], pp_ports: Sequence[int], trainers_per_stage: Sequence[int]
    ) -> None:
        """Join every pipeline stage's reshard group, after that stage's trainers.

        Stage groups are joined in stage order; every trainer of stage ``s`` must be
        joining group ``s`` at the same time (a stage whose trainers never come makes
        this call raise at the timeout).
        """
        pp_size = len(trainers_per_stage)
        if pp_size == 0 or len(pp_ips) != pp_size or len(pp_ports) != pp_size:
            raise ConfigError(
                f"pp_ips ({len(pp_ips)}), pp_ports ({len(pp_ports)}) and trainers_per_stage "
                f"({pp_size}) must have the same, non-zero length"
            )
        for n in trainers_per_stage:
            _check_int(n, "trainers_per_stage[i]", minimum=1)
        self._ensure_open()
        for group in self.stage_groups.values():
            group.close()
        self.stage_groups = {}
        for stage, (ip, port, n_train) in enumerate(zip(pp_ips, pp_ports, trainers_per_stage)):
            self.stage_groups[stage] = await self._run(
                new_group,
                host=ip,
                port=port,
                rank=n_train + self.rank,
                world_size=n_train + self.gen_world_size,
                name=f"reshard_pp{stage}",
                timeout_s=self.timeout_s,
            )

    def _close_resources(self) -> None:
        for group in self.stage_groups.values():
            group.close()
        self.stage_groups = {}
