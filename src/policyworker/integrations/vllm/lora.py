"""The ``"policyworker-lora"`` weight-transfer backend: refit vLLM's LoRA adapter, not its base.

Start vLLM with LoRA on and this backend
(``LLM(model, enable_lora=True, max_lora_rank=R, max_loras=1,
weight_transfer_config={"backend": "policyworker-lora"})``), the trainers being
``LoraPolicyWorker``\\ s. vLLM's four calls do what they do for the dense backend
(:mod:`.vllm`), for the adapter's factors only:

``init_weight_transfer_engine(init_info)``
    Hashes the base checkpoint vLLM loaded (once), joins the groups, publishes this
    rank's :class:`~.vllm_lora_plan.LoraEngineInfo` (base hash, ``max_lora_rank``, the
    boxes of the base its layers load).
``start_weight_update()``
    Reads the trainers' plan and the adapter's metadata (once per connect) and checks
    them: the same base, or a first plan that sends the trainers' base
    (:mod:`.lora_base`; ``PlanMismatch`` otherwise), every factor whole on this rank,
    every factor a module vLLM's LoRA layers serve. Nothing moves before that.
``update_weights({"version": v})``
    Receives the factors (and, once, the base) into staging nothing in vLLM references.
``finish_weight_update()``
    Commits: swaps a received base in first (vLLM's post-processing ran off the live
    layers before), then builds vLLM's own ``LoRAModel`` from copies of the staged factors
    (``LoRAModel.from_lora_tensors``, the adapter's PEFT config), then, between two
    engine steps, replaces the adapter registered under the stable id by it and
    activates it (vLLM's ``set_lora`` writes each slot's buffers). Later versions of the
    same plan go in place (:mod:`.lora_install`): the staged factors are copied into that
    ``LoRAModel``'s own tensors as vLLM's install left them, then into its slot buffers
    through views kept from vLLM's activation (or by re-activating it, ``set_lora`` per
    module, when those views went stale); no ``LoRAModel`` per version. Memory stays one
    adapter. vLLM's worker then resets its LoRA state (it assumes a weight update replaced
    the base); the committed adapter stays registered and active (see
    ``_remove_all_adapters``).

Requests name the adapter by :func:`lora_request` — one stable name and id, which always
mean the committed version; after a commit, reset the prefix cache as for a dense refit
(cached KV of the old adapter must not be reused). Before the first commit there is no
adapter to serve: do not send requests naming it yet (vLLM would try to load it from
its placeholder path and fail the engine). All-or-nothing: a refit that fails to arrive
changes nothing vLLM serves; everything that can fail in the install (metadata,
names, rank) is checked before the old adapter is removed, and a failure after it puts
the previous ``LoRAModel`` back (torn only if even that fails, or if a base was swapped
in: the previous adapter then runs on another base). An in-place commit checks the
factors' names and shapes first; one that fails once it started copying leaves the
adapter torn (the previous version's only copy was being overwritten).
"""

from __future__ import annotations

import glob
import logging
import os
import time
from typing import Any

import msgspec
import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from policyworker.errors import ConfigError, PlanMismatch, ProtocolError, TornWeights, translate_comm_error
from policyworker.layout.plan import ReshardPlan
from policyworker.ledger import WeightLedger
from policyworker.integrations.vllm.backend import PolicyworkerInitInfo, PolicyworkerUpdateInfo, PolicyworkerWeightTransferEngine, _marked
from policyworker.integrations.vllm.join import Joined, Loop, join
from policyworker.integrations.vllm.lora_base import PendingBase, base_needs
from policyworker.integrations.vllm.lora_install import InPlaceAdapter, SlotWriter, layer_scales
from policyworker.integrations.vllm.lora_plan import ENGINE_KEY, PLAN_KEY, LoraEngineInfo, LoraPlanInfo, decode, encode

__all__ = ["BACKEND_LORA", "LORA_ID", "LORA_NAME", "PolicyworkerLoraEngine", "checkpoint_hash", "lora_request"]

BACKEND_LORA = "policyworker-lora"
LORA_NAME = "policy"
LORA_ID = 1
_PATH = "policyworker-lora://"
logger = logging.getLogger(__name__)


