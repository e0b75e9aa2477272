"""RolloutWorker: the generation-side peer of the trainer workers.

It joins the same groups as the trainers — the update group as rank
``train_world_size + rank`` and every pipeline stage's reshard group after that
stage's trainers — holds its weights in the generation layout (its own tp shard,
fused ``qkv_proj`` / ``gate_up_proj`` where the plan says so), receives refits and
keeps ``weight_version``.

Versions: a refit of version v commits only after every expected byte arrived and
every rank of the update group reported success. Otherwise the worker stays at v-1;
if bytes of the live tensors were already overwritten it is *torn*: ``weights()``
raises ``TornWeights`` until a full refit commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from collections.abc import Mapping

import torch

from .comm import CommGroup, new_group, share_token
from .core import WorkerCore
from .errors import ConfigError, PlanMismatch, TornWeights
from .layout.apply import empty_local_tensors
from .layout.plan import ReshardPlan
from .reshard_worker import check_local_tensors
from .transports.base import RefitReport, TransportContext
from .transports.nccl_reshard import NcclReshardTransport
from .worker import SUPPORTED_NCCL_PEERS, _check_int
from .zmq_worker import ZmqRolloutMixin

__all__ = ["RolloutWorker"]


class RolloutWorker(ZmqRolloutMixin, WorkerCore):
    """Generation-side worker. ``rank`` is its rank among the generation ranks."""

    role = "rollout"

    def __init__(
        self, *, rank: int = 0, gen_world_size: int = 1, reshard_options: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        _check_int(gen_world_size, "gen_world_size", minimum=1)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= gen_world_size:
            raise ConfigError(f"rollout rank {rank} is outside the generation world [0, {gen_world_size})")
        super().__init__(rank=rank, **kwargs)
        self.gen_world_size = gen_world_size
        self.stage_groups: dict[int, CommGroup] = {}
        self.weight_version = 0
        self.torn = False
        self.kv_scales: dict[str, float] | None = None
        self.params: dict[str, torch.Tensor] = {}
        self.last_report: RefitReport | None = None
        #: Options of the NcclReshardTransport (must match the trainers').
        self.reshard_options: dict[str, Any] = dict(reshard_options or {})

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
        for stage_group in self.stage_groups.values():
            stage_group.abort()  # stale with the old update group (see AbstractPolicyWorker)
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
        self.control_token = await self._run(share_token, group)

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

    # -- weights and versions --------------------------------------------------------
    def weights(self) -> Mapping[str, torch.Tensor]:
        """The live weights for serving; raises ``TornWeights`` while torn."""
        if self.torn:
            raise TornWeights(
                f"rollout rank {self.rank}: a failed refit left the weights partly overwritten "
                f"(last committed version {self.weight_version}); a full refit must commit first",
                rank=self.rank,
            )
        return self.params

    def load_refit_plan(
        self, plan: ReshardPlan | Mapping[str, Any], *, params: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Adopt the trainers' reshard plan (``prepare_nccl_reshard_refit_info``'s dict).

        ``params``: this rank's tensors in the generation layout; by default they are
        allocated (zeros) from the plan, as views of one buffer in the plan's order, so
        the copies of a transfer land as one span. A plan that does not fit them is a
        ConfigError.
        """
        self._ensure_open()
        if not isinstance(plan, ReshardPlan):
            if not isinstance(plan, Mapping):
                raise ConfigError(f"plan must be a ReshardPlan or its refit-info dict, got {type(plan).__name__}")
            claimed = plan.get("hash")
            plan = ReshardPlan.from_dict(dict(plan))
            if claimed is not None and claimed != plan.hash:
                raise PlanMismatch(f"the plan's contents hash to {plan.hash[:12]}…, its dict claims {str(claimed)[:12]}…",
                                   rank=self.rank)
        if plan.body.gen_world_size != self.gen_world_size:
            raise ConfigError(
                f"the plan is for {plan.body.gen_world_size} generation ranks, this world has {self.gen_world_size}"
            )
        if params is None:
            params = {k: v.zero_() for k, v in empty_local_tensors(plan, "dst", self.rank, self.device, flat=True).items()}
        else:
            check_local_tensors(plan, "dst", self.rank, params)
        self.params = dict(params)
        state = self._refit_transport_state("nccl_reshard")
        state["plan"] = plan
        state.pop("connected_hash", None)

    async def receive_nccl_reshard_refit(self, *, refit_timeout_s: float | None = None) -> RefitReport:
        """Receive one refit from the trainers; commit it or raise (see module docstring)."""
        timeout = self._check_refit_timeout(refit_timeout_s)
        self._ensure_open()
        state = self._refit_transport_state("nccl_reshard")
        plan = state.get("plan")
        if plan is None:
            raise ConfigError("call load_refit_plan before receiving a refit", rank=self.rank)
        if not self.stage_groups or self.model_update_group is None:
            raise ConfigError("join the update group and the stage groups before receiving a refit", rank=self.rank)
        transport = state.get("transport")
        if transport is None:
            transport = state["transport"] = NcclReshardTransport(**self.reshard_options)
        if state.get("groups") != self.stage_groups or state.get("update_group") is not self.model_update_group:
            state["groups"], state["update_group"] = dict(self.stage_groups), self.model_update_group
            state.pop("connected_hash", None)
        ctx = TransportContext(
            worker=self, role="receive", rank=self.rank, device=self.device_facts, state=state,
            params=self.params, plan=plan, executor=self._executor,
        )
        aborts = [g.abort for g in (*self.stage_groups.values(), self.model_update_group)]
        return await self._receive_and_commit(transport, ctx, timeout=timeout, aborts=aborts)

    async def _receive_and_commit(self, transport, ctx: TransportContext, *, timeout, aborts) -> RefitReport:
        """Receive one refit; commit its version on success, mark torn on a failure that touched bytes."""
        try:
            report = await self._refit_under_deadline(transport, ctx, timeout=timeout, aborts=aborts)
        except BaseException:
            if ctx.state.get("touched"):
                self.torn = True
            raise
        self.weight_version = report.version
        self.kv_scales = ctx.state.get("kv_scales")
        self.torn = False
        self.last_report = report
        return report

    def _groups(self) -> list[CommGroup]:
        return [*super()._groups(), *self.stage_groups.values()]

    def _close_resources(self) -> None:
        for group in self.stage_groups.values():
            group.close()
        self.stage_groups = {}
