"""AbstractPolicyWorker: the trainer-side worker's async core and its seed surface.

The surface follows NeMo RL's ``AbstractPolicyWorker`` name for name. One instance
per training rank; it runs inside an asyncio loop (uvloop when installed, plain
asyncio, or anyio). Methods that wait on peers or move tensors are ``async def`` and
run their blocking body on the worker's single refit executor thread; cheap queries
(``is_alive``, ``get_zmq_address``, ``stand_down_refit_watchdog``) are plain methods
that never block and never touch CUDA, so a controller can call them while a refit
is stuck.

Every refit goes through the core's one road (``attach_transport`` / ``refit``); the
seed's named methods below are thin shims onto it:

* ``init_nccl_reshard_comm_group`` + ``prepare_nccl_reshard_refit_info`` are the attach
  steps of ``nccl_reshard`` (its stage group, its plan); ``nccl_reshard_refit`` is
  ``refit("nccl_reshard", ...)`` (attaching first when the group or plan changed;
  the connect then runs inside the refit's deadline);
* ``maybe_init_zmq`` opens the colocated pair's socket; ``prepare_zmq_refit_info`` +
  ``stream_weights_via_ipc_zmq`` attach and refit ``zmq``;
* ``connect_sglang_rollout_engines`` attaches ``sglang_ipc``; ``sglang_refit`` refits it.

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
from collections.abc import Sequence
from typing import Any

from collections.abc import Mapping

import torch

from .comm import CommGroup, new_group
from .core import Attachment, WorkerCore
from .errors import ConfigError, TransportError
from .layout.local import any_dtensor, check_local_tensors, is_dtensor, plan_for_source, shard_views, validate_kv_scales
from .layout.plan import ReshardPlan
from .layout.planner import build_plan
from .transports.base import RefitReport

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


class AbstractPolicyWorker(WorkerCore, abc.ABC):
    """Trainer-side worker: the seed surface over the core's generic refit road.

    Subclasses provide ``_named_tensors()`` (the model's tensors by name; live
    parameters), ``_refit_model_source()`` (what plans are built from) and the
    training chores. ``transport_options`` (transport name → setup mapping, e.g.
    ``{"nccl_reshard": {"bucket_bytes": 16 << 20}}``) are checked now (``ConfigError``)
    and used by the seed shims when they attach.
    """

    role = "trainer"
    transport_role = "send"

    def __init__(self, *, rank: int = 0, world_size: int = 1,
                 transport_options: Mapping[str, Mapping[str, Any]] | None = None, **kwargs: Any) -> None:
        # Validate before the core starts its executor thread: a bad argument leaves nothing behind.
        _check_int(world_size, "world_size", minimum=1)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= world_size:
            raise ConfigError(f"rank {rank} is outside the trainer world [0, {world_size})")
        super().__init__(rank=rank, transport_options=transport_options, **kwargs)
        self.world_size = world_size
        self.train_world_size: int | None = None

    reshard_options = property(lambda self: self.transport_options("nccl_reshard"),
                               lambda self, v: self.set_transport_options("nccl_reshard", v),
                               doc="Setup options of nccl_reshard (bucket_bytes, in_flight, staging, checksum).")
    zmq_options = property(lambda self: self.transport_options("zmq"),
                           lambda self, v: self.set_transport_options("zmq", v),
                           doc="Setup options of zmq (bucket_bytes, staging, staged, flatten, ...).")
    sglang_options = property(lambda self: self.transport_options("sglang_ipc"),
                              lambda self, v: self.set_transport_options("sglang_ipc", v),
                              doc="Setup options of sglang_ipc (bucket_bytes).")

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

    def _plan_tensors(self, plan: ReshardPlan) -> Mapping[str, torch.Tensor]:
        """This rank's shards in ``plan``'s training layout: views of the named tensors, or
        the live named tensors themselves for a plan with one full source (colocated)."""
        if plan.body.train_world_size == 1:
            return self._named_tensors()
        return shard_views(plan, self.rank, self._named_tensors())

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
        from .layout.local import as_plan

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
        Sets ``pp_comm_group``; a second call replaces it. An attach step of
        ``nccl_reshard``: the next ``nccl_reshard_refit`` attaches with this group.
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
        state = self._refit_transport_state("nccl_reshard")
        await self._retire_groups(state, ("seed_group", "group"))
        group = await self._run(
            new_group,
            host=pp_ips[my_pp_stage],
            port=pp_ports[my_pp_stage],
            rank=my_rank_in_group,
            world_size=sub_world_size,
            name=f"reshard_pp{my_pp_stage}",
            timeout_s=self.timeout_s,
            device=self.device,
        )
        state.update(seed_group=group, pp_stage=my_pp_stage, pp_size=pp_size, rank_in_group=my_rank_in_group)

    @property
    def pp_comm_group(self) -> CommGroup | None:
        """This rank's pipeline-stage group of ``nccl_reshard`` (None before it was joined)."""
        return self._peek_state("nccl_reshard").get("seed_group")

    # -- nccl_reshard (seed shims) -----------------------------------------------------------
    async def prepare_nccl_reshard_refit_info(
        self, train_parallelism: Any, gen_parallelism: Any, train_world_size: int, gen_world_size: int
    ) -> dict:
        """Compute the reshard plan (once) and return its wire-safe dict, equal on every rank.

        Checks this rank's local tensors against the plan: a mismatch is a
        ``ConfigError`` now, not a failure mid-refit. The plan replaces any earlier one.
        """
        self._ensure_open()
        plan = await self._run(
            plan_for_source, self._refit_model_source(), train_parallelism, gen_parallelism,
            train_world_size, gen_world_size, dtype=self._refit_dtype(), config=self._refit_gen_config(),
        )
        plan = self._adopt_plan("nccl_reshard", plan)
        state = self._refit_transport_state("nccl_reshard")
        state["seed_plan"] = state["plan"] = plan
        return plan.refit_info()

    @property
    def refit_version(self) -> int:
        """The version of the last refit this trainer sent over ``nccl_reshard`` (0: none yet).

        The next ``nccl_reshard_refit`` sends ``refit_version + 1``. A controller that
        starts a replacement trainer sets it to the survivors' value so every trainer
        of a refit announces the same version.
        """
        return int(self._peek_state("nccl_reshard").get("version", 0))

    @refit_version.setter
    def refit_version(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"refit_version must be an int >= 0, got {value!r}")
        self._refit_transport_state("nccl_reshard")["version"] = value

    async def nccl_reshard_refit(
        self, kv_scales: dict[str, float] | None = None, refit_timeout_s: float | None = None
    ) -> RefitReport:
        """``refit("nccl_reshard", kv_scales=..., refit_timeout_s=...)`` after the attach steps.

        ``kv_scales`` (rank 0's are sent) travel over ``model_update_group`` after the
        bulk. With ``refit_timeout_s`` the watchdog aborts the groups when it passes
        and this raises ``RefitTimeout``; the version then does not advance and the
        rollouts keep their last committed weights (or are marked torn).
        """
        self._check_refit_timeout(refit_timeout_s)
        validate_kv_scales(kv_scales)
        self._ensure_open()
        state = self._refit_transport_state("nccl_reshard")
        if state.get("seed_plan") is None:
            raise ConfigError("call prepare_nccl_reshard_refit_info before nccl_reshard_refit", rank=self.rank)
        if state.get("seed_group") is None:
            raise ConfigError("call init_nccl_reshard_comm_group before nccl_reshard_refit", rank=self.rank)
        if self.model_update_group is None:
            raise ConfigError("call init_collective before nccl_reshard_refit", rank=self.rank)
        await self._seed_attach("nccl_reshard", plan=state["seed_plan"], group=state["seed_group"],
                                stage=state.get("pp_stage", 0))
        return await self.refit("nccl_reshard", refit_timeout_s=refit_timeout_s, kv_scales=kv_scales)

    # -- zmq (seed shims) -------------------------------------------------------------------
    def maybe_init_zmq(self) -> None:
        """Create this side's ZMQ socket once (idempotent): bounded send/recv, linger 0.

        The trainer binds the device's endpoint (``get_zmq_address``); the colocated
        rollout connects. The socket is handed to the ``zmq`` transport when it attaches.
        """
        self._ensure_open()
        _open_pair_socket(self, bind=True)

    @property
    def zmq_socket(self):
        return self._peek_state("zmq").get("socket")

    async def prepare_zmq_refit_info(self, gen_parallelism: Any, gen_world_size: int) -> dict:
        """Build the one-source plan (this trainer holds full tensors); return its dict.

        Pass the dict to every colocated rollout's ``load_colocated_plan``.
        """
        self._ensure_open()
        plan = await self._run(build_plan, self._refit_model_source(), "tp=1", gen_parallelism, 1, gen_world_size,
                               dtype=self._refit_dtype())
        plan = self._adopt_plan("zmq", plan)
        state = self._refit_transport_state("zmq")
        state["seed_plan"] = state["plan"] = plan
        return plan.refit_info()

    async def stream_weights_via_ipc_zmq(self, *, kv_scales: dict[str, float] | None = None,
                                         refit_timeout_s: float | None = None) -> RefitReport:
        """``refit("zmq", ...)``: offer one refit to the colocated rollout; return once it landed.

        The trainer must not write its parameters until this returns. With
        ``refit_timeout_s`` the watchdog cuts the waits short: ``RefitTimeout``.
        """
        self._check_refit_timeout(refit_timeout_s)
        validate_kv_scales(kv_scales)
        self._ensure_open()
        state = self._refit_transport_state("zmq")
        if state.get("seed_plan") is None:
            raise ConfigError("call prepare_zmq_refit_info before stream_weights_via_ipc_zmq", rank=self.rank)
        self.maybe_init_zmq()
        await self._seed_attach("zmq", plan=state["seed_plan"], timeout_s=self.zmq_timeout_s)
        return await self.refit("zmq", refit_timeout_s=refit_timeout_s, kv_scales=kv_scales)

    # -- sglang_ipc (seed shims) ------------------------------------------------------------
    async def connect_sglang_rollout_engines(
        self, *, engine_gpu_counts: Sequence[int], engine_gpu_offsets: Sequence[int] | None = None
    ) -> None:
        """Attach ``sglang_ipc``: group trainer ranks per colocated SGLang engine (collective).

        ``engine_gpu_counts[e]``: GPUs (tp ranks) of engine e; ``engine_gpu_offsets[e]``
        its first GPU = trainer rank (default: the running sum). Engines must not
        overlap and must fit the trainer world (``ConfigError``, state unchanged).
        The same layout again is a no-op; a changed layout or a new update group
        rebuilds the groups. The connect checks manifests and exchanges buffers, so a
        bad pairing fails here, not in the first refit.
        """
        from .transports.sglang_groups import EngineLayout

        EngineLayout.build(engine_gpu_counts, engine_gpu_offsets, self.world_size)
        if self.model_update_group is None:
            raise ConfigError("call init_collective first: the engine groups are built on its store",
                              rank=self.rank, transport="sglang_ipc")
        setup = {**self._seed_setup.get("sglang_ipc", {}), "engine_gpu_counts": tuple(engine_gpu_counts),
                 "engine_gpu_offsets": None if engine_gpu_offsets is None else tuple(engine_gpu_offsets)}
        await self.attach_transport("sglang_ipc", **setup)

    async def sglang_refit(
        self,
        *,
        engine: Any = None,
        refit_timeout_s: float | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        torch_empty_cache: bool = False,
    ) -> RefitReport:
        """``refit("sglang_ipc", ...)``: push the current weights into this rank's engine.

        Collective over the ranks of each engine. ``engine`` is needed on the gather
        source only; other ranks pass None. A refused bucket raises ``TransportError``
        on every rank of the engine; a passed ``refit_timeout_s`` aborts the group and
        raises ``RefitTimeout``. The version advances only on success. Ranks on no
        engine return a report with 0 bytes.
        """
        self._check_refit_timeout(refit_timeout_s)
        self._ensure_open()
        if "sglang_ipc" not in self._attachments:
            raise ConfigError("call connect_sglang_rollout_engines before sglang_refit", rank=self.rank)
        return await self.refit("sglang_ipc", refit_timeout_s=refit_timeout_s, engine=engine,
                                flush_cache=flush_cache, abort_all_requests=abort_all_requests,
                                torch_empty_cache=torch_empty_cache)

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


def _open_pair_socket(worker: WorkerCore, *, bind: bool) -> None:
    """The colocated pair's DEALER socket on ``get_zmq_address()``, kept in the zmq state."""
    state = worker._refit_transport_state("zmq")
    if state.get("socket") is not None:  # every refit: return before any import
        return
    from .transports.zmq_channel import open_socket

    address = worker.get_zmq_address()
    try:
        zctx, sock = open_socket(address, bind=bind, timeout_s=worker.zmq_timeout_s)
    except TransportError as exc:  # a bad endpoint (path too long, no such dir) is bad config here
        raise ConfigError(f"cannot open ZMQ endpoint {address}: {exc}", rank=worker.rank) from exc
    state["zmq_context"], state["socket"] = zctx, sock

    def close() -> None:
        # The zmq transport, once attached, owns (and closes) the socket; else it is closed here.
        if state.get("socket") is sock:
            state.pop("socket", None)
            state.pop("zmq_context", None)
            sock.close(0)
            zctx.term()

    worker._closers.append(close)
