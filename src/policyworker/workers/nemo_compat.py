"""The NeMo-named methods: thin shims onto the one road, kept together here.

Every refit goes ``attach_transport`` → ``refit`` → ``detach_transport`` (see
:mod:`policyworker.workers.core`). NeMo RL's worker surface spells the same steps in per-
transport names; :class:`TrainerCompat` and :class:`RolloutCompat` are mixins that
``AbstractPolicyWorker`` and ``RolloutWorker`` inherit, so those names keep working:

====================================================  ===========================================
seed methods (trainer / rollout)                      on the road
====================================================  ===========================================
``init_nccl_reshard_comm_group`` / ``..._groups``,    wiring of ``nccl_reshard``: its stage group(s)
``prepare_nccl_reshard_refit_info`` / ``load_refit_plan``  and its plan
``nccl_reshard_refit`` / ``receive_nccl_reshard_refit``    ``refit("nccl_reshard", ...)``
``maybe_init_zmq``, ``prepare_zmq_refit_info`` /      wiring of ``zmq``: the pair's socket, the plan
``load_colocated_plan``
``stream_weights_via_ipc_zmq`` /                      ``refit("zmq", ...)``
``update_weights_via_ipc_zmq``
``connect_sglang_rollout_engines``                    ``attach_transport("sglang_ipc", ...)``
``sglang_refit``                                      ``refit("sglang_ipc", ...)``
====================================================  ===========================================

The wiring methods record what they built (groups, plans, sockets) in the transport's
state dict under ``seed_*`` keys and mark it changed; the next refit shim attaches the
transport with it (``attach_transport(name, connect=False, ...)``: the connect then runs inside the
refit's deadline, so a peer that never comes is bounded like any other wait). A refit
shim after no change is ``refit`` and nothing else.

A transport's setup is given one way: ``attach_transport(name, **setup)``, with the
plan and groups the wiring methods built (docs/controller.md). The shims attach with
the transport's defaults the first time, and keep the attached setup when they re-wire
(new groups after a recovery, a new plan). The older spellings — ``transport_options=``
/ ``reshard_options=`` at construction, the ``reshard_options`` / ``zmq_options`` /
``sglang_options`` properties and ``set_transport_options`` — still work (checked when
given, used by the shims' next attach) and warn ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policyworker.runtime.comm import CommGroup, new_group
from policyworker.config import parse, positive_int
from policyworker.errors import ConfigError, TransportError
from policyworker.layout.local import as_plan, flat_local_tensors, plan_for_source, validate_kv_scales
from policyworker.layout.planner import build_plan
from policyworker.registry import default_registry
from policyworker.transports.base import RefitReport

__all__ = ["RolloutCompat", "TrainerCompat"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_DEPRECATED = ("{what} is deprecated: give a transport its setup with attach_transport(name, **setup) "
               "(docs/controller.md)")


def _deprecated(what: str) -> None:
    # Points at the caller's line, however many of our constructors it went through.
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        level, frame = level + 1, frame.f_back
    warnings.warn(_DEPRECATED.format(what=what), DeprecationWarning, stacklevel=level)


def _check_setups(options: Mapping[str, Mapping[str, Any]] | None, registry: Any) -> dict[str, dict[str, Any]]:
    """``{name: setup}`` checked against each transport's ``Setup`` now (``ConfigError``)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"transport_options must map transport name -> setup, got {type(options).__name__}")
    out = {}
    reg = registry if registry is not None else default_registry()
    for name, setup in options.items():
        if not isinstance(setup, Mapping):
            raise ConfigError(f"transport_options[{name!r}] must be a mapping, got {type(setup).__name__}")
        cls = reg.load(name)
        given = {k: v for k, v in setup.items() if k != "plan"}
        # Wiring the shims add later (e.g. engine_gpu_counts) stands in as a placeholder.
        stubs = {f.name: (1,) for f in dataclasses.fields(cls.Setup) if f.name not in given
                 and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        parse(cls.Setup, given | stubs, what=f"options of transport {name!r}")
        out[name] = dict(setup)
    return out


def _open_pair_socket(worker: Any, *, bind: bool) -> None:
    """The colocated pair's DEALER socket on ``get_zmq_address()``, kept in the zmq state."""
    state = worker._refit_transport_state("zmq")
    if state.get("socket") is not None:  # every refit: return before any import
        return
    from policyworker.transports.zmq.channel import open_socket

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


def _setup_property(name: str, doc: str) -> property:
    def get(self: Any) -> dict[str, Any]:
        _deprecated(f"the {name} setup property")
        return dict(self._compat_setup.get(name, {}))

    def put(self: Any, value: Mapping[str, Any] | None) -> None:
        _deprecated(f"the {name} setup property")
        self._set_compat_setup(name, value)

    return property(get, put, doc=f"Deprecated: {doc}")


class _Compat:
    """What both sides' shims share: deprecated setup spellings, the shims' attach."""

    def __init__(self, *args: Any, transport_options: Mapping[str, Mapping[str, Any]] | None = None,
                 reshard_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        setups = dict(transport_options or {})
        if transport_options is not None:
            _deprecated("transport_options=")
        if reshard_options is not None:
            _deprecated("reshard_options=")
            setups["nccl_reshard"] = reshard_options
        # Checked before the core starts its executor thread: a bad setup leaves nothing behind.
        checked = _check_setups(setups, kwargs.get("registry"))
        super().__init__(*args, **kwargs)
        #: Setup given through the deprecated spellings, by transport name (the shims attach with it).
        self._compat_setup: dict[str, dict[str, Any]] = checked

    def set_transport_options(self, name: str, options: Mapping[str, Any] | None) -> None:
        """Deprecated: the setup the shims attach ``name`` with; checked now (``ConfigError``)."""
        _deprecated("set_transport_options")
        self._set_compat_setup(name, options)

    def transport_options(self, name: str) -> dict[str, Any]:
        """Deprecated: the setup given for ``name`` through the deprecated spellings."""
        _deprecated("transport_options")
        return dict(self._compat_setup.get(name, {}))

    def _set_compat_setup(self, name: str, options: Mapping[str, Any] | None) -> None:
        self._compat_setup.update(_check_setups({name: options or {}}, self._registry))
        self._refit_transport_state(name)["seed_changed"] = True

    def _base_setup(self, name: str) -> dict[str, Any]:
        """What the shims attach ``name`` with besides their wiring: a deprecated spelling's
        setup if one was given, else the setup it is attached with now (a re-wire keeps it)."""
        if name in self._compat_setup:
            return dict(self._compat_setup[name])
        att = self._attachments.get(name)
        return dict(att.raw_setup) if att is not None else {}

    def _wire(self, name: str, **wiring: Any) -> None:
        """Record what a wiring method built for ``name``; the next refit shim attaches with it."""
        state = self._refit_transport_state(name)
        state.update(wiring)
        state["seed_changed"] = True

    async def _attach_wired(self, name: str, **wiring: Any) -> None:
        """The road's attach of ``name`` with the recorded wiring, when it changed (no connect).

        Unchanged setup and plan keep the attachment (and its connection) as it is.
        """
        state = self._refit_transport_state(name)
        att = self._attachments.get(name)
        # A plan put in place without a wiring method (an engine integration publishing its
        # own) is told apart by identity: the attached plan is the wired object itself.
        if att is not None and not state.get("seed_changed") and att.plan is wiring.get("plan"):
            return
        setup = {**self._base_setup(name), **wiring}
        if att is None or att.raw_setup != {k: v for k, v in setup.items() if k != "plan"} \
                or att.plan != setup.get("plan"):
            await self.attach_transport(name, connect=False, **setup)
        elif "plan" in wiring:  # an equal plan: wire the attached object, so later calls stop at the check above
            state["seed_plan"] = att.plan
        state.pop("seed_changed", None)

    @property
    def zmq_socket(self):
        """The colocated pair's socket (``maybe_init_zmq``), None before."""
        return self._peek_state("zmq").get("socket")


class TrainerCompat(_Compat):
    """The trainer's NeMo-named methods (see the module docstring)."""

    reshard_options = _setup_property("nccl_reshard", "setup of nccl_reshard (bucket_bytes, in_flight, ...).")
    zmq_options = _setup_property("zmq", "setup of zmq (bucket_bytes, staging, staged, flatten, ...).")
    sglang_options = _setup_property("sglang_ipc", "setup of sglang_ipc (bucket_bytes, buffers).")

    # -- nccl_reshard ------------------------------------------------------------------
    async def init_nccl_reshard_comm_group(
        self, pp_ips: Sequence[str], pp_ports: Sequence[int], pp_size: int, my_pp_stage: int,
        sub_world_size: int, my_rank_in_group: int,
    ) -> None:
        """Join this rank's pipeline stage's reshard group (and only that one).

        ``pp_ips[s]`` / ``pp_ports[s]`` is stage ``s``'s store (hosted by its rank 0).
        The group holds the stage's trainers first, then every generation rank; a
        second call replaces it. Wiring of ``nccl_reshard`` (its ``group``/``stage``).
        """
        positive_int(pp_size, "pp_size")
        if isinstance(pp_ips, str) or len(pp_ips) != pp_size or len(pp_ports) != pp_size:
            raise ConfigError(
                f"pp_ips ({len(pp_ips)}) and pp_ports ({len(pp_ports)}) must both have pp_size={pp_size} entries"
            )
        positive_int(my_pp_stage, "my_pp_stage", minimum=0)
        if my_pp_stage >= pp_size:
            raise ConfigError(f"my_pp_stage {my_pp_stage} is outside [0, {pp_size})")
        positive_int(sub_world_size, "sub_world_size")
        positive_int(my_rank_in_group, "my_rank_in_group", minimum=0)
        if my_rank_in_group >= sub_world_size:
            raise ConfigError(f"my_rank_in_group {my_rank_in_group} is outside [0, {sub_world_size})")
        self._ensure_open()
        await self._retire_groups(self._refit_transport_state("nccl_reshard"), ("seed_group", "group"))
        group = await self._run(new_group, host=pp_ips[my_pp_stage], port=pp_ports[my_pp_stage],
                                rank=my_rank_in_group, world_size=sub_world_size, name=f"reshard_pp{my_pp_stage}",
                                timeout_s=self.timeout_s, device=self.device)
        self._wire("nccl_reshard", seed_group=group, pp_stage=my_pp_stage, pp_size=pp_size,
                   rank_in_group=my_rank_in_group)

    @property
    def pp_comm_group(self) -> CommGroup | None:
        """This rank's pipeline-stage group of ``nccl_reshard`` (None before it was joined)."""
        return self._peek_state("nccl_reshard").get("seed_group")

    async def prepare_nccl_reshard_refit_info(
        self, train_parallelism: Any, gen_parallelism: Any, train_world_size: int, gen_world_size: int
    ) -> dict:
        """Compute the reshard plan and return its wire-safe dict, equal on every rank.

        This rank's local tensors are checked against the plan now (``ConfigError``),
        not mid-refit. Wiring of ``nccl_reshard`` (its ``plan``); replaces an earlier one.
        """
        self._ensure_open()
        plan = await self._run(
            plan_for_source, self._refit_model_source(), train_parallelism, gen_parallelism,
            train_world_size, gen_world_size, dtype=self._refit_dtype(), config=self._refit_gen_config(),
        )
        return self._wire_plan("nccl_reshard", plan)

    def _wire_plan(self, name: str, plan: Any) -> dict:
        """Adopt ``plan`` (checked against this rank's tensors) as ``name``'s wiring; its dict."""
        plan = self._adopt_plan(name, plan)
        self._wire(name, seed_plan=plan)
        return plan.refit_info()

    @property
    def refit_version(self) -> int:
        """The version of the last refit this trainer sent over ``nccl_reshard`` (0: none yet).

        The next ``nccl_reshard_refit`` sends ``refit_version + 1``. A controller that
        starts a replacement trainer sets it to the survivors' value so every trainer
        of a refit announces the same version.
        """
        return self.transport_version("nccl_reshard")

    @refit_version.setter
    def refit_version(self, value: int) -> None:
        positive_int(value, "refit_version", minimum=0)
        self._refit_transport_state("nccl_reshard")["version"] = value

    async def nccl_reshard_refit(
        self, kv_scales: dict[str, float] | None = None, refit_timeout_s: float | None = None
    ) -> RefitReport:
        """``refit("nccl_reshard", kv_scales=..., refit_timeout_s=...)`` after the wiring steps.

        ``kv_scales`` (rank 0's are sent) travel over ``model_update_group`` after the
        bulk. With ``refit_timeout_s`` the watchdog aborts the groups when it passes and
        this raises ``RefitTimeout``; the version then does not advance and the rollouts
        keep their last committed weights (or are marked torn).
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
        await self._attach_wired("nccl_reshard", plan=state["seed_plan"], group=state["seed_group"],
                                 stage=state.get("pp_stage", 0))
        return await self.refit("nccl_reshard", refit_timeout_s=refit_timeout_s, kv_scales=kv_scales)

    # -- zmq -----------------------------------------------------------------------------
    def maybe_init_zmq(self) -> None:
        """Create this side's ZMQ socket once (idempotent): bounded send/recv, linger 0.

        The trainer binds the device's endpoint (``get_zmq_address``); the colocated
        rollout connects. The socket is handed to the ``zmq`` transport when it attaches.
        """
        self._ensure_open()
        _open_pair_socket(self, bind=True)

    async def prepare_zmq_refit_info(self, gen_parallelism: Any, gen_world_size: int) -> dict:
        """Build the one-source plan (this trainer holds full tensors); return its dict.

        Pass the dict to every colocated rollout's ``load_colocated_plan``.
        """
        self._ensure_open()
        plan = await self._run(build_plan, self._refit_model_source(), "tp=1", gen_parallelism, 1, gen_world_size,
                               dtype=self._refit_dtype())
        return self._wire_plan("zmq", plan)

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
        await self._attach_wired("zmq", plan=state["seed_plan"], timeout_s=self.zmq_timeout_s)
        return await self.refit("zmq", refit_timeout_s=refit_timeout_s, kv_scales=kv_scales)

    # -- sglang_ipc ----------------------------------------------------------------------
    async def connect_sglang_rollout_engines(
        self, *, engine_gpu_counts: Sequence[int], engine_gpu_offsets: Sequence[int] | None = None
    ) -> None:
        """``attach_transport("sglang_ipc", ...)``: group trainer ranks per colocated engine.

        ``engine_gpu_counts[e]``: GPUs (tp ranks) of engine e; ``engine_gpu_offsets[e]``
        its first GPU = trainer rank (default: the running sum). Engines must not
        overlap and must fit the trainer world (``ConfigError``, state unchanged).
        Collective; the connect checks manifests and exchanges buffers, so a bad
        pairing fails here, not in the first refit.
        """
        from policyworker.transports.sglang_ipc.groups import EngineLayout

        EngineLayout.build(engine_gpu_counts, engine_gpu_offsets, self.world_size)
        if self.model_update_group is None:
            raise ConfigError("call init_collective first: the engine groups are built on its store",
                              rank=self.rank, transport="sglang_ipc")
        setup = {**self._base_setup("sglang_ipc"), "engine_gpu_counts": tuple(engine_gpu_counts),
                 "engine_gpu_offsets": None if engine_gpu_offsets is None else tuple(engine_gpu_offsets)}
        await self.attach_transport("sglang_ipc", **setup)

    async def sglang_refit(
        self, *, engine: Any = None, refit_timeout_s: float | None = None, flush_cache: bool = True,
        abort_all_requests: bool = False, torch_empty_cache: bool = False,
    ) -> RefitReport:
        """``refit("sglang_ipc", ...)``: push the current weights into this rank's engine.

        Collective over the ranks of each engine. ``engine`` is needed on the gather
        source only; other ranks pass None. A refused bucket raises ``TransportError``
        on every rank of the engine; a passed ``refit_timeout_s`` aborts the group and
        raises ``RefitTimeout``. Ranks on no engine return a report with 0 bytes.
        """
        self._check_refit_timeout(refit_timeout_s)
        self._ensure_open()
        if "sglang_ipc" not in self._attachments:
            raise ConfigError("call connect_sglang_rollout_engines before sglang_refit", rank=self.rank)
        return await self.refit("sglang_ipc", refit_timeout_s=refit_timeout_s, engine=engine,
                                flush_cache=flush_cache, abort_all_requests=abort_all_requests,
                                torch_empty_cache=torch_empty_cache)


class RolloutCompat(_Compat):
    """The rollout's NeMo-style methods (see the module docstring)."""

    reshard_options = _setup_property("nccl_reshard", "setup of nccl_reshard (must match the trainers').")
    zmq_options = _setup_property("zmq", "setup of zmq.")

    # -- nccl_reshard ------------------------------------------------------------------
    async def init_nccl_reshard_comm_groups(
        self, pp_ips: Sequence[str], pp_ports: Sequence[int], trainers_per_stage: Sequence[int]
    ) -> None:
        """Join every pipeline stage's reshard group, after that stage's trainers.

        Stage groups are joined in stage order; every trainer of stage ``s`` must be
        joining group ``s`` at the same time (a stage whose trainers never come makes
        this call raise at the timeout). Wiring of ``nccl_reshard`` (its ``groups``).
        """
        pp_size = len(trainers_per_stage)
        if pp_size == 0 or len(pp_ips) != pp_size or len(pp_ports) != pp_size:
            raise ConfigError(
                f"pp_ips ({len(pp_ips)}), pp_ports ({len(pp_ports)}) and trainers_per_stage "
                f"({pp_size}) must have the same, non-zero length"
            )
        for n in trainers_per_stage:
            positive_int(n, "trainers_per_stage[i]")
        self._ensure_open()
        await self._retire_groups(self._refit_transport_state("nccl_reshard"), ("seed_groups", "groups"))
        groups: dict[int, CommGroup] = {}
        for stage, (ip, port, n_train) in enumerate(zip(pp_ips, pp_ports, trainers_per_stage)):
            groups[stage] = await self._run(
                new_group, host=ip, port=port, rank=n_train + self.rank, world_size=n_train + self.gen_world_size,
                name=f"reshard_pp{stage}", timeout_s=self.timeout_s, device=self.device,
            )
        self._wire("nccl_reshard", seed_groups=groups)

    @property
    def stage_groups(self) -> dict[int, CommGroup]:
        """Every stage's group of ``nccl_reshard``, by stage (empty before they were joined)."""
        return dict(self._peek_state("nccl_reshard").get("seed_groups") or {})

    def load_refit_plan(
        self, plan: Any, *, params: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Adopt the trainers' reshard plan (``prepare_nccl_reshard_refit_info``'s dict).

        ``params``: this rank's tensors in the generation layout; by default they are
        allocated (zeros) from the plan, as views of one buffer in the plan's order —
        unless the worker already holds the caller's tensors, which must fit. A plan
        that does not fit the caller's tensors is a ``ConfigError`` naming what differs,
        and they stay as they were. Wiring of ``nccl_reshard`` (its ``plan``).
        """
        self._ensure_open()
        plan = as_plan(plan)
        if params is not None:
            self._check_fit(plan, params)
            self.params = dict(params)
        self._wire("nccl_reshard", seed_plan=self._adopt_plan("nccl_reshard", plan))

    async def receive_nccl_reshard_refit(self, *, refit_timeout_s: float | None = None) -> RefitReport:
        """``refit("nccl_reshard")`` after the wiring steps; commit it or raise."""
        self._check_refit_timeout(refit_timeout_s)
        self._ensure_open()
        state = self._refit_transport_state("nccl_reshard")
        if state.get("seed_plan") is None:
            raise ConfigError("call load_refit_plan before receiving a refit", rank=self.rank)
        if not state.get("seed_groups") or self.model_update_group is None:
            raise ConfigError("join the update group and the stage groups before receiving a refit", rank=self.rank)
        await self._attach_wired("nccl_reshard", plan=state["seed_plan"], groups=state["seed_groups"])
        return await self.refit("nccl_reshard", refit_timeout_s=refit_timeout_s)

    # -- zmq -----------------------------------------------------------------------------
    def maybe_init_zmq(self) -> None:
        """Connect this side's ZMQ socket to the colocated trainer's endpoint (idempotent)."""
        self._ensure_open()
        _open_pair_socket(self, bind=False)

    def load_colocated_plan(self, plan_or_info: Any, *, params: Mapping[str, torch.Tensor] | None = None) -> None:
        """Adopt the trainer's one-source plan; allocate (flat, zeroed) or check ``params``.

        Wiring of ``zmq`` (its ``plan``). New destination tensors need no reconnect: the
        transport recompiles its copies when the tensors it writes change.
        """
        self._ensure_open()
        plan = as_plan(plan_or_info)
        if plan.body.train_world_size != 1:
            raise ConfigError("a colocated plan has one full source (train 'tp=1', world 1)")
        given = params if params is not None else (self.params if self.params is not self._allocated else None)
        if given:
            self._check_fit(plan, given)
            self.params = dict(given)
        else:
            self._check_fit(plan, None)
            self.params = self._allocated = dict(flat_local_tensors(plan, self.rank, self.device))
        self._wire("zmq", seed_plan=plan)

    async def update_weights_via_ipc_zmq(self, *, refit_timeout_s: float | None = None) -> RefitReport:
        """``refit("zmq")``: pull the next refit from the colocated trainer; commit it or raise."""
        self._check_refit_timeout(refit_timeout_s)
        self._ensure_open()
        state = self._refit_transport_state("zmq")
        if state.get("seed_plan") is None:
            raise ConfigError("call load_colocated_plan before update_weights_via_ipc_zmq", rank=self.rank)
        self.maybe_init_zmq()
        await self._attach_wired("zmq", plan=state["seed_plan"], timeout_s=self.zmq_timeout_s)
        return await self.refit("zmq", refit_timeout_s=refit_timeout_s)
