"""``staging="none"``: a refit lands in vLLM's live model layer by layer.

With no staging set, a box lands straight in the live tensor where vLLM reads a
parameter as it loads it (:class:`~.stage.VllmStage`'s in-place views). A parameter
vLLM keeps in another form — packed by its CPU kernels, repacked MoE experts, quantized
to FP8 — has no such tensor. Its destination is a ``meta`` placeholder, and the
transport opens it on demand (``TransportContext.landing``): :class:`LayerLanding`
allocates the parameter's *landing tensor* just before its first bytes come. As soon
as every tensor of a layer is in place, that layer is post-processed with vLLM's own
code and swapped in, and its landing tensors are dropped (or kept as the live tensor,
where vLLM reads them as they are). A box whose wire dtype is not vLLM's lands in a
temporary of the wire dtype, cast into place when it is complete.

So the extra memory at any moment is the landing tensors of the layers whose bytes are
still arriving: a few layers, bounded by the transport's window, never a set
(:attr:`LayerLanding.peak` is reported in the stage's ``extra_bytes_peak``). From the
first byte on, the engine serves a mix: a refit that fails leaves it torn until a full
refit commits, as in-place receives always did in this mode.

Runs on the transport's refit thread (on CUDA, on its stream), while the engine waits
in ``update_weights`` (``staging="none"`` never overlaps generation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from policyworker.integrations.vllm.live import storage_key
from policyworker.integrations.vllm.stage import _loaded_as_is, _materialize, _placeholder, _wrap

if TYPE_CHECKING:
    from policyworker.integrations.vllm.stage import VllmStage, _Slot

__all__ = ["LayerLanding", "return_free_heap"]


def return_free_heap() -> bool:
    """Hand the host heap's free memory back to the OS (glibc ``malloc_trim``); False where
    there is no glibc. On a CPU engine the landing tensors and the replaced kernels' memory
    are freed layer by layer, but glibc keeps freed chunks of this size for reuse. Measured
    on the bench model (``staging="none"``, RSS over the engine's): +253 MB held after the
    refits and +306 MB at the refits' peak without it; −15 MB and +158 MB with it after
    every installed layer and every commit."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.malloc_trim(0))


class LayerLanding:
    """One refit's on-demand destinations and layer-by-layer installs (see the module docstring).

    ``stage``: the ``staging="none"`` :class:`~.stage.VllmStage` whose ``receive_views``
    hold the placeholders. ``installed``: the layers already swapped in (by ``id``); the
    stage's ``prepare`` leaves them out.
    """

    def __init__(self, stage: VllmStage) -> None:
        self.stage = stage
        self.installed: set[int] = set()
        self.peak = 0
        self._bytes = 0
        self._open: dict[int, torch.Tensor] = {}       # id(slot) -> its landing tensor
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._temps: dict[str, torch.Tensor] = {}      # need name -> wire-dtype temporary
        self._waiting: dict[int, set[str]] = {}       # id(layer) -> its need names not landed yet
        self._wrapped: dict[int, torch.Tensor] = {}    # id(slot) -> the tensor its layers get
        for slot in stage._slots:
            names = {t.need.name for t in slot.targets}
            for module, _ in slot.owners:
                self._waiting.setdefault(id(module), set()).update(names)
        # a layer with no bytes in the plan is left to prepare(), as in the other modes
        self._waiting = {k: v for k, v in self._waiting.items() if v}

    # -- the transport's calls -------------------------------------------------------------
    def open(self, name: str) -> torch.Tensor:
        recv, view = self.stage._recv[name], self.stage._views[name]
        if recv.dtype != view.dtype:  # cast into place once complete
            temp = self._temps[name] = torch.empty(recv.shape, dtype=recv.dtype, device=self.stage.device)
            self._grow(temp.nbytes)
            return temp
        return self._slot_views(self.stage._slot_of[name])[name]

    def landed(self, name: str) -> None:
        slot = self.stage._slot_of[name]
        temp = self._temps.pop(name, None)
        if temp is not None:
            with torch.no_grad():
                self._slot_views(slot)[name].copy_(temp)  # vLLM's loaders cast the same way
            self._bytes -= temp.nbytes
        for module, _ in slot.owners:
            waiting = self._waiting.get(id(module))
            if waiting is not None:
                waiting.discard(name)
                if not waiting:
                    self._install(module)

    # -- the stage's calls -----------------------------------------------------------------
    def close(self) -> None:
        """The refit ended (any outcome): drop what was opened and not installed."""
        self._open.clear()
        self._views.clear()
        self._temps.clear()
        self._wrapped.clear()
        self._bytes = 0

    # -------------------------------------------------------------------------------------
    def _grow(self, n: int) -> None:
        self._bytes += n
        self.peak = max(self.peak, self._bytes)

    def _slot_tensor(self, slot: _Slot) -> torch.Tensor:
        if not slot.stage.is_meta:
            return slot.stage  # in place: the live tensor
        tensor = self._open.get(id(slot))
        if tensor is None:
            tensor = self._open[id(slot)] = _materialize(slot.meta, slot.owners[0][0], self.stage.device)
            self._grow(tensor.nbytes)
        return tensor

    def _slot_views(self, slot: _Slot) -> dict[str, torch.Tensor]:
        views = self._views.get(id(slot))
        if views is None:
            views = self._views[id(slot)] = self.stage._slot_views(slot, self._slot_tensor(slot))
        return views

    def _install(self, module: torch.nn.Module) -> None:
        """Post-process ``module`` over its received tensors and swap it in."""
        stage = self.stage
        slots = [stage._by_owner[(id(module), p)] for p, param in module._parameters.items() if param is not None]
        tensors = {}
        for slot in slots:
            if id(slot) not in self._wrapped:  # one per parameter: tied layers stay tied
                tensor = self._slot_tensor(slot)  # post-processing may rebind a parameter's .data
                self._wrapped[id(slot)] = _wrap(tensor, tensor)
            tensors[id(slot)] = self._wrapped[id(slot)]
        self._swap_in(module, tensors)
        self.installed.add(id(module))
        del self._waiting[id(module)]
        for slot in slots:
            if any(id(m) not in self.installed for m, _ in slot.owners):
                continue
            landed = self._open.pop(id(slot), None)
            self._views.pop(id(slot), None)
            self._wrapped.pop(id(slot), None)
            if landed is not None:
                self._bytes -= landed.nbytes  # freed, or live now (no longer extra)
            self._refresh(slot)

    def _swap_in(self, module: torch.nn.Module, tensors: Mapping[int, torch.Tensor]) -> None:
        """Post-process ``module`` over ``tensors`` ({id(slot): tensor}) and swap it in now."""
        stage = self.stage
        with stage._settle_lock, stage.prepack.lock:
            shadow, _ = stage._post_process(module, tensors)
            stage._swap([(module, shadow)], [])
            stage._displaced.clear()
        if stage.device.type == "cpu":
            return_free_heap()  # the landing tensors and the replaced kernel go back to the OS now

    def _refresh(self, slot: _Slot) -> None:
        """After ``slot``'s layers were installed: the next refit lands in the live tensor where
        vLLM now reads it as loaded (e.g. a landing tensor it kept), else in a placeholder."""
        stage = self.stage
        module, pname = slot.owners[0]
        live = module._parameters.get(pname)
        in_place = live is not None and not live.is_meta and _loaded_as_is(live, slot.meta)
        if slot.stage.is_meta and not in_place:
            return  # a placeholder still: the next refit lands this layer again
        if in_place and not slot.stage.is_meta and storage_key(live) == storage_key(slot.stage):
            return  # the same live tensor
        slot.stage = live if in_place else _placeholder(slot.meta)
        for name, view in stage._slot_views(slot, slot.stage).items():
            recv = stage._recv.get(name)
            stage._recv[name] = view if recv is None or recv is stage._views[name] or recv.dtype == view.dtype \
                else stage._cast_buffer(view, recv.dtype)
            stage._views[name] = view
