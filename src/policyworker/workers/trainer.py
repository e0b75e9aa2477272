"""AbstractPolicyWorker: the trainer-side worker's async core and its seed surface.

The surface follows NeMo RL's ``AbstractPolicyWorker`` name for name. One instance
per training rank; it runs inside an asyncio loop (uvloop when installed, plain
asyncio, or anyio). Methods that wait on peers or move tensors are ``async def`` and
run their blocking body on the worker's single refit executor thread; cheap queries
(``is_alive``, ``get_zmq_address``, ``stand_down_refit_watchdog``) are plain methods
that never block and never touch CUDA, so a controller can call them while a refit
is stuck.

Every refit goes through the core's one road (``attach_transport`` / ``refit`` /
``detach_transport``); NeMo's per-transport names (``init_nccl_reshard_comm_group``,
``nccl_reshard_refit``, ``maybe_init_zmq``, ``connect_sglang_rollout_engines``, ...)
are thin shims onto it, inherited from :class:`~policyworker.workers.nemo_compat.TrainerCompat`.

Which tensors a refit moves (``_transport_params``): for a plan-less transport, the
model's named parameters (``_named_tensors``: local tensors by name); for a plan with
one full source (colocated), the same full tensors; otherwise this rank's shards of
the plan (``_plan_tensors``).

Group ranks: the update group (``init_collective``) holds train ranks
``[0, train_world_size)`` then the inference ranks after them. A pipeline stage's
group (``init_nccl_reshard_comm_group``) holds that stage's trainers first, then the
generation ranks; the caller passes this rank's index in it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

import torch

from policyworker.workers.core import Attachment, WorkerCore
from policyworker.errors import ConfigError
from policyworker.layout.local import any_dtensor, check_local_tensors, is_dtensor, shard_views
from policyworker.layout.plan import ReshardPlan
from policyworker.workers.nemo_compat import TrainerCompat

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


@dataclass(frozen=True, slots=True)
class RefitSource:
    """What plans are built from (:meth:`AbstractPolicyWorker.refit_source`)."""

    model: Any  # a ModelConfig, {name: (shape, dtype)} or DTensors
    gen_config: Any  # a ModelConfig placing a DTensor source's generation side by heads, or None
    dtype: Any  # dtype of a ModelConfig's parameters in the plan


class AbstractPolicyWorker(TrainerCompat, WorkerCore, abc.ABC):
    """Trainer-side worker: the seed surface over the core's generic refit road.

    Subclasses provide ``_named_tensors()`` (the model's tensors by name; live
    parameters), ``_refit_model_source()`` (what plans are built from) and the
    training chores. A transport's setup is given when it is attached:
    ``attach_transport(name, **setup)``.
    """

    role = "trainer"
    transport_role = "send"

    def __init__(self, *, rank: int = 0, world_size: int = 1, **kwargs: Any) -> None:
        # Validate before the core starts its executor thread: a bad argument leaves nothing behind.
        _check_int(world_size, "world_size", minimum=1)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= world_size:
            raise ConfigError(f"rank {rank} is outside the trainer world [0, {world_size})")
        super().__init__(rank=rank, **kwargs)
        self.world_size = world_size
        self.train_world_size: int | None = None

    # -- which tensors a refit moves --------------------------------------------------
    def _named_tensors(self) -> Mapping[str, torch.Tensor]:
        """The model's tensors by name (live objects: a transport may re-point storages)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _named_tensors()")

    def _refit_model_source(self) -> Any:
        """What plans are built from: a ModelConfig, ``{name: (shape, dtype)}`` or DTensors."""
        raise NotImplementedError(f"{type(self).__name__} must implement _refit_model_source()")

    def _refit_gen_config(self) -> Any:
        """A ModelConfig placing a DTensor source's generation side by heads (default: none)."""
        return None

    def _refit_dtype(self) -> Any:
        """dtype of a ModelConfig's parameters in the plan (default bf16)."""
        return torch.bfloat16

    def refit_source(self) -> RefitSource:
        """What a plan for this worker is built from (integrations that plan themselves,
        e.g. the vLLM backends, read it here): the model source, the generation-side
        config (or None) and the dtype of a ModelConfig's parameters."""
        return RefitSource(self._refit_model_source(), self._refit_gen_config(), self._refit_dtype())

    def _plan_tensors(self, plan: ReshardPlan) -> Mapping[str, torch.Tensor]:
        """This rank's shards in ``plan``'s training layout: views of the named tensors, or
        the live named tensors themselves for a plan with one full source (colocated)."""
        full = self._named_tensors()
        if plan.body.train_world_size == 1:
            return full
        # The views are kept while every full tensor keeps its storage, shape, strides and
        # dtype (checked each refit, ~1 µs a tensor): making them costs tens of µs a
        # tensor, every refit — most of the fixed cost of a refit of many small tensors.
        key = (plan.hash, self.rank,
               tuple((n, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for n, t in full.items()))
        kept = getattr(self, "_shard_views_kept", None)
        if kept is None or kept[0] != key:
            kept = self._shard_views_kept = (key, shard_views(plan, self.rank, full))
        return kept[1]

    def _transport_params(self, att: Attachment) -> Mapping[str, torch.Tensor]:
        return self._local_tensors(att.plan)

    def _local_tensors(self, plan: ReshardPlan | None) -> dict[str, torch.Tensor]:
        """What a refit over ``plan`` (None: plan-less) moves, DTensors read as their local shards."""
        tensors = self._named_tensors() if plan is None else self._plan_tensors(plan)
        if not any_dtensor(tensors.values()):  # runs every refit: one check per type, no per-tensor branch
            return dict(tensors)
        return {k: (v.to_local() if is_dtensor(v) else v) for k, v in tensors.items()}

    def _adopt_plan(self, name: str, plan: Any) -> Any:
        if plan is None:
            return None
        from policyworker.layout.local import as_plan

        plan = as_plan(plan)
        rank = 0 if plan.body.train_world_size == 1 else self.rank
        if rank >= plan.body.train_world_size:
            raise ConfigError(f"train rank {self.rank} is outside the plan's {plan.body.train_world_size} ranks")
        check_local_tensors(plan, "src", rank, self._local_tensors(plan))
        return plan

    # -- collectives -----------------------------------------------------------------
    async def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int, nccl_peer: str = "nemo"
    ) -> None:
        """Build ``model_update_group`` over trainers and inference ranks (re-entrant).

        Trainers are ranks ``[0, train_world_size)``; inference ranks follow. Rank 0
        hosts the store at ``(ip, port)``. A warm-up broadcast, checked by every rank,
        proves the group works. Calling it again replaces the old group (recovery):
        every transport's groups belong to the old world and are aborted; every
        attached transport connects again at its next refit.
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
        await self._new_update_group(ip, port, world_size, self.rank)
        self.train_world_size = train_world_size

    # -- training chores (implemented by concrete workers) -------------------------------
    @abc.abstractmethod
    async def get_reference_policy_logprobs(self, *, data: Any, micro_batch_size: int | None = None) -> Any:
        """Log-probs of ``data`` under the reference policy (see TorchPolicyWorker)."""

    async def finalize_async_save(self) -> None:
        """Block until pending background checkpoint saves finished; raise their error.

        This worker saves nothing in the background, so there is nothing to wait for;
        workers that do (`TorchPolicyWorker`) override it."""
        return None

    async def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """End of training: finish pending saves; subclasses release training state."""
        await self.finalize_async_save()
