"""AbstractPolicyWorker: the trainer-side worker's async core and its seed surface.

The surface follows NeMo RL's ``AbstractPolicyWorker`` name for name. One instance
per training rank; it runs inside an asyncio loop (uvloop when installed, plain
asyncio, or anyio). Methods that wait on peers or move tensors are ``async def`` and
run their blocking body on the worker's single refit executor thread; cheap queries
(``is_alive``, ``get_zmq_address``, ``stand_down_refit_watchdog``) are plain methods
that never block and never touch CUDA, so a controller can call them while a refit
is stuck.

Group ranks: the update group (``init_collective``) holds train ranks
``[0, train_world_size)`` then the inference ranks after them. A pipeline stage's
group (``init_nccl_reshard_comm_group``) holds that stage's trainers first, then the
generation ranks; the caller passes this rank's index in it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from .comm import CommGroup, new_group, share_token
from .core import WorkerCore
from .sglang_worker import SglangIpcMixin
from .errors import ConfigError

__all__ = ["SUPPORTED_NCCL_PEERS", "AbstractPolicyWorker"]

# Who sits on the other side of the update group. "nemo": policyworker's RolloutWorker
# (or any peer speaking its protocol: independent TCPStore + PrefixStore group, trainers
# first, warm-up broadcast from rank 0).
SUPPORTED_NCCL_PEERS = ("nemo",)


def _check_int(value: Any, name: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


class AbstractPolicyWorker(SglangIpcMixin, WorkerCore, abc.ABC):
    """Trainer-side worker. Subclasses implement the reshard planning and the refit.

    ``connect_sglang_rollout_engines`` and ``sglang_refit`` come from
    :class:`~policyworker.sglang_worker.SglangIpcMixin` (colocated SGLang engines).
    """

    role = "trainer"

    def __init__(self, *, rank: int = 0, world_size: int = 1, **kwargs: Any) -> None:
        # Validate before the core starts its executor thread: a bad argument leaves nothing behind.
        _check_int(world_size, "world_size", minimum=1)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= world_size:
            raise ConfigError(f"rank {rank} is outside the trainer world [0, {world_size})")
        super().__init__(rank=rank, **kwargs)
        self.world_size = world_size
        self.pp_comm_group: CommGroup | None = None
        self.train_world_size: int | None = None

    # -- collectives -----------------------------------------------------------------
    async def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int, nccl_peer: str = "nemo"
    ) -> None:
        """Build ``model_update_group`` over trainers and inference ranks (re-entrant).

        Trainers are ranks ``[0, train_world_size)``; inference ranks follow. Rank 0
        hosts the store at ``(ip, port)``. A warm-up broadcast, checked by every rank,
        proves the group works. Calling it again replaces the old group (recovery).
        """
        if nccl_peer not in SUPPORTED_NCCL_PEERS:
            raise ConfigError(
                f"unknown nccl_peer {nccl_peer!r}; supported: {', '.join(SUPPORTED_NCCL_PEERS)}", rank=self.rank
            )
        _check_int(world_size, "world_size", minimum=1)
        _check_int(train_world_size, "train_world_size", minimum=1)
        if train_world_size > world_size:
            raise ConfigError(f"train_world_size {train_world_size} exceeds world_size {world_size}")
        if self.rank >= train_world_size:
            raise ConfigError(f"trainer rank {self.rank} is outside train_world_size {train_world_size}")
        self._ensure_open()
        # A new update group means a new refit world: the stage group of the old one is
        # stale too. Abort it (a refit blocked in it returns now, so the executor is free
        # for the new group); init_nccl_reshard_comm_group replaces it.
        if self.pp_comm_group is not None:
            self.pp_comm_group.abort()
        self._replace_group("model_update_group", None)
        group = await self._run(
            new_group,
            host=ip,
            port=port,
            rank=self.rank,
            world_size=world_size,
            name="model_update",
            timeout_s=self.timeout_s,
        )
        self._replace_group("model_update_group", group)
        self.control_token = await self._run(share_token, group)
        self.train_world_size = train_world_size

    async def init_nccl_reshard_comm_group(
        self,
        pp_ips: Sequence[str],
        pp_ports: Sequence[int],
        pp_size: int,
        my_pp_stage: int,
        sub_world_size: int,
        my_rank_in_group: int,
    ) -> None:
        """Join this rank's pipeline stage's reshard group (and only that one).

        ``pp_ips[s]`` / ``pp_ports[s]`` is stage ``s``'s store (hosted by its rank 0).
        The group holds the stage's trainers first, then every generation rank.
        Sets ``pp_comm_group``; a second call replaces it.
        """
        _check_int(pp_size, "pp_size", minimum=1)
        if len(pp_ips) != pp_size or len(pp_ports) != pp_size:
            raise ConfigError(
                f"pp_ips ({len(pp_ips)}) and pp_ports ({len(pp_ports)}) must both have pp_size={pp_size} entries"
            )
        _check_int(my_pp_stage, "my_pp_stage")
        if my_pp_stage >= pp_size:
            raise ConfigError(f"my_pp_stage {my_pp_stage} is outside [0, {pp_size})")
        _check_int(sub_world_size, "sub_world_size", minimum=1)
        _check_int(my_rank_in_group, "my_rank_in_group")
        if my_rank_in_group >= sub_world_size:
            raise ConfigError(f"my_rank_in_group {my_rank_in_group} is outside [0, {sub_world_size})")
        self._ensure_open()
        self._replace_group("pp_comm_group", None)
        group = await self._run(
            new_group,
            host=pp_ips[my_pp_stage],
            port=pp_ports[my_pp_stage],
            rank=my_rank_in_group,
            world_size=sub_world_size,
            name=f"reshard_pp{my_pp_stage}",
            timeout_s=self.timeout_s,
        )
        self._replace_group("pp_comm_group", group)
        state = self._refit_transport_state("nccl_reshard")
        state["pp_stage"] = my_pp_stage
        state["pp_size"] = pp_size
        state["rank_in_group"] = my_rank_in_group

    # -- refit (implemented by concrete workers) -------------------------------------
    @abc.abstractmethod
    async def prepare_nccl_reshard_refit_info(
        self, train_parallelism: Any, gen_parallelism: Any, train_world_size: int, gen_world_size: int
    ) -> dict:
        """Compute the reshard plan once; return its wire-safe dict (same on every rank)."""

    @abc.abstractmethod
    async def nccl_reshard_refit(
        self, kv_scales: dict[str, float] | None = None, refit_timeout_s: float | None = None
    ) -> Any:
        """Send one refit over the per-stage groups; bounded by ``refit_timeout_s``."""

    # -- training chores -------------------------------------------------------------
    @abc.abstractmethod
    async def get_reference_policy_logprobs(self, *, data: Any, micro_batch_size: int | None = None) -> Any:
        """Log-probs of ``data`` under the reference policy (see TorchPolicyWorker)."""

    async def finalize_async_save(self) -> None:
        """Block until a pending background checkpoint save finished; raise its error."""
        future = getattr(self, "_pending_save", None)
        if future is None:
            return None
        from ._aio import run_in_executor

        try:
            await run_in_executor(None, future.result)
        finally:
            if getattr(self, "_pending_save", None) is future:
                self._pending_save = None
        return None

    async def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """End of training: finish pending saves; subclasses release training state."""
        await self.finalize_async_save()
