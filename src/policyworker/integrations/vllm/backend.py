"""The ``"policyworker"`` weight-transfer backend inside vLLM (0.32's pluggable API).

Installing ``policyworker[vllm]`` registers it through the ``vllm.general_plugins``
entry point (:func:`register`, run by vLLM in every process), so
``LLM(model, weight_transfer_config={"backend": "policyworker"})`` or
``vllm serve --weight-transfer-config '{"backend": "policyworker"}'`` needs no code
in the engine. One :class:`PolicyworkerWeightTransferEngine` lives in each vLLM
worker (one per tp rank) and is driven by vLLM's four calls:

``init_weight_transfer_engine(init_info)``
    Joins the update group as generation rank ``rank_offset + tp_rank`` and every
    pipeline stage's reshard group (a policyworker ``RolloutWorker`` does it: gloo on
    CPU, NCCL on GPU), then publishes what this rank loads (:func:`needs_from_vllm_model`)
    on the update group's store. Blocks until the trainers joined the same groups.
``start_weight_update()``
    Fetches the trainers' plan from the store the first time (bounded by the group
    timeout), checks that it delivers exactly this rank's needs, and attaches
    ``nccl_reshard`` with it, once per plan (:mod:`.vllm_join`), into the staging
    allocated once per staging mode (:class:`~.stage.VllmStage`: one set of vLLM's
    parameters in the shape its loaders fill, on the device, in host memory or none —
    ``init_info.staging``, :mod:`.staging` — checked once against those loaders; with a
    staging set vLLM's live weights are untouched until commit).
``update_weights({"version": v})``
    Refuses a ``v`` not newer than the served version before a byte moves. One
    ``worker.refit("nccl_reshard")`` point to point — each vLLM rank only its own boxes,
    straight into the staging set nothing live references — which waits for every
    rank's verdict (the update group's star). The trainers' announced version must be
    ``v``; the report's kv-cache scales are kept (``kv_scales``). Any failure raises
    here, and vLLM keeps serving the previous weights.
``finish_weight_update(weight_version)``
    Commits: runs each layer's own post-processing (``process_weights_after_loading``:
    on CPU the linear layers prepack their weights and drop the parameter, so bytes
    written into parameters in place would not be what the kernels read) on a copy of
    the layer holding the staged tensors, then swaps the copies' state into the live
    layers. vLLM's ``weight_version`` is the string the controller passes here. With
    ``overlap`` the receive and the post-processing ran in the background and this call
    only swaps (:mod:`.overlap`).

Failure semantics (docs/vllm.md): every call answers for itself at any tp. The engine's
tp ranks agree on each call's outcome before they reply, and raise the same error when
any rank failed (:mod:`.vllm_rpc`); errors carry a marker that :func:`typed_errors`
turns back into their policyworker class on the controller. A refit that fails in
``update_weights`` (trainer lost, timeout, bad bytes) changed nothing vLLM serves; vLLM
closes the session, and the controller starts a new one (after every side joined fresh
groups with ``init_weight_transfer_engine`` when a process died or a deadline aborted
them). ``finish_weight_update`` without a complete refit raises and commits nothing; a
failure in the post-processing (before any rank swaps) changes nothing either. Should a
swap itself fail, the engine is *torn* on every rank: every later
``finish_weight_update`` without a full refit raises ``TornWeights``.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from typing import Any

import msgspec
import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from policyworker.ledger import WeightLedger
from policyworker.errors import (ConfigError, PlanMismatch, PolicyWorkerError, ProtocolError, TornWeights,
                      translate_comm_error)
from policyworker.layout.plan import ReshardPlan
from policyworker.integrations.vllm.errors import engine_error, mark, typed_errors
from policyworker.integrations.vllm.info import PolicyworkerInitInfo, PolicyworkerUpdateInfo
from policyworker.integrations.vllm.landing import LayerLanding, return_free_heap
from policyworker.integrations.vllm.join import Joined, Loop as _Loop, join
from policyworker.integrations.vllm.overlap import (OverlappedReceive, SideThread, StepCounter, hold_live_state,
                                                    hurry_gil, release_in_background)
from policyworker.integrations.vllm.plan import NEEDS_KEY, PLAN_KEY, encode_needs
from policyworker.integrations.vllm.rpc import Agreement, install_single_reply
from policyworker.integrations.vllm.stage import VllmStage, loaded_set_bytes
from policyworker.integrations.vllm.staging import build as build_stage, decide, report as staging_report
from policyworker.integrations.vllm.targets import Target, needs_from_vllm_model, needs_of, vllm_targets

__all__ = ["BACKEND", "PolicyworkerInitInfo", "PolicyworkerUpdateInfo", "PolicyworkerWeightTransferEngine",
           "Target", "engine_error", "needs_from_vllm_model", "register", "typed_errors", "vllm_targets"]

BACKEND = "policyworker"
logger = logging.getLogger(__name__)
#: How long a rank waits for the others past the bound of the call itself.
AGREE_SLACK_S = 30.0


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register backend ``"policyworker"`` (lazily), for
    vLLM's workers and for its trainer API (:mod:`.trainer`), and ``"policyworker-lora"``
    (:mod:`.lora`: refits of a LoRA adapter)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, module, cls in ((BACKEND, __name__, "PolicyworkerWeightTransferEngine"),
                              ("policyworker-lora", f"{__package__}.lora", "PolicyworkerLoraEngine")):
        try:
            WeightTransferEngineFactory.register_engine(name, module, cls)
        except ValueError:
            # vLLM may run general plugins more than once per process; the first
            # registration stands (the factory refuses a second one with ValueError).
            pass
    install_single_reply()
    from policyworker.integrations.vllm.trainer import register_trainer

    register_trainer()  # the same name in vLLM's trainer API (WeightTransferTrainerFactory)


def _marked(method: Any) -> Any:
    """vLLM hands the controller only ``str(error)`` of a worker's error: put a marker in it
    (:mod:`.vllm_errors`), which :func:`typed_errors` turns back into the error's class."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except PolicyWorkerError as exc:
            raise mark(exc)

    return wrapper