def lora_request(name: str = LORA_NAME, lora_int_id: int = LORA_ID) -> Any:
    """The ``LoRARequest`` that names the committed adapter (pass it to ``generate``)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_int_id, lora_path=f"{_PATH}{name}")


def checkpoint_hash(model_dir: str) -> str:
    """The content hash of a safetensors checkpoint, as :func:`.peft.tensor_hash` computes it."""
    from safetensors import safe_open

    from policyworker.integrations.peft import tensor_hash

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"no safetensors checkpoint in {model_dir!r}: cannot check the base by its hash")
    tensors = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensor_hash(tensors)


class PolicyworkerLoraEngine(WeightTransferEngine[PolicyworkerInitInfo, PolicyworkerUpdateInfo]):
    """See the module docstring. ``init_info`` is the dense backend's (``commit``/``cpu_linear`` unused)."""

    init_info_cls = PolicyworkerInitInfo
    update_info_cls = PolicyworkerUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.manager = getattr(model, "lora_manager", None)
        if self.manager is None or vllm_config.lora_config is None:
            raise ConfigError(f"backend {BACKEND_LORA!r} refits a LoRA adapter: start vLLM with enable_lora=True")
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ConfigError(f"backend {BACKEND_LORA!r} supports vLLM pipeline_parallel_size=1 only")
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if self.tp_size != 1:
            # Each rank installs inside finish_weight_update on its own: at tp > 1 a rank
            # that fails to install would leave the others on the new adapter (a mix).
            raise ConfigError(f"backend {BACKEND_LORA!r} supports vLLM tensor_parallel_size=1 only (this engine: "
                              f"{self.tp_size}); the tp ranks do not agree before installing an adapter yet")
        self.lora_config = vllm_config.lora_config
        self._committed: Any = None
        #: Installs later versions into ``_committed``'s own tensors (None: a new LoRAModel each time).
        self._in_place: InPlaceAdapter | None = None
        self._vllm_remove_all = self.manager.remove_all_adapters
        self.manager.remove_all_adapters = self._remove_all_adapters
        #: The content hash of the base vLLM serves (its checkpoint's, until a base is sent).
        self._base_hash: str | None = None
        self._base_targets: Any = None  # (targets, needs, refusal) of the base, read once
        #: The trainers' base while it is on its way (None: none is being sent).
        self._pending: PendingBase | None = None
        #: Bytes of the base the last commit swapped in (0: it installed an adapter only).
        self.last_base_bytes = 0
        self._base_prepack: Any = None  # a committed base's background prepack (cpu_linear="background")
        self._loop: Loop | None = None
        self._joined: Joined | None = None
        self._info: PolicyworkerInitInfo | None = None
        self._plan: ReshardPlan | None = None
        self._helper: Any = None
        self._staging: dict[str, torch.Tensor] | None = None
        self._received: int | None = None
        #: Seconds of the last commit (LoRAModel built + installed), apart from the wire.
        self.last_install_s: float | None = None
        #: Whether the last commit copied into the committed LoRAModel (else it built a new one).
        self.last_install_in_place = False
        #: The committed adapter's slot views (None: the next in-place commit re-activates it).
        self._slots: SlotWriter | None = None
        #: Whether the last in-place commit wrote the slot views (else vLLM re-activated the adapter).
        self.last_install_slots = False
        self.ledger = WeightLedger(rank=self.tp_rank, what="vLLM LoRA adapter")
        #: The kv-cache scales the trainers sent with the last refit received (None: none).
        self.kv_scales: dict[str, float] | None = None

    parse_init_info = PolicyworkerWeightTransferEngine.parse_init_info
    parse_update_info = PolicyworkerWeightTransferEngine.parse_update_info

    def _call(self, coro: Any, timeout_s: float) -> Any:
        return self._loop.call(coro, timeout_s + 30.0)

    # -- init -------------------------------------------------------------------------
    @_marked
    def init_transfer_engine(self, init_info: PolicyworkerInitInfo) -> None:
        if self._base_hash is None:
            self._base_hash = checkpoint_hash(self.vllm_config.model_config.model)
        if self._base_targets is None:
            self._base_targets = base_needs(self.model, rank=self.tp_rank, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                            dtype=self.vllm_config.model_config.dtype)
        if self._loop is None:
            self._loop = Loop()
        self._close_worker()
        self._pending = None  # a base received but not committed: the trainers send it again
        gen_world = init_info.gen_world_size or self.tp_size
        rank = init_info.rank_offset + self.tp_rank
        _, needs, refusal = self._base_targets
        me = LoraEngineInfo(rank=rank, tp_size=self.tp_size, base_hash=self._base_hash,
                            max_lora_rank=int(self.lora_config.max_lora_rank),
                            base_needs=None if needs is None else msgspec.structs.replace(needs, rank=rank),
                            base_refusal=refusal)
        device = "cpu" if self.device.type == "cpu" else self.device
        self._joined = self._call(join(init_info, rank=rank, gen_world_size=gen_world, device=device,
                                       key=ENGINE_KEY.format(rank=rank), note=encode(me)),
                                  (1 + len(init_info.stage_ports)) * init_info.timeout_s)
        self._info = init_info
        self._plan = None
        self._received = None

    def _known_modules(self) -> set[str]:
        packed = {n for subs in self.manager.packed_modules.values() for n in subs}
        return set(self.manager.modules) | packed

    def _load_plan(self) -> None:
        from vllm.lora.peft_helper import PEFTHelper

        worker = self._joined.worker
        try:
            data = worker.model_update_group.store.get(PLAN_KEY)
        except Exception as exc:  # the store raises DistStoreError/RuntimeError on timeouts
            raise translate_comm_error(exc, rank=worker.rank, what="reading the trainers' LoRA plan") from exc
        info: LoraPlanInfo = decode(data, LoraPlanInfo)
        if info.base_hash != self._base_hash and info.base_plan is None:
            raise PlanMismatch(f"vLLM rank {worker.rank}: the trainers' base hashes to {info.base_hash[:12]}…, the "
                               f"base vLLM serves to {self._base_hash[:12]}…; no adapter of theirs fits it (the "
                               "trainers send their base with base='send_if_different')", rank=worker.rank)
        plan = ReshardPlan.from_wire(info.plan)
        mine = plan.local_tensors("dst", worker.rank)
        known = self._known_modules()
        for name, local in mine.items():
            module = name.rsplit(".lora_", 1)[0]
            if not name.endswith((".lora_A.weight", ".lora_B.weight")) or module not in known:
                raise PlanMismatch(f"vLLM rank {worker.rank} has no LoRA layer for {name!r}", rank=worker.rank,
                                   param=name)
            whole = [p for p in local.pieces if tuple(p.stop) == tuple(plan.params[p.param].shape)
                     and not any(p.start)]
            if len(local.pieces) != 1 or not whole:
                raise PlanMismatch(f"the plan gives vLLM rank {worker.rank} a part of {name!r}; the adapter is "
                                   "installed from whole factors", rank=worker.rank, param=name)
        try:
            helper = PEFTHelper.from_dict(info.meta.peft_config())
            helper.validate_legal(self.lora_config)
        except ValueError as exc:  # vLLM's own verdict on the adapter's config
            raise ConfigError(f"vLLM refuses the adapter's config: {exc}", rank=worker.rank) from exc
        self._staging = {name: torch.empty(local.shape, dtype=getattr(torch, local.dtype), device=self.device)
                         for name, local in mine.items()}
        if info.base_plan is None:
            self._call(self._joined.attach(plan, self._staging), self._info.timeout_s)  # checked once, here
        else:
            self._attach_base_plan(ReshardPlan.from_wire(info.base_plan), info.base_hash, mine)
        self._plan, self._helper = plan, helper
        self._in_place = None  # a new plan may bring another config: its first commit builds a LoRAModel

    def _attach_base_plan(self, first: ReshardPlan, base_hash: str, factors: dict[str, Any]) -> None:
        """Attach the trainers' first plan: the base (into a staging set of its own) and the factors."""
        rank = self._joined.worker.rank
        targets, needs, refusal = self._base_targets
        if needs is None:
            raise PlanMismatch(f"the trainers send their base, which vLLM rank {rank} cannot receive: {refusal}",
                               rank=rank)
        extra = sorted(set(first.local_tensors("dst", rank)) - set(factors) - {n.name for n in needs.needs})
        if extra:
            raise PlanMismatch(f"the trainers' base plan gives vLLM rank {rank} {extra[0]!r}, which it does not "
                               "load", rank=rank, param=extra[0])
        self._pending = PendingBase(
            self.model, targets, needs, first, base_hash, rank=rank, device=self.device,
            cpu_linear=self._info.cpu_linear,
            copy_into_live=PolicyworkerWeightTransferEngine._copy_into_live(self, self._info.commit))
        self._call(self._joined.attach(first, {**self._staging, **self._pending.receive_views()}),
                   self._info.timeout_s)

    # -- one update -------------------------------------------------------------------
    def _require_worker(self) -> Any:
        if self._joined is None:
            raise ConfigError("call init_weight_transfer_engine before a weight update")
        return self._joined.worker

    @_marked
    def start_weight_update(self) -> None:
        self._require_worker()
        if self._plan is None:
            self._load_plan()
        self._received = None

    @_marked
    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: PolicyworkerUpdateInfo) -> None:
        worker = self._require_worker()
        if self._plan is None:
            raise ConfigError("call start_weight_update before update_weights")
        self._received = None
        served = self.ledger.version
        if update_info.version <= served:
            raise ConfigError(f"update_info.version {update_info.version} is not newer than the adapter version vLLM "
                              f"rank {worker.rank} serves ({served}); nothing received", rank=worker.rank)
        timeout = update_info.refit_timeout_s or self._info.refit_timeout_s
        report = self._call(self._joined.refit(timeout), timeout if timeout is not None else self._info.timeout_s)
        pending = self._pending
        if pending is not None and not pending.received:
            # Every rank's verdict was good: the trainers attach the adapter-only plan now
            # (connected at the next refit); so does this rank. The base waits for the commit.
            pending.received = True
            self._call(self._joined.attach(self._plan, self._staging), self._info.timeout_s)
        self.kv_scales = report.kv_scales
        if report.version != update_info.version:
            raise ProtocolError(f"the trainers sent version {report.version}, update_info says "
                                f"{update_info.version}; nothing committed", rank=worker.rank)
        self._received = report.version

    @_marked
    def finish_weight_update(self) -> None:
        """Install the received adapter under the stable id (see the module docstring)."""
        if self._received is None:
            state = "torn" if self.torn else f"version {self.committed_version}"
            raise (TornWeights if self.torn else ConfigError)(
                f"vLLM rank {self.tp_rank}: no complete adapter refit was received in this weight update; nothing "
                f"committed (vLLM keeps {state})", rank=self.tp_rank)
        from vllm.lora.lora_model import LoRAModel

        version, self._received = self._received, None
        t0 = time.perf_counter()
        base = self._pending if self._pending is not None and self._pending.received else None
        if base is None and self._in_place_ready():
            self._commit_in_place(version)
            self.last_install_s, self.last_install_in_place = time.perf_counter() - t0, True
            return
        # Copies: vLLM keeps (and rescales in place) the tensors it is given; the staging
        # set receives the next version.
        tensors = {name: t.clone() for name, t in self._staging.items()}
        lora = LoRAModel.from_lora_tensors(LORA_ID, tensors, self._helper, device=str(self.device),
                                           dtype=self.lora_config.lora_dtype,
                                           model_vocab_size=self.vllm_config.model_config.get_vocab_size())
        scales = layer_scales(lora, tensors)  # before the manager packs and rescales them
        # vLLM's post-processing of the base runs off the live layers: a failure here changes nothing.
        prepared = base.prepare() if base is not None else None
        previous = self.manager.get_adapter(LORA_ID)
        with self.ledger.transaction(version) as tx:
            if base is not None:
                tx.touched = True  # the swap moves live layers onto the trainers' base
                self._base_prepack = base.stage.prepack
                base.commit(prepared)
                self._base_hash, self._pending = base.base_hash, None
            self._slots = None
            try:
                self._install(lora)
            except BaseException:
                self._in_place = None
                restored = self._restore(previous)
                # Torn unless the previous adapter is back on the base it was served on.
                tx.touched = base is not None or not restored
                raise
            tx.commit()
        self._committed = lora
        self._in_place = InPlaceAdapter.capture(lora, tensors, scales)
        if self._in_place is not None:
            self._slots = SlotWriter.capture(self.manager, LORA_ID, lora, self._in_place)
        self.last_install_slots = False
        self.last_base_bytes = base.nbytes if base is not None else 0
        self.last_install_s, self.last_install_in_place = time.perf_counter() - t0, False

    def _in_place_ready(self) -> bool:
        """Whether this version can be copied into the committed ``LoRAModel`` (:mod:`.lora_install`):
        one was captured, vLLM still holds it under the stable id, and the factors fit it."""
        held = self._in_place
        return (held is not None and held.lora is self._committed
                and self.manager.get_adapter(LORA_ID) is self._committed and held.fits(self._staging))

    def _commit_in_place(self, version: int) -> None:
        """Copy the staged factors into the committed adapter, then into its slot buffers
        (between two engine steps, inside ``finish_weight_update``): through the kept slot
        views (:class:`.SlotWriter`), or by re-activating it (vLLM's ``set_lora`` per module)
        when the adapter moved slot or a module replaced its buffers since they were captured."""
        manager = self.manager
        with self.ledger.transaction(version) as tx:
            tx.touched = True  # the committed adapter's only copy is overwritten from here on
            self._in_place.copy_from(self._staging)
            slots = self._slots is not None and self._slots.write(manager, LORA_ID)
            if not slots:
                self._slots = None
                manager.deactivate_adapter(LORA_ID)
                manager.activate_adapter(LORA_ID)
            tx.commit()
        if not slots:
            self._slots = SlotWriter.capture(manager, LORA_ID, self._committed, self._in_place)
        self.last_install_slots = slots
        self.last_base_bytes = 0

    def _remove_all_adapters(self) -> None:
        """What the manager's ``remove_all_adapters`` does to every adapter but the committed
        one, which stays registered and active.

        vLLM's worker resets its LoRA state after every ``finish_weight_update`` and
        every base reload (``reset_lora_state``: it assumes the base changed). This
        backend changes the base only together with the adapter (the committed one was
        installed for the base now served), and the committed adapter exists only in
        memory: were it dropped, a request naming it would make vLLM try to load it
        from its (placeholder) path and fail the engine. Its slot buffers already hold
        it (removing an adapter only frees its slot): it is re-activated only when
        another adapter had taken its slot.
        """
        committed = self._committed
        if committed is None:
            self._vllm_remove_all()
            return
        manager = self.manager
        for adapter_id in list(manager.list_adapters()):
            if adapter_id != LORA_ID:
                manager.remove_adapter(adapter_id)
        if manager.get_adapter(LORA_ID) is not committed:
            manager.remove_adapter(LORA_ID)
            manager.add_adapter(committed)
        if LORA_ID not in manager.lora_index_to_id:
            manager.activate_adapter(LORA_ID)

    def _install(self, lora: Any) -> None:
        manager = self.manager
        manager.remove_adapter(LORA_ID)
        manager.add_adapter(lora)
        manager.activate_adapter(LORA_ID)

    def _restore(self, previous: Any) -> bool:
        """Put the previous adapter back after a failed install; False when that failed too."""
        try:
            self.manager.remove_adapter(LORA_ID)
            if previous is not None:
                self.manager.add_adapter(previous)
                self.manager.activate_adapter(LORA_ID)
        except Exception:  # noqa: BLE001 - the install's own error is the one raised
            return False
        return True

    @property
    def torn(self) -> bool:
        return self.ledger.torn

    @property
    def committed_version(self) -> int | None:
        return self.ledger.version or None

    # -- teardown ---------------------------------------------------------------------
    def _close_worker(self) -> None:
        from policyworker.errors import PolicyWorkerError

        joined, self._joined = self._joined, None
        if joined is not None and self._loop is not None:
            try:
                self._call(joined.worker.shutdown(), joined.worker.timeout_s)
            except PolicyWorkerError as exc:
                logger.warning("policyworker-lora: closing the old groups failed: %s", exc)
            else:
                if joined.worker.shutdown_clean:  # else the executor may still be inside one: leave them
                    joined.close()

    def shutdown(self) -> None:
        if self._base_prepack is not None:
            self._base_prepack.stop()
        self._close_worker()
        if self._loop is not None:
            self._loop.close()
            self._loop = None
