"""RolloutWorker: the generation-side peer of the trainer workers.

It receives refits through the core's one road (``attach_transport`` / ``refit``) and
keeps what it holds in a :class:`~policyworker.ledger.WeightLedger`: a refit of
version v commits only after the transport returned (every expected byte arrived,
every rank agreed). Otherwise the worker stays at v-1; if bytes of the live tensors
were already overwritten it is *torn*: ``weights()`` raises ``TornWeights`` until a
full refit commits, and ``RefitInProgress`` while a refit is in flight.

With ``double_buffer=True`` a refit lands in a second set of tensors shaped like the
live one (:mod:`~policyworker.workers.staging`) and commits by swapping the two sets under the
ledger's lock: ``weights()`` keeps serving version v for the whole transfer, and a
failed refit leaves v served, never torn. The cost is one more copy of this rank's
weights (``staging_bytes``). The set a commit retires becomes the next refit's
landing set, so tensors from ``weights()`` must not be read after the *next* refit
started. The default is the in-place path (no extra memory, not servable mid-refit).

Destination tensors: given directly (``RolloutWorker(params={name: tensor})``) for
plan-less transports, or allocated from a plan when a transport attaches with one
(its own tp shard, fused ``qkv_proj`` / ``gate_up_proj`` where the plan says so, as
views of one flat buffer in the plan's order) unless the held tensors already fit it.
A plan that the caller's own tensors do not fit is a ``ConfigError``; they are never
swapped for allocated ones.

Seed-style names (``init_nccl_reshard_comm_groups`` + ``load_refit_plan`` +
``receive_nccl_reshard_refit``; ``maybe_init_zmq`` + ``load_colocated_plan`` +
``update_weights_via_ipc_zmq``) are thin shims onto the road, inherited from
:class:`~policyworker.workers.nemo_compat.RolloutCompat`. The update group holds this worker
as rank ``train_world_size + rank``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from policyworker.workers.core import Attachment, WorkerCore
from policyworker.errors import ConfigError
from policyworker.layout.apply import empty_local_tensors
from policyworker.layout.local import as_plan
from policyworker.layout.plan import ReshardPlan
from policyworker.ledger import WeightLedger
from policyworker.workers.nemo_compat import RolloutCompat
from policyworker.workers.staging import same_structure, storage_bytes, twin_tensors
from policyworker.transports.base import RefitReport, TransportContext
from policyworker.workers.trainer import SUPPORTED_NCCL_PEERS, _check_int

__all__ = ["RolloutWorker"]


class RolloutWorker(RolloutCompat, WorkerCore):
    """Generation-side worker. ``rank`` is its rank among the generation ranks.

    ``params``: destination tensors by name (plan-less transports; plans check them).
    A transport's setup is given when it is attached: ``attach_transport(name, **setup)``.
    ``double_buffer``: land refits in a second set and commit by a swap (see module docstring).
    """

    role = "rollout"
    transport_role = "receive"

    def __init__(
        self, *, rank: int = 0, gen_world_size: int = 1, params: Mapping[str, torch.Tensor] | None = None,
        double_buffer: bool = False, **kwargs: Any
    ) -> None:
        if not isinstance(double_buffer, bool):
            raise ConfigError(f"double_buffer must be a bool, got {double_buffer!r}")
        _check_int(gen_world_size, "gen_world_size", minimum=1)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= gen_world_size:
            raise ConfigError(f"rollout rank {rank} is outside the generation world [0, {gen_world_size})")
        if params is not None:
            if not isinstance(params, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items()):
                raise ConfigError("params must map names (str) to tensors")
        super().__init__(rank=rank, **kwargs)
        self.gen_world_size = gen_world_size
        self.world_size = gen_world_size
        self.kv_scales: dict[str, float] | None = None
        self.params: dict[str, torch.Tensor] = dict(params or {})
        #: The dict this worker allocated from a plan; any other ``params`` are the caller's
        #: tensors, never replaced behind their back.
        self._allocated: dict[str, torch.Tensor] | None = None
        self.last_report: RefitReport | None = None
        self._ready = None  # the last refit's ready event (CUDA), see weights()
        self.double_buffer = double_buffer
        self._back: dict[str, torch.Tensor] | None = None  # the landing set (double_buffer)
        #: Destinations made on demand (``TransportContext.landing``): set by a consumer whose
        #: ``params`` hold ``meta`` placeholders (the vLLM backend's ``staging="none"``).
        self.landing: Any = None
        self.ledger = WeightLedger(rank=rank, what="rollout", staged=double_buffer,
                                   on_commit=self._swap if double_buffer else None)

    # -- versions ----------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The last committed version (0: none yet)."""
        return self.ledger.version

    @property
    def torn(self) -> bool:
        return self.ledger.torn

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The live weights for serving; ``TornWeights`` while torn, ``RefitInProgress`` mid-refit.

        On CUDA the calling thread's current stream is first made to wait (on the GPU,
        not the host) for the last refit's ready event, so kernels it queues read the
        committed bytes.
        """
        return self.served()[1]

    def served(self) -> tuple[int, Mapping[str, torch.Tensor]]:
        """``(version, weights())``, read together: the tensors hold exactly that version."""
        version, params = self.ledger.serve(lambda: self.params)
        ready = self._ready
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return version, params

    @property
    def staging_bytes(self) -> int:
        """Extra memory of the second set (``double_buffer``; 0 before the first refit or without)."""
        return storage_bytes(self._back) if self._back is not None else 0

    def _swap(self, version: int) -> None:
        if self._back is not None:
            self.params, self._back = self._back, self.params

    # -- the road's hooks ----------------------------------------------------------------
    async def _attach(self, name: Any, setup: Mapping[str, Any]) -> Attachment:
        if self.double_buffer and setup.get("delta"):
            # A delta lands changes on top of the set it writes, which holds the version
            # before the last one: refused rather than failing every other refit.
            raise ConfigError("delta refits need the in-place path: a double_buffer rollout lands each refit in "
                              "the set two versions old", rank=self.rank)
        return await super()._attach(name, setup)

    def _transport_params(self, att: Attachment) -> Mapping[str, torch.Tensor]:
        if not self.double_buffer:
            return self.params
        if self._back is None or not same_structure(self.params, self._back):
            self._back = twin_tensors(self.params)
        return self._back

    def _adopt_plan(self, name: str, plan: Any) -> Any:
        if plan is None:
            return None
        plan = as_plan(plan)
        if plan.body.gen_world_size != self.gen_world_size:
            raise ConfigError(
                f"the plan is for {plan.body.gen_world_size} generation ranks, this world has {self.gen_world_size}"
            )
        if not self.params:
            self._allocate(plan)
            return plan
        misfit = _misfit(plan, self.rank, self.params)
        if misfit is None:
            return plan
        if self.params is not self._allocated:  # the caller's tensors: refuse, never swap them
            raise ConfigError(f"rollout rank {self.rank}: the given params do not fit the plan: {misfit}",
                              rank=self.rank)
        if self.ledger.version > 0:  # committed weights of another layout: refuse rather than drop them
            raise ConfigError(f"rollout rank {self.rank}: the committed weights do not fit the plan: {misfit}",
                              rank=self.rank)
        self._allocate(plan)
        return plan

    def _check_fit(self, plan: ReshardPlan, params: Mapping[str, torch.Tensor] | None) -> None:
        """``ConfigError`` unless ``plan`` is for this world and ``params`` (if given) fit it."""
        if plan.body.gen_world_size != self.gen_world_size:
            raise ConfigError(f"the plan is for {plan.body.gen_world_size} generation ranks, "
                              f"this world has {self.gen_world_size}")
        misfit = None if params is None else _misfit(plan, self.rank, params)
        if misfit is not None:
            raise ConfigError(f"rollout rank {self.rank}: the given params do not fit the plan: {misfit}",
                              rank=self.rank)

    def _allocate(self, plan: ReshardPlan) -> None:
        self.params = {k: v.zero_() for k, v in
                       empty_local_tensors(plan, "dst", self.rank, self.device, flat=True).items()}
        self._allocated = self.params

    def _expected_bytes(self, att: Attachment) -> int | None:
        if att.plan is None:
            return None
        return att.plan.recv_bytes_per_dst_rank().get(self.rank, 0)

    def _after_refit(self, att: Attachment, ctx: TransportContext, report: RefitReport) -> None:
        self.kv_scales = report.kv_scales
        self.last_report = report
        self._ready = ctx.ready

    # -- collectives -----------------------------------------------------------------------
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
        await self._new_update_group(ip, port, world_size, train_world_size + self.rank)


def _misfit(plan: ReshardPlan, rank: int, tensors: Mapping[str, torch.Tensor]) -> str | None:
    """What keeps ``tensors`` from being ``rank``'s destination tensors of ``plan`` (None: they fit).

    Names the missing and unexpected tensors and each shape/dtype that differs (a few of
    each), so a caller sees every way the layouts part, not only the first.
    """
    want = plan.local_tensors("dst", rank)
    parts = []
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing:
        parts.append(f"{len(missing)} missing ({', '.join(map(repr, missing[:4]))}{', ...' if len(missing) > 4 else ''})")
    if extra:
        parts.append(f"{len(extra)} not in the plan ({', '.join(map(repr, extra[:4]))}{', ...' if len(extra) > 4 else ''})")
    differ = []
    for name in sorted(set(want) & set(tensors)):
        t, spec = tensors[name], want[name]
        have = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        need = f"{spec.dtype}{list(spec.shape)}"
        if have != need:
            differ.append(f"{name!r} is {have}, the plan says {need}")
    if differ:
        parts.append(f"{len(differ)} differ ({'; '.join(differ[:4])}{'; ...' if len(differ) > 4 else ''})")
    if not missing and not differ:
        return None  # tensors the plan does not name are left alone
    return "; ".join(parts)
