"""The trainer side of ``nccl_reshard`` for any worker that can name its local tensors.

:class:`NcclReshardMixin` implements ``prepare_nccl_reshard_refit_info`` and
``nccl_reshard_refit`` on top of two hooks a concrete worker provides:

* ``_refit_local_params(plan)`` — this rank's local tensors by name (its shards in
  the training layout; DTensors are read through ``to_local()``). A worker holding
  full tensors can return :func:`shard_views` of them;
* ``_refit_model_source()`` — what the plan is computed from: a ``ModelConfig``, a
  ``{name: (shape, dtype)}`` mapping (placement rules apply), or a state dict of
  DTensors (their placements *are* the training layout; no rules).

State lives in ``_refit_transport_state("nccl_reshard")``: the plan, the transport,
its ring buffers, the group handles and the last sent ``version``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .errors import ConfigError
from .layout.plan import ReshardPlan
from .layout.planner import as_parallelism, build_plan, plan_from_layouts
from .transports.base import RefitReport, TransportContext
from .transports.nccl_reshard import NcclReshardTransport

__all__ = ["NcclReshardMixin", "check_local_tensors", "plan_for_source", "shard_views", "validate_kv_scales"]


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # very old torch: no DTensor, so nothing is one
        return False
    return isinstance(t, DTensor)


def plan_for_source(
    source: Any,
    train_parallelism: Any,
    gen_parallelism: Any,
    train_world_size: int,
    gen_world_size: int,
    *,
    gen_fused: bool = True,
    dtype: Any = "bfloat16",
) -> ReshardPlan:
    """The reshard plan from a ModelConfig / specs (rules) or a DTensor state dict.

    ``dtype`` applies to a ModelConfig's parameters (specs and DTensors carry their own).
    """
    if isinstance(source, Mapping) and source and all(_is_dtensor(t) for t in source.values()):
        from .layout.dtensor import dtensor_layout, dtensor_specs
        from .layout.rules import rule_layout

        gen = as_parallelism(gen_parallelism, "gen")
        gen.check_world_size(gen_world_size, side="gen")
        specs = dtensor_specs(source)
        src = dtensor_layout(source, world_size=train_world_size)
        dst = rule_layout(specs, gen, fused=gen_fused)
        train = as_parallelism(train_parallelism, "train") if train_parallelism is not None else None
        return plan_from_layouts(specs, src, dst, train=train, gen=gen, gen_fused=gen_fused)
    return build_plan(source, train_parallelism, gen_parallelism, train_world_size, gen_world_size,
                      gen_fused=gen_fused, dtype=dtype)


def check_local_tensors(plan: ReshardPlan, side: str, rank: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ConfigError`` unless ``tensors`` are exactly the plan's local tensors of ``rank``."""
    want = plan.local_tensors(side, rank)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ConfigError(f"{side} rank {rank} lacks {len(missing)} local tensors the plan needs, e.g. {missing[0]!r}",
                          rank=rank, param=missing[0])
    for name, spec in want.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(spec.shape) or str(t.dtype).removeprefix("torch.") != spec.dtype:
            raise ConfigError(
                f"{side} rank {rank}: {name!r} is {str(t.dtype).removeprefix('torch.')}{list(t.shape)}, "
                f"the plan says {spec.dtype}{list(spec.shape)}", rank=rank, param=name)


