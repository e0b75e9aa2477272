"""The ``zmq`` colocated refit on both workers: :class:`ZmqRefitMixin` and :class:`ZmqRolloutMixin`.

Pairing: a trainer and its colocated rollout derive one IPC endpoint from their
shared device id (``WorkerCore.get_zmq_address``); the trainer binds, the rollout
connects (``maybe_init_zmq``). Each trainer holds *full* tensors and serves exactly
one rollout rank g, which pulls ``plan.receives(g)`` of the one-source plan
``build_plan(config, "tp=1", gen, 1, G)``.

Call order per refit: the trainer's ``stream_weights_via_ipc_zmq`` and the rollout's
``update_weights_via_ipc_zmq`` run at the same time (in two processes); each
returns a ``RefitReport``. Versions on the rollout follow ``RolloutWorker``: it
commits only after every expected byte landed and the trainer said Commit; a
failure after bytes landed in place leaves it *torn*.

State: ``_refit_transport_state("zmq")`` on each side holds the plan, the transport,
the socket, exported/opened handles and the version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import ConfigError
from .layout.plan import ReshardPlan
from .layout.planner import build_plan
from .reshard_worker import check_local_tensors, validate_kv_scales
from .transports.base import RefitReport, TransportContext
from .transports.zmq_ipc import ZmqIpcTransport

__all__ = ["ZmqRefitMixin", "ZmqRolloutMixin", "flat_local_tensors"]


def _as_plan(plan_or_info: Any) -> ReshardPlan:
    if isinstance(plan_or_info, ReshardPlan):
        return plan_or_info
    if not isinstance(plan_or_info, Mapping):
        raise ConfigError(f"plan must be a ReshardPlan or its refit-info dict, got {type(plan_or_info).__name__}")
    return ReshardPlan.from_dict({k: v for k, v in plan_or_info.items() if k != "hash"})


def flat_local_tensors(plan: ReshardPlan, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s destination tensors as back-to-back views of one zeroed buffer.

    Ordered by the parameter their first piece comes from (the trainer's order), so
    copies from a flattened trainer coalesce into few, long copies.
    """
    from .transports.ipc_handles import torch_dtype

    tensors = plan.local_tensors("dst", rank)
    order = sorted(tensors, key=lambda n: min((p.param, p.start) for p in tensors[n].pieces))
    offsets, end = {}, 0
    for name in order:
        spec = tensors[name]
        item = torch.empty((), dtype=torch_dtype(spec.dtype)).element_size()
        end = -(-end // item) * item
        offsets[name] = end
        n = 1
        for d in spec.shape:
            n *= d
        end += n * item
    flat = torch.zeros(end, dtype=torch.uint8, device=device)
    out = {}
    for name in order:
        spec = tensors[name]
        dtype = torch_dtype(spec.dtype)
        item = torch.empty((), dtype=dtype).element_size()
        out[name] = torch.empty(0, dtype=dtype, device=device).set_(
            flat.untyped_storage(), offsets[name] // item, spec.shape)
    return out


class ZmqRefitMixin:
    """Trainer side; mix into an ``AbstractPolicyWorker`` subclass.

    Hooks: ``_zmq_full_params()`` (full tensors by parameter name; default: the
    ``_params`` list of ``TorchPolicyWorker``) and ``_zmq_model_source()`` (what
    the plan is built from; default ``_refit_model_source()``). The tensors must be
    the live objects (Parameters), not copies: the transport may re-point their
    storages (into shared memory on CPU, into one buffer with ``flatten``).
    ``zmq_options`` configure :class:`ZmqIpcTransport`.
    """

    zmq_options: dict[str, Any] = {}

    def _zmq_full_params(self) -> Mapping[str, torch.Tensor]:
        params = getattr(self, "_params", None)
        if params is None:
            raise NotImplementedError("override _zmq_full_params() to name this trainer's full tensors")
        return {name: p for name, p in params}

    def _zmq_model_source(self) -> Any:
        source = getattr(self, "_refit_model_source", None)
        if source is None:
            raise NotImplementedError("override _zmq_model_source()")
        return source()

    async def prepare_zmq_refit_info(self, gen_parallelism: Any, gen_world_size: int) -> dict:
        """Build the one-source plan (this trainer holds full tensors); return its dict.

        Pass the dict to every colocated rollout's ``load_colocated_plan``.
        """
        self._ensure_open()
        dtype = self._refit_dtype() if hasattr(self, "_refit_dtype") else torch.bfloat16
        plan = await self._run(build_plan, self._zmq_model_source(), "tp=1", gen_parallelism, 1, gen_world_size,
                               dtype=dtype)
        await self._run(check_local_tensors, plan, "src", 0, self._zmq_full_params())
        state = self._refit_transport_state("zmq")
        state["plan"] = plan
        state.pop("connected_hash", None)
        return plan.refit_info()

    async def stream_weights_via_ipc_zmq(self, *, kv_scales: dict[str, float] | None = None,
                                         refit_timeout_s: float | None = None) -> RefitReport:
        """Offer one refit to the colocated rollout; return once it committed-able landed.

        The trainer must not write its parameters until this returns. With
        ``refit_timeout_s`` the watchdog cuts the waits short: ``RefitTimeout``.
        """
        timeout = self._check_refit_timeout(refit_timeout_s)
        scales = validate_kv_scales(kv_scales)
        self._ensure_open()
        state = self._refit_transport_state("zmq")
        plan = state.get("plan")
        if plan is None:
            raise ConfigError("call prepare_zmq_refit_info before stream_weights_via_ipc_zmq", rank=self.rank)
        self.maybe_init_zmq()
        state["socket"] = self.zmq_socket
        transport = state.get("transport")
        if transport is None:
            transport = state["transport"] = ZmqIpcTransport(timeout_s=self.zmq_timeout_s, **self.zmq_options)
        ctx = TransportContext(worker=self, role="send", rank=self.rank, device=self.device_facts, state=state,
                               params=self._zmq_full_params(), plan=plan, options={"kv_scales": scales},
                               executor=self._executor)
        version = state.get("version", 0) + 1
        report = await self._refit_under_deadline(transport, ctx, timeout=timeout, aborts=[transport.abort],
                                                  version=version)
        state["version"] = version
        return report


class ZmqRolloutMixin:
    """Rollout side; mix into ``RolloutWorker`` (uses its params, versions and torn flag)."""

    zmq_options: dict[str, Any] = {}

    def load_colocated_plan(self, plan_or_info: Any, *, params: Mapping[str, torch.Tensor] | None = None) -> None:
        """Adopt the trainer's one-source plan; allocate (flat, zeroed) or check ``params``."""
        self._ensure_open()
        plan = _as_plan(plan_or_info)
        if plan.body.train_world_size != 1:
            raise ConfigError("a colocated plan has one full source (train 'tp=1', world 1)")
        if plan.body.gen_world_size != self.gen_world_size:
            raise ConfigError(f"the plan is for {plan.body.gen_world_size} generation ranks, "
                              f"this world has {self.gen_world_size}")
        if params is None:
            params = flat_local_tensors(plan, self.rank, self.device)
        else:
            check_local_tensors(plan, "dst", self.rank, params)
        self.params = dict(params)
        state = self._refit_transport_state("zmq")
        state["plan"] = plan
        state["program"] = None
        state.pop("connected_hash", None)

    async def update_weights_via_ipc_zmq(self, *, refit_timeout_s: float | None = None) -> RefitReport:
        """Pull the next refit from the colocated trainer; commit it or raise."""
        timeout = self._check_refit_timeout(refit_timeout_s)
        self._ensure_open()
        state = self._refit_transport_state("zmq")
        plan = state.get("plan")
        if plan is None:
            raise ConfigError("call load_colocated_plan before update_weights_via_ipc_zmq", rank=self.rank)
        self.maybe_init_zmq()
        state["socket"] = self.zmq_socket
        transport = state.get("transport")
        if transport is None:
            transport = state["transport"] = ZmqIpcTransport(timeout_s=self.zmq_timeout_s, **self.zmq_options)
        ctx = TransportContext(worker=self, role="receive", rank=self.rank, device=self.device_facts, state=state,
                               params=self.params, plan=plan, executor=self._executor)
        return await self._receive_and_commit(transport, ctx, timeout=timeout, aborts=[transport.abort])
