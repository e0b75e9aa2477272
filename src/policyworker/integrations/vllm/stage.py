"""vLLM's next weights, received and post-processed off the live model, swapped in at commit.

A refit into vLLM must end with vLLM's kernels reading the new weights. On CPU its
linear layers *prepack* at load (oneDNN / sgl kernels copy the weight into their own
layout and drop the parameter), so the bytes have to go through the layer's own
post-processing (``quant_method.process_weights_after_loading``); elsewhere (GPU,
norms, embeddings) the runtime reads the parameter as is. vLLM's generic layerwise
reload does both, but per refit it also re-creates every parameter from meta tensors,
buffers each loader call and copies every byte twice (loader in, kernel tensors back):
measured on CPU, ~45% of its time was copies and bookkeeping, the rest the prepack.

:class:`VllmStage` keeps, per vLLM parameter, **one** staging tensor of the shape vLLM
loads (its restore metadata: the parameter before post-processing, e.g. the fused
``qkv_proj`` of this tp rank, the padded vocabulary shard), placed as ``staging`` says
(:mod:`.staging`: on the device, in host memory, or none: the live tensor itself, and a
landing tensor made on demand and installed layer by layer where there is none,
:mod:`.landing`):

* receive: the refit's boxes land straight in views of the staging set (each box is a
  run of rows of its fused parameter: `receive_views`), so no byte is copied after the wire;
* prepare (after every rank's verdict, before the commit): each layer is shallow-copied
  with the staging tensors as its parameters and vLLM's own
  ``process_weights_after_loading`` runs on that copy — the live layer is untouched, so
  a failure here leaves vLLM serving the previous version;
* commit: the copy's parameters, buffers and attributes (``cpu_linear`` with its packed
  weight, an emptied ``weight``) replace the live layer's — pointer moves, no copies —
  or, with ``copy_into_live`` (CUDA graphs, compiled models: they keep reading the
  storage they captured), a tensor of unchanged shape and dtype is copied into the live
  storage, as vLLM's own reload does.

One set is enough because the commit looks: whatever vLLM's post-processing kept of a
staging tensor (a norm weight as is, a kernel closing over the weight) is found among
the live layers' storages after the swap, and that parameter's staging moves to the
live tensor it displaced (or a fresh one); the next refit never writes what is served.

Delta refits (``reshard_options={"delta": True}``) apply the changed elements to the
bytes the receive destinations already hold, which must be the newest version this
rank received. A staging tensor that moved after a commit holds an older one, so
:meth:`VllmStage.catch_up` copies the newest bytes (now live) into it before the next
refit (only in delta mode), and the receiver's per-copy checksums prove the base right.

Where each box lands is checked once against vLLM's own weight loaders
(:mod:`.loader_check`, run by whoever builds a stage): a layer whose loader places a box
elsewhere is refused before any refit.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from policyworker.errors import ConfigError
from policyworker.integrations.vllm.moe import kernel_built, loaded_form as _loaded_form, repack_experts
from policyworker.integrations.vllm.prepack import MODULE_SLOTS, SKIP_FLAG, BackgroundPrepack, set_skip_flag, shallow_layer
from policyworker.integrations.vllm.live import live_storages, storage_key

__all__ = ["Prepared", "VllmStage", "loaded_set_bytes"]


@dataclass
class _Slot:
    """One live vLLM parameter (shared by tied layers): its staging tensor."""

    owners: list[tuple[torch.nn.Module, str]]
    meta: torch.Tensor            # the parameter as vLLM loads it (meta device or live)
    stage: torch.Tensor           # "none": the live tensor itself where vLLM reads it as loaded, else
                                  # a meta placeholder (its landing tensor is made on demand)
    targets: list[Any] = field(default_factory=list)
    covered: int = 0              # rows [0, covered) of the (flattened) stage receive boxes


@dataclass
class Prepared:
    """One post-processed version, per layer, ready to be swapped in ("host": swapped layer
    by layer at commit, so ``layers`` is empty)."""

    layers: list[tuple[torch.nn.Module, torch.nn.Module]]
    #: ``cpu_linear="background"``: live layers to prepack after the commit (vLLM's own skip
    #: flag; whether vLLM drops the weight once packed)
    background: list[tuple[torch.nn.Module, bool | None, bool]] = field(default_factory=list)


def _materialize(like: torch.Tensor, module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """A zeroed tensor of ``like``'s shape with its class and loader attributes (vLLM's way)."""
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    with torch.device(device):
        tensor = materialize_meta_tensor(like) if like.is_meta else _wrap(torch.empty_like(like), like)
    return restore_layer_refs(tensor, module).zero_()


def _wrap(data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``data`` (shared storage) as a tensor of ``like``'s class with a copy of its attributes."""
    out = data.detach().view_as(data)
    out.__class__ = like.__class__
    out.__dict__ = like.__dict__.copy()
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def loaded_set_bytes(model: torch.nn.Module) -> int:
    """One full set of ``model``'s parameters in the form vLLM loads them (tied ones once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for pname, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen[id(param)] = _nbytes(_loaded_form(module, pname, param))
    return sum(seen.values())


def _loaded_as_is(live: torch.Tensor, meta: torch.Tensor) -> bool:
    """Whether the live parameter is in the form vLLM loads (so a box can land in it)."""
    return live is meta or (live.numel() > 0 and tuple(live.shape) == tuple(meta.shape)
                            and live.dtype == meta.dtype and live.is_contiguous())


class VllmStage:
    """One staging set for a vLLM model, placed as ``staging`` says; see the module docstring.

    ``targets``: `vllm_targets(model)` (what each rank loads and where). Built once per
    engine and staging mode; :meth:`set_wire_dtypes` follows the trainers' plan.
    ``staging``: "device", "host" or "none" (:mod:`.staging`). ``once``: the stage receives
    and commits one version and is then dropped (a LoRA engine's base): a staging tensor
    the live layers kept gets no successor.
    """

    def __init__(self, model: torch.nn.Module, targets: Sequence[Any], *, device: torch.device,
                 staging: str = "device", once: bool = False) -> None:
        if staging not in ("device", "host", "none"):
            raise ConfigError(f"a VllmStage stages on 'device', in 'host' memory or 'none', not {staging!r}")
        self.model = model
        self.device = device
        self.staging = staging
        self.once = once
        self.wire_dtypes: dict[str, str] = {}
        #: Commit by copying into live tensors of unchanged shape (else: install the new ones).
        self.copy_into_live = False
        #: On CPU: "prepack" runs vLLM's own post-processing of unquantized linear layers
        #: (oneDNN / sgl prepack: a copy of every weight per commit); "torch" has them read
        #: the received tensor as is through vLLM's plain ``torch.nn.functional.linear``
        #: path (its ``_cpu_skip_gemm_dispatch``): the commit is then a swap, no copy;
        #: "background": served as with "torch", then prepacked layer by layer after the
        #: commit (:mod:`.vllm_prepack`).
        self.cpu_linear = "prepack"
        self.prepack = BackgroundPrepack()
        #: Whether the receive buffers hold the newest complete refit.
        self.fresh = False
        home = torch.device("cpu") if staging == "host" else device
        pin = staging == "host" and device.type == "cuda"
        slots: dict[int, _Slot] = {}
        for mod_name, module in model.named_modules(remove_duplicate=False):
            for pname, param in module._parameters.items():
                if param is None:
                    continue
                slot = slots.get(id(param))
                if slot is None:
                    slot = slots[id(param)] = _Slot([], _loaded_form(module, pname, param), param)
                if (module, pname) not in slot.owners:
                    slot.owners.append((module, pname))
        self._slots = list(slots.values())
        by_owner = self._by_owner = {(id(m), p): s for s in self._slots for m, p in s.owners}
        for t in targets:
            slot = by_owner.get((id(model.get_submodule(t.module)), t.pname))
            if slot is None:
                raise ConfigError(f"vLLM has no parameter {t.module}.{t.pname}", param=t.need.name)
            slot.targets.append(t)
        for slot in self._slots:  # slot.stage holds the live parameter until here
            if staging == "none" and _loaded_as_is(slot.stage, slot.meta):
                continue  # boxes land in the live tensor
            if staging == "none" and slot.targets:
                slot.stage = _placeholder(slot.meta)  # landed layer by layer (.landing)
                continue
            slot.stage = _materialize(slot.meta, slot.owners[0][0], home)
            if pin:
                slot.stage = _wrap(slot.stage.pin_memory(), slot.stage)
        self._slot_of = {t.need.name: s for s in self._slots for t in s.targets}
        #: ``staging="none"``: the refit in progress's on-demand landing (:meth:`start_landing`).
        self._landing: Any = None
        self._layers = list({id(m): m for s in self._slots for m, _ in s.owners}.values())
        # vLLM sets this flag itself on some layers (MLA's kv_b_proj): "prepack" restores it.
        self._skip_flag = {id(m): m.__dict__.get(SKIP_FLAG) for m in self._layers}
        #: One full set of this rank's weights in vLLM's loaded form.
        self.set_bytes = sum(_nbytes(s.meta) for s in self._slots)
        self._views: dict[str, torch.Tensor] = {}
        for slot in self._slots:
            self._views.update(self._slot_views(slot, slot.stage, record=True))
        self._recv = dict(self._views)
        #: Staging tensors that moved at the last commit: {slot index: the live tensor
        #: holding the newest bytes} (what :meth:`catch_up` copies from).
        self._behind: dict[int, torch.Tensor] = {}
        self._displaced: dict[int, torch.Tensor] = {}
        # A commit leaves the move of adopted staging tensors to :meth:`settle` (off the swap).
        self._settle_lock = threading.RLock()
        self._unsettled = False
        self.peak_extra = self.extra_bytes()

    # -- where the boxes land ----------------------------------------------------------
    def _slot_views(self, slot: _Slot, tensor: torch.Tensor, *, record: bool = False) -> dict[str, torch.Tensor]:
        """{need name: view of ``tensor``} for ``slot``: a fused parameter's boxes are
        consecutive runs of its rows, in vLLM's member order (q, k, v / gate, up)."""
        out = {}
        stage, row = tensor, 0
        if slot.targets and stage.dim() == len(slot.targets[0].need.shape) + 1:
            stage = stage.flatten(0, 1)  # fused experts: [E_local, rows, cols] as rows of experts
        for t in slot.targets:
            shape = tuple(b - a for a, b in zip(t.need.start, t.need.stop))
            if len(shape) != stage.dim() or tuple(shape[1:]) != tuple(stage.shape[1:]) \
                    or row + shape[0] > stage.shape[0]:
                raise ConfigError(f"{t.need.name}'s box {list(shape)} does not fit vLLM's "
                                  f"{t.module}.{t.pname} {list(stage.shape)}", param=t.need.name)
            out[t.need.name] = stage.narrow(0, row, shape[0])
            row += shape[0]
        if record:
            slot.covered = row
        return out

    def extra_bytes(self) -> int:
        """Staging bytes held that no live layer reads (host memory for "host")."""
        self.settle()
        live = live_storages(self._layers)
        held = {storage_key(s.stage): _nbytes(s.stage) for s in self._slots
                if not s.stage.is_meta and storage_key(s.stage) not in live}
        held.update({storage_key(r): _nbytes(r) for name, r in self._recv.items()
                     if r is not self._views[name] and not r.is_meta})
        return sum(held.values())

    def set_wire_dtypes(self, wire_dtypes: Mapping[str, str]) -> None:
        """The trainers' dtype per need: a box whose wire dtype is not vLLM's lands in its own
        buffer and is cast into the staging view at prepare (as vLLM's loaders would)."""
        self.settle()
        self.wire_dtypes = dict(wire_dtypes)
        self.fresh = False  # fresh receive buffers hold no version
        for name, view in self._views.items():
            wire = self.wire_dtypes.get(name, str(view.dtype).removeprefix("torch."))
            same = wire == str(view.dtype).removeprefix("torch.")
            self._recv[name] = view if same else self._cast_buffer(view, getattr(torch, wire))
        self._note_peak()

    def _cast_buffer(self, view: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
        """Where a box of another wire dtype lands: its own buffer, cast in at prepare ("none":
        a placeholder; the landing makes a temporary and casts it in once complete)."""
        return torch.zeros(view.shape, dtype=wire, device="meta" if self.staging == "none" else view.device)

    def receive_views(self) -> dict[str, torch.Tensor]:
        """The receive destinations of the next refit (nothing live reads them, but in "none",
        where the ``meta`` ones are placeholders a :class:`~.landing.LayerLanding` opens)."""
        self.settle()
        return dict(self._recv)

    def start_landing(self, landing: Any) -> Any:
        """Record the next refit's on-demand landing ("none": a :class:`~.landing.LayerLanding`
        over this stage, else None); its installed layers are left out of :meth:`prepare`."""
        self._landing = landing
        return landing

    def received(self, ok: bool) -> None:
        """Record the end of a refit into the staging set: complete (``ok``) or not."""
        self.fresh = ok
        self._behind.clear()
        if self._landing is not None:
            self._landing.close()
            self.peak_extra = max(self.peak_extra, self.extra_bytes() + self._landing.peak)

    def catch_up(self) -> bool:
        """Make the receive buffers hold the newest received bytes (the base a delta refit
        applies to): copy them from the live tensors into the staging tensors that moved at
        the last commit. Returns whether it copied. With no complete refit known there is
        nothing to copy: the transport then reports no base and refits in full."""
        self.settle()
        behind, self._behind = self._behind, {}
        if not self.fresh or not behind:
            return False
        with torch.no_grad():
            for index, newest in behind.items():
                self._slots[index].stage.copy_(newest)
        return True

    # -- prepare and commit --------------------------------------------------------------
    def prepare(self) -> Prepared:
        """Post-process the received set with vLLM's own code, on copies of the layers
        ("host": only the wire-dtype casts; the layers are post-processed at commit)."""
        with torch.no_grad():
            for name, view in self._views.items():
                recv = self._recv[name]
                if recv is not view and not recv.is_meta:  # meta: the landing cast it in
                    view.copy_(recv)  # vLLM's loaders cast the wire dtype the same way (copy_)
        if self.staging == "host":
            return Prepared(layers=[])
        # A fresh wrapper per refit (one per parameter, so tied layers still share it):
        # post-processing may rebind its .data (sgl: bias -> float32), never the staging.
        fresh = {id(s): _wrap(s.stage, s.stage) for s in self._slots}
        installed = self._landing.installed if self._landing is not None else set()
        self._landing = None
        layers, background = [], []
        for module in self._layers:
            if id(module) in installed:
                continue  # "none": swapped in as its bytes landed (.landing)
            shadow, queued = self._post_process(module, fresh)
            if queued is not None:
                background.append(queued)
            layers.append((module, shadow))
        return Prepared(layers=layers, background=background)

    def _post_process(self, module: torch.nn.Module, tensors: Mapping[int, torch.Tensor]) -> tuple[Any, Any]:
        """``module``'s copy over ``tensors`` ({id(slot): tensor}), post-processed by vLLM; and
        its background-prepack entry (or None)."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        shadow = shallow_layer(module)
        for pname, param in module._parameters.items():
            if param is not None:
                shadow._parameters[pname] = tensors[id(self._by_owner[(id(module), pname)])]
        method = getattr(shadow, "quant_method", None)
        if self._as_received(module, shadow, method):  # nothing to post-process now
            if self.cpu_linear == "background":
                return shadow, (module, self._skip_flag.get(id(module)), not _is_embedding(method))
        elif isinstance(method, QuantizeMethodBase):
            shadow.__dict__.pop("_already_called_process_weights_after_loading", None)
            repack = kernel_built(shadow)
            with torch.no_grad():
                method.process_weights_after_loading(shadow)
            if repack:  # vLLM skips its MoE kernel's repack once the kernel exists
                repack_experts(shadow)
            if hasattr(shadow, "update_param_tp_status"):
                shadow.update_param_tp_status()
        return shadow, None

    def _as_received(self, module: torch.nn.Module, shadow: torch.nn.Module, method: Any) -> bool:
        """Set up ``shadow``'s CPU linear path for :attr:`cpu_linear`; True: read as received.

        With ``"torch"`` and ``"background"``, unquantized linear layers and embeddings
        (``lm_head``) get vLLM's own plain ``cpu_linear = F.linear`` over the staged
        parameter, which they keep, and are not post-processed now (``"background"``
        prepacks them after the commit). Layers vLLM would pack with its sgl / zentorch
        kernels, and anything quantized, are post-processed as usual; with
        ``"prepack"`` every layer is.
        """
        if self.device.type != "cpu":
            return False
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        set_skip_flag(shadow, self._skip_flag.get(id(module)))  # (dropped: the commit drops it live too)
        if self.cpu_linear == "prepack" or not isinstance(method, (UnquantizedLinearMethod,
                                                                   UnquantizedEmbeddingMethod)):
            return False
        weight = shadow._parameters.get("weight")
        if weight is None or weight.dim() != 2 or _own_cpu_kernel(weight):
            return False
        shadow.__dict__["cpu_linear"] = torch.nn.functional.linear
        if isinstance(method, UnquantizedLinearMethod):
            shadow.__dict__[SKIP_FLAG] = True  # vLLM's own reload takes the plain path too, until repacked
        return True

    def commit(self, prepared: Prepared) -> None:
        """Swap a prepared version in (attribute moves only; call after every verdict).

        "host": each layer is copied to the device, post-processed and swapped in turn
        (a failure part way leaves earlier layers on the new version). "device": each
        staging tensor that a live layer now reads gets a successor in :meth:`settle`,
        which the caller may run on another thread (it only reads the live layers); every
        method that hands out or fills receive destinations settles first.
        """
        self.settle()
        retired: list[Any] = []
        background = prepared.background
        with self._settle_lock, self.prepack.lock:
            self.prepack.supersede()  # a background run of the previous version installs nothing more
            if self.staging == "host":
                background = self._commit_from_host(retired)
            else:
                self._displaced.clear()
                self._swap(prepared.layers, retired)
            if self.staging == "device" and not self.once:
                self._unsettled = True  # _displaced: the live tensors the swap replaced, until settled
            else:
                self._displaced.clear()
        if not self._unsettled:
            self._note_peak()
        if background:
            # The replaced kernels (oneDNN handles: freeing one unmaps its packed weight) are
            # dropped by the background thread, at its low priority, not on the refit's road.
            self.prepack.start(background, retired)

    def _commit_from_host(self, retired: list[Any]) -> list[Any]:
        background = []
        tied: dict[int, torch.Tensor] = {}  # a parameter of several layers is copied once (stays tied)
        for module in self._layers:
            on_device = {}
            for pname, param in module._parameters.items():
                if param is not None:
                    slot = self._by_owner[(id(module), pname)]
                    copy = tied.get(id(slot))
                    if copy is None:
                        copy = _wrap(slot.stage.to(self.device, copy=True), slot.stage)
                        if len(slot.owners) > 1:
                            tied[id(slot)] = copy
                    on_device[id(slot)] = copy
            shadow, queued = self._post_process(module, on_device)
            if queued is not None:
                background.append(queued)
            self._swap([(module, shadow)], retired)
        return background

    def settle(self) -> None:
        """Finish the last commit: give each staging tensor that a live layer now reads a
        successor nothing live reads (the displaced live tensor where it fits), and note the
        peak. Idempotent and thread-safe; the swap itself does not wait for it, which keeps
        the walk over every layer and the allocations out of the engine's pause."""
        with self._settle_lock:
            if not self._unsettled:
                return
            with self.prepack.lock:
                self._move_adopted()  # a failure leaves it unsettled: the next caller moves the rest
            self._unsettled = False
            self._displaced.clear()  # nothing may hold the live tensors a swap replaced
            self._note_peak()

    def _move_adopted(self) -> None:
        """Give each staging tensor that a live layer now reads a successor nothing live reads."""
        live = live_storages(self._layers)
        for index, slot in enumerate(self._slots):
            if storage_key(slot.stage) not in live:
                continue
            old = self._displaced.pop(id(slot), None)
            adopted = slot.stage
            if old is not None and old.numel() > 0 and storage_key(old) not in live \
                    and tuple(old.shape) == tuple(adopted.shape) and old.dtype == adopted.dtype \
                    and old.device == adopted.device and old.is_contiguous():
                stage = _wrap(old.data, adopted)
                flat = stage.flatten(0, 1) if slot.targets and stage.dim() == len(slot.targets[0].need.shape) + 1 \
                    else stage
                if flat.dim() > 0 and slot.covered < flat.shape[0]:
                    with torch.no_grad():
                        flat.narrow(0, slot.covered, flat.shape[0] - slot.covered).zero_()  # vLLM's padding rows
            else:
                old = None
                stage = _materialize(slot.meta, slot.owners[0][0], self.device)
            slot.stage = stage
            self._behind[index] = adopted
            for name, view in self._slot_views(slot, stage).items():
                if self._recv[name] is self._views[name]:
                    self._recv[name] = view
                self._views[name] = view
        self._displaced.clear()

    def _note_peak(self) -> None:
        self.peak_extra = max(getattr(self, "peak_extra", 0), self.extra_bytes())

    def _swap(self, layers: Sequence[tuple[torch.nn.Module, torch.nn.Module]], retired: list[Any]) -> None:
        for module, shadow in layers:
            for key, value in shadow.__dict__.items():
                if key in MODULE_SLOTS:
                    continue
                old = module.__dict__.get(key, _MISSING)
                if old is not value:
                    if old is not _MISSING:
                        retired.append(old)
                    module.__dict__[key] = value
            for key in [k for k in module.__dict__ if k not in shadow.__dict__]:
                del module.__dict__[key]  # what post-processing removed (the copy started as the layer)
            for slot_name in ("_parameters", "_buffers"):
                live, new = getattr(module, slot_name), getattr(shadow, slot_name)
                for name, tensor in new.items():
                    old = live.get(name)
                    if old is tensor:
                        continue
                    if self.copy_into_live and _same_kind(old, tensor):
                        if old.data_ptr() != tensor.data_ptr():
                            with torch.no_grad():
                                old.data.copy_(tensor)
                    else:
                        live[name] = tensor
                        slot = self._by_owner.get((id(module), name)) if slot_name == "_parameters" else None
                        if slot is not None and old is not None:
                            self._displaced.setdefault(id(slot), old)


_MISSING = object()


def _is_embedding(method: Any) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return isinstance(method, UnquantizedEmbeddingMethod)


def _own_cpu_kernel(weight: torch.Tensor) -> bool:
    """True where vLLM packs this weight with its sgl or zentorch kernels (not oneDNN)."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import current_platform

    return current_platform.is_zen_cpu() or check_cpu_sgl_kernel(weight.shape[0], weight.shape[1], weight.dtype)


def _same_kind(old: torch.Tensor | None, new: torch.Tensor | None) -> bool:
    return old is not None and new is not None and old.numel() > 0 and old.shape == new.shape \
        and old.dtype == new.dtype and old.device == new.device


def _placeholder(meta: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor of ``meta``'s shape and dtype: a destination the landing makes on demand."""
    return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