def shard_views(plan: ReshardPlan, rank: int, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Training rank ``rank``'s local tensors as *views* of full tensors (no copies).

    Each local tensor must be one box of one parameter (true of every non-fused
    training layout); the views then follow the full tensors as they train.
    """
    params = plan.params
    out = {}
    for name, spec in plan.local_tensors("src", rank).items():
        if len(spec.pieces) != 1 or any(spec.pieces[0].at):
            raise ConfigError(f"local tensor {name!r} of train rank {rank} is not a single box of one parameter",
                              rank=rank, param=name)
        piece = spec.pieces[0]
        pname = params[piece.param].name
        t = full.get(pname)
        if t is None:
            raise ConfigError(f"train rank {rank} has no full tensor {pname!r}", rank=rank, param=pname)
        if tuple(t.shape) != tuple(params[piece.param].shape):
            raise ConfigError(f"{pname!r} is {list(t.shape)}, the plan says {list(params[piece.param].shape)}",
                              rank=rank, param=pname)
        view = t.detach()
        for d, (a, b) in enumerate(zip(piece.start, piece.stop)):
            view = view.narrow(d, a, b - a)
        out[name] = view
    return out


def validate_kv_scales(kv_scales: Any) -> dict[str, float] | None:
    if kv_scales is None:
        return None
    if not isinstance(kv_scales, Mapping):
        raise ConfigError(f"kv_scales must be a mapping of name to float, got {type(kv_scales).__name__}")
    out = {}
    for k, v in kv_scales.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"kv_scales entry {k!r}: {v!r} is not a finite float")
        out[k] = float(v)
    return out


class NcclReshardMixin:
    """Trainer-side ``nccl_reshard``; mix into an ``AbstractPolicyWorker`` subclass."""

    #: Options of the NcclReshardTransport (bucket_bytes, in_flight, checksum).
    reshard_options: dict[str, Any] = {}

    def _refit_local_params(self, plan: ReshardPlan) -> Mapping[str, torch.Tensor]:
        raise NotImplementedError

    def _refit_model_source(self) -> Any:
        raise NotImplementedError

    def _refit_dtype(self) -> Any:
        """dtype of a ModelConfig's parameters in the plan (default bf16)."""
        return torch.bfloat16

    def _local_tensors(self, plan: ReshardPlan) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self._refit_local_params(plan).items():
            t = t.to_local() if _is_dtensor(t) else t
            out[name] = t.detach()
        return out

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
            train_world_size, gen_world_size, dtype=self._refit_dtype(),
        )
        if self.rank >= plan.body.train_world_size:
            raise ConfigError(f"train rank {self.rank} is outside the plan's {plan.body.train_world_size} ranks")
        local = self._local_tensors(plan)
        await self._run(check_local_tensors, plan, "src", self.rank, local)
        state = self._refit_transport_state("nccl_reshard")
        state["plan"] = plan
        state.pop("connected_hash", None)
        return plan.refit_info()

    @property
    def refit_version(self) -> int:
        """The version of the last refit this trainer sent successfully (0: none yet).

        The next ``nccl_reshard_refit`` sends ``refit_version + 1``. A controller that
        starts a replacement trainer sets it to the survivors' value so every trainer
        of a refit announces the same version.
        """
        return int(self._refit_transport_state("nccl_reshard").get("version", 0))

    @refit_version.setter
    def refit_version(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"refit_version must be an int >= 0, got {value!r}")
        self._refit_transport_state("nccl_reshard")["version"] = value

    def _reshard_transport(self, state: dict) -> NcclReshardTransport:
        transport = state.get("transport")
        if transport is None:
            transport = state["transport"] = NcclReshardTransport(**self.reshard_options)
        return transport

    async def nccl_reshard_refit(
        self, kv_scales: dict[str, float] | None = None, refit_timeout_s: float | None = None
    ) -> RefitReport:
        """Send one refit of this rank's tensors to the generation ranks, per the plan.

        ``kv_scales`` (rank 0's are sent) travel over ``model_update_group`` after the
        bulk. With ``refit_timeout_s`` the watchdog aborts the groups when it passes
        and this raises ``RefitTimeout``; the version then does not advance and the
        rollouts keep their last committed weights (or are marked torn).
        """
        timeout = self._check_refit_timeout(refit_timeout_s)
        scales = validate_kv_scales(kv_scales)
        self._ensure_open()
        state = self._refit_transport_state("nccl_reshard")
        plan = state.get("plan")
        if plan is None:
            raise ConfigError("call prepare_nccl_reshard_refit_info before nccl_reshard_refit", rank=self.rank)
        if self.pp_comm_group is None:
            raise ConfigError("call init_nccl_reshard_comm_group before nccl_reshard_refit", rank=self.rank)
        if self.model_update_group is None:
            raise ConfigError("call init_collective before nccl_reshard_refit", rank=self.rank)
        # Local tensors are looked up per refit: a trainer may have re-allocated them.
        local = self._local_tensors(plan)
        check_local_tensors(plan, "src", self.rank, local)
        transport = self._reshard_transport(state)
        if state.get("group") is not self.pp_comm_group or state.get("update_group") is not self.model_update_group:
            state["group"], state["update_group"] = self.pp_comm_group, self.model_update_group
            state["stage"] = state.get("pp_stage", 0)
            state.pop("connected_hash", None)  # new groups: connect (plan check) again
        ctx = TransportContext(
            worker=self, role="send", rank=self.rank, device=self.device_facts, state=state,
            params=local, plan=plan, options={"kv_scales": scales}, executor=self._executor,
        )
        version = state.get("version", 0) + 1
        report = await self._refit_under_deadline(
            transport, ctx, timeout=timeout, aborts=[self.pp_comm_group.abort, self.model_update_group.abort],
            version=version,
        )
        state["version"] = version
        return report