class PolicyworkerWeightTransferEngine(WeightTransferEngine[PolicyworkerInitInfo, PolicyworkerUpdateInfo]):
    """See the module docstring."""

    init_info_cls = PolicyworkerInitInfo
    update_info_cls = PolicyworkerUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ConfigError("the policyworker backend supports vLLM pipeline_parallel_size=1 only (for now)")
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self._targets = vllm_targets(model)
        self.needs = needs_of(self._targets, rank=self.tp_rank, tp_rank=self.tp_rank, tp_size=self.tp_size,
                              dtype=vllm_config.model_config.dtype)
        self._stage: VllmStage | None = None
        self._prepared_for: int | None = None
        self._loop: _Loop | None = None
        self._joined: Joined | None = None
        self._info: PolicyworkerInitInfo | None = None
        self._received: int | None = None
        self._gil_switch: float | None = None  # the switch interval before the first overlapped refit
        # Started with the loop at the first init: the post-processing; the settle and release after a swap.
        self._prepare_side: SideThread | None = None
        self._tidy_side: SideThread | None = None
        #: The last refit's report on this rank (its notes say whether it was a delta).
        self.last_report: Any = None
        #: The FP8 kv-cache scales the trainers sent with the last refit received (None: none).
        self.kv_scales: dict[str, float] | None = None
        #: The version of the last refit this engine committed into vLLM (None: none yet).
        # vLLM's live weights go through the one commit path too: the staging RolloutWorker
        # has its own ledger (bytes landed), this one says what vLLM serves.
        self.ledger = WeightLedger(rank=self.tp_rank, what="vLLM engine")
        #: Forward passes so far, and (version, step count at its commit) of each commit.
        self.steps = StepCounter(model)
        self.commits: list[tuple[int, int]] = []
        self._pending: OverlappedReceive | None = None
        #: The last overlapped refit that reached ``finish_weight_update`` (its phase ``times``).
        self.last_overlap: OverlappedReceive | None = None
        self._open_session = False  # a failed overlapped finish left vLLM's update session open
        self._staging_choice: tuple[str, str] = ("auto", "not initialised")
        dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
        self._agreement = Agreement.for_vllm(self.tp_rank, self.tp_size, dp_rank)

    def _agreed(self, what: str, bound_s: float, body: Any, on_failure: Any = None) -> Any:
        """Run ``body`` on this rank, then agree with every tp rank (:mod:`.vllm_rpc`).

        When any rank failed, ``on_failure`` undoes this rank's part and every rank raises
        the same error (the lowest failed rank's, marked for :func:`typed_errors`).
        """
        error: Exception | None = None
        result = None
        try:
            result = body()
        except Exception as exc:  # agreed on below, then raised (typed) on every rank
            error = exc
            if isinstance(exc, PolicyWorkerError) and exc.rank is None:
                exc.rank = self.needs.rank  # the controller learns which vLLM rank saw it
        agreed = self._agreement.outcome(what, error, bound_s + AGREE_SLACK_S)
        if agreed is None:
            return result
        if on_failure is not None:
            on_failure()
        if agreed is error:
            raise mark(agreed)
        raise mark(agreed) from error

    # -- init -------------------------------------------------------------------------
    @_marked
    def parse_init_info(self, init_dict: dict[str, Any]) -> PolicyworkerInitInfo:
        if not isinstance(init_dict, dict):
            raise ConfigError(f"init_info must be a dict, got {type(init_dict).__name__}")
        try:
            return PolicyworkerInitInfo(**init_dict)
        except TypeError as exc:
            raise ConfigError(f"bad init_info for the policyworker backend: {exc}") from exc

    @_marked
    def parse_update_info(self, update_dict: dict[str, Any]) -> PolicyworkerUpdateInfo:
        if not isinstance(update_dict, dict):
            raise ConfigError(f"update_info must be a dict, got {type(update_dict).__name__}")
        try:
            return PolicyworkerUpdateInfo(**update_dict)
        except TypeError as exc:
            raise ConfigError(f"bad update_info for the policyworker backend: {exc}") from exc

    def _call(self, coro: Any, timeout_s: float) -> Any:
        # The worker's own deadlines bound every wait; this outer bound only catches a bug.
        return self._loop.call(coro, timeout_s + 30.0)

    def init_transfer_engine(self, init_info: PolicyworkerInitInfo) -> None:
        # One group formation per group (the update group, then each stage's), each
        # bounded by timeout_s: trainers that never come make this raise, never hang.
        bound = (1 + len(init_info.stage_ports)) * init_info.timeout_s
        self._agreed("init_weight_transfer_engine", bound, lambda: self._init(init_info, bound),
                     on_failure=self._close_worker)

    def _init(self, init_info: PolicyworkerInitInfo, bound: float) -> None:
        if self._loop is None:
            # On CPU the receive's threads share vLLM's pinned core with the engine's step.
            cpu = self.device.type == "cpu"
            self._loop = _Loop(background=cpu)
            self._prepare_side = SideThread("policyworker-vllm-prepare", background=cpu, overtake=True)
            self._tidy_side = SideThread("policyworker-vllm-tidy", background=cpu)
        self._close_worker()
        gen_world = init_info.gen_world_size or self.tp_size
        rank = init_info.rank_offset + self.tp_rank
        device = "cpu" if self.device.type == "cpu" else self.device
        self.needs = msgspec.structs.replace(self.needs, rank=rank)

        self._stage_for(init_info)
        self._stage.copy_into_live = self._copy_into_live(init_info.commit)
        self._joined = self._call(join(init_info, rank=rank, gen_world_size=gen_world, device=device,
                                       key=NEEDS_KEY.format(rank=rank), note=encode_needs(self.needs)), bound)
        self._info = init_info
        self._received = None

    def _stage_for(self, init_info: PolicyworkerInitInfo) -> None:
        """The staging of ``init_info.staging`` (:mod:`.staging`), built once per mode before
        joining (no refit pays for it); a replaced set is freed before the next is allocated."""
        set_bytes = self._stage.set_bytes if self._stage is not None else loaded_set_bytes(self.model)
        mode, reason, cpu_linear = decide(init_info, set_bytes=set_bytes, device=self.device)
        if self._stage is None or self._stage.staging != mode:
            if self._stage is not None:
                self._stage.prepack.stop()
                self._stage = None
            self._stage = build_stage(self.model, self._targets, device=self.device, staging=mode)
        self._stage.cpu_linear = cpu_linear
        self._staging_choice = (init_info.staging, reason)
        logger.info("policyworker: vLLM rank %d stages refits %s: %s (one set: %.1f MB)", self.tp_rank,
                    {"device": "on the device", "host": "in host memory", "none": "nowhere (in place)"}[mode],
                    reason, set_bytes / 1e6)

    @property
    def staging_report(self) -> dict[str, Any] | None:
        """The staging mode, why it was chosen, and the extra bytes it holds (``StagingReport``)."""
        if self._stage is None:
            return None
        requested, reason = self._staging_choice
        return staging_report(self._stage, requested=requested, reason=reason, device=self.device).as_dict()

    def _copy_into_live(self, mode: str) -> bool:
        if mode != "auto":
            return mode == "copy"
        from vllm.config import CompilationMode

        # Captured graphs (CUDA graphs; compiled code) read the storage they saw: copy.
        return self.device.type != "cpu" or self.vllm_config.compilation_config.mode != CompilationMode.NONE

    def _load_plan(self) -> None:
        joined = self._joined
        worker = joined.worker
        try:
            data = worker.model_update_group.store.get(PLAN_KEY)
        except Exception as exc:  # the store raises DistStoreError/RuntimeError on timeouts
            raise translate_comm_error(exc, rank=worker.rank, what="reading the trainers' plan") from exc
        plan = ReshardPlan.from_wire(bytes(data))
        mine = plan.local_tensors("dst", worker.rank)
        want = {n.name: n for n in self.needs.needs}
        got = {}
        for local in mine.values():
            for p in local.pieces:
                got[plan.params[p.param].name] = (tuple(p.start), tuple(p.stop))
        if set(got) != set(want) or any(got[k] != (want[k].start, want[k].stop) for k in want):
            raise PlanMismatch(f"the trainers' plan does not deliver what vLLM rank {worker.rank} loads",
                               rank=worker.rank)
        wire = {}
        for local in mine.values():
            for p in local.pieces:
                wire[plan.params[p.param].name] = local.dtype
        if self._stage.wire_dtypes != wire:
            self._stage.set_wire_dtypes(wire)
        # Once per plan: the worker checks the staging views against it here, not per update.
        self._call(joined.attach(plan, self._stage.receive_views()), self._info.timeout_s)

    # -- one update -------------------------------------------------------------------
    def _require_worker(self) -> Any:
        if self._joined is None:
            raise ConfigError("call init_weight_transfer_engine before a weight update")
        return self._joined.worker

    def start_weight_update(self) -> None:
        self._agreed("start_weight_update", self._info.timeout_s if self._info else 0.0, self._start)

    def _start(self) -> None:
        self._require_worker()
        if self._joined.plan is None:
            self._load_plan()
        self._received = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        def body() -> None:
            self.receive_weights(self.parse_update_info(update_info))
            # The base class ends with torch.accelerator.synchronize(), which raises on a
            # CPU-only host; our receive has completed (or raised) when it returns.
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def forget() -> None:  # another rank failed: this rank's bytes must not commit
            self._received = None
            if self._stage is not None and self._stage.staging == "none":
                self.ledger.mark_torn()  # ... and with no staging they are in vLLM's live tensors
            pending, self._pending = self._pending, None
            if pending is not None:
                pending.cancel()

        self._agreed("update_weights", self._update_bound(update_info), body, on_failure=forget)

    def _update_bound(self, update_info: Any) -> float:
        if self._info is None:
            return 0.0
        timeout = update_info.get("refit_timeout_s") if isinstance(update_info, dict) else None
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            timeout = self._info.refit_timeout_s
        return float(timeout if timeout is not None else self._info.timeout_s) + 30.0

    def receive_weights(self, update_info: PolicyworkerUpdateInfo) -> None:
        entered = time.monotonic()
        worker = self._require_worker()
        if self._open_session:
            # vLLM closes its update session only on a successful finish or a failed
            # update_weights: this call is the one that closes it.
            self._open_session = False
            raise ConfigError(f"vLLM rank {worker.rank}: the last overlapped update failed in finish_weight_update; "
                              f"this update_weights only closes that session (nothing received): call "
                              f"start_weight_update again", rank=worker.rank)
        joined = self._joined
        if joined.plan is None:
            raise ConfigError("call start_weight_update before update_weights")
        if update_info.overlap and self._stage.staging == "none":
            raise ConfigError(f"vLLM rank {worker.rank}: update_info.overlap with staging='none' would write vLLM's "
                              f"live tensors while it generates; nothing received", rank=worker.rank)
        self._received = None
        served = self.ledger.version
        if update_info.version <= served:
            # Refused before a byte moves: this version could never commit (vLLM serves
            # `served` already), so receiving it would only waste the wire.
            raise ConfigError(f"update_info.version {update_info.version} is not newer than the version vLLM "
                              f"rank {worker.rank} serves ({served}); nothing received", rank=worker.rank)
        timeout = update_info.refit_timeout_s or self._info.refit_timeout_s
        if self._info.reshard_options.get("delta"):
            # A delta applies to what the receive buffers hold: the newest version received.
            self._stage.catch_up()
        # Into the staging set that nothing live references ("none": vLLM's live tensors); a
        # staging tensor that moved at a commit has the geometry of the one checked at attach.
        landing = LayerLanding(self._stage) if self._stage.staging == "none" else None
        joined.land_in(self._stage.receive_views(), self._stage.start_landing(landing))
        bound = timeout if timeout is not None else self._info.timeout_s
        if self._info.overlap if update_info.overlap is None else update_info.overlap:
            if self.device.type == "cpu" and self._gil_switch is None:
                self._gil_switch = hurry_gil()  # for the engine's life: restored at shutdown
            self._pending = OverlappedReceive.start(
                self._loop, joined.refit(timeout), worker=worker,
                version=update_info.version, step=self.steps.count, timeout_s=bound, prepare=self._stage.prepare,
                side=self._prepare_side)
            self._pending.times.update(update_enter=entered, update_return=time.monotonic())
            return
        try:
            report = self._call(joined.refit(timeout), bound)
        except BaseException:
            self._stage.received(False)
            if self._stage.staging == "none" and worker.ledger.torn:
                self.ledger.mark_torn()  # bytes of the failed version reached vLLM's live tensors
            raise
        self._stage.received(True)
        self.last_report, self.kv_scales = report, report.kv_scales
        if report.version != update_info.version:
            raise ProtocolError(f"the trainers sent version {report.version}, update_info says "
                                f"{update_info.version}; nothing committed", rank=worker.rank)
        self._received = report.version

    def finish_weight_update(self) -> None:
        """Post-process the received set with vLLM's own code off the live layers, then swap.

        Runs only after a complete refit whose verdict was good on every rank (else it
        raises and commits nothing). Every tp rank post-processes first and the ranks
        agree before any swaps: a failure there leaves vLLM's live layers untouched on
        every rank (version intact). Only a failure in a swap itself marks the engine torn,
        on every rank (the ranks would otherwise serve a mix of versions).
        """
        bound = self._info.timeout_s if self._info else 0.0
        pending, self._pending = self._pending, None
        if pending is not None:
            self._finish_overlapped(pending, bound)
            return
        version = self._received
        # With no staging the post-processing runs over the live tensors: a failure tears.
        in_place = self._stage is not None and self._stage.staging == "none" and version is not None
        prepared = self._agreed("finish_weight_update", bound, self._prepare,
                                on_failure=self._torn_everywhere if in_place else None)
        self._agreed("finish_weight_update (swap)", bound, lambda: self._swap(version, prepared),
                     on_failure=self._torn_everywhere)

    def _finish_overlapped(self, pending: OverlappedReceive, bound: float) -> None:
        # The receive and the post-processing ran in the background (.overlap); the ranks
        # agree on both outcomes, then every rank only swaps.
        self.last_overlap = pending
        pending.times["finish_start"] = time.monotonic()
        try:
            version, prepared = self._agreed("finish_weight_update (overlapped refit)", pending.timeout_s + 60.0,
                                             lambda: pending.result(self.tp_rank))
        except BaseException:
            self._stage.received(False)
            self._open_session = True
            raise
        self._stage.received(True)
        self.last_report, self.kv_scales = pending.report, pending.report.kv_scales
        self._received = None
        held = hold_live_state(prepared.layers)  # freed after the swap, off the engine's step
        pending.forget_prepared()  # else the replaced version lives on in last_overlap, freed at the next finish
        pending.times["swap_start"] = time.monotonic()
        try:
            self._agreed("finish_weight_update (swap)", bound, lambda: self._swap(version, prepared),
                         on_failure=self._torn_everywhere)
        finally:
            pending.times["swap_end"] = time.monotonic()
            release_in_background(held, self._tidy_side)
            pending.times["finish_end"] = time.monotonic()

    def weight_update_ready(self) -> bool:
        """True unless an overlapped refit is still receiving or post-processing on this
        rank: a ``finish_weight_update`` called once every rank is ready only swaps."""
        pending = self._pending
        return pending is None or pending.ready()

    def _prepare(self) -> Any:
        if self._received is None:
            state = "torn" if self.torn else f"version {self.committed_version}"
            raise (TornWeights if self.torn else ConfigError)(
                f"vLLM rank {self.tp_rank}: no complete refit was received in this weight update; nothing "
                f"committed (vLLM keeps {state})", rank=self.tp_rank)
        self._received = None
        return self._stage.prepare()

    def _swap(self, version: int, prepared: Any) -> None:
        # A swap that fails part way leaves some layers on the new version: touched.
        with self.ledger.transaction(version, touched=True) as tx:
            self._stage.commit(prepared)
            tx.commit()
        self.commits.append((version, self.steps.count))
        self._settle_later()

    def _settle_later(self) -> None:
        """The stage's bookkeeping after a swap (:meth:`VllmStage.settle`) on a side thread, so
        the engine steps again right after the swap; the next receive settles first anyway."""
        stage = self._stage
        trim = stage.staging == "none" and self.device.type == "cpu"

        def run() -> None:
            try:
                stage.settle()
                if trim:  # "none" is for tight memory: what the refit freed goes back to the OS
                    return_free_heap()
            except Exception as exc:  # left unsettled: the next receive settles again and raises it there
                logger.warning("policyworker: settling the staging set after a commit failed: %s", exc)

        self._tidy_side.run(run)

    def _torn_everywhere(self) -> None:
        # A rank whose swap succeeded serves the new version while another does not.
        self.ledger.mark_torn()

    def versions(self) -> dict[str, Any]:
        """This rank's version record, JSON-safe (:mod:`.versions` serves it to a controller)."""
        pending = self._pending
        return {"rank": self.tp_rank, "version": self.ledger.version, "torn": self.torn, "steps": self.steps.count,
                "commits": [list(c) for c in self.commits],
                "receiving": None if pending is None else {"version": pending.version,
                                                            "started_step": pending.started_step,
                                                            "landed": pending.future.done(),
                                                            "ready": pending.ready()}}

    @property
    def torn(self) -> bool:
        return self.ledger.torn

    @property
    def committed_version(self) -> int | None:
        return self.ledger.version or None

    # -- teardown ---------------------------------------------------------------------
    def _close_worker(self) -> None:
        joined, self._joined = self._joined, None
        if joined is not None and self._loop is not None:
            try:
                self._call(joined.worker.shutdown(), joined.worker.timeout_s)
            except PolicyWorkerError as exc:
                logger.warning("policyworker: closing the old groups failed: %s", exc)
            else:
                if joined.worker.shutdown_clean:  # else the executor may still be inside one: leave them
                    joined.close()

    def shutdown(self) -> None:
        if self._gil_switch is not None:
            sys.setswitchinterval(self._gil_switch)
            self._gil_switch = None
        if self._stage is not None:
            self._stage.prepack.stop()
        self._close_worker()
        if self._loop is not None:
            self._loop.close()
            self._loop = None
            self._prepare_side.close()
            self._tidy_side.close()
