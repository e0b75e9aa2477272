"""``cpu_linear="background"``: serve a commit at once, get vLLM's prepacked CPU kernels back after.

On CPU vLLM's unquantized linear layers (and embeddings, for a tied ``lm_head``) read
their weights through a oneDNN handle made at load — a reorder of every weight, a CPU
copy that the refit would otherwise pay before vLLM can serve (``"prepack"``). In
background mode the commit installs vLLM's own plain ``torch.nn.functional.linear`` path
over the received tensors (exactly the ``"torch"`` mode), so the new version is served
the moment ``finish_weight_update`` returns; then one daemon thread runs vLLM's own
``dispatch_cpu_unquantized_gemm`` on a copy of each such layer and installs the handle it
made, leaving the layer exactly as vLLM's own post-processing would (``cpu_linear``
first, then a linear layer's emptied ``weight``: vLLM's forward reads the weight before
``cpu_linear``, so a call sees either the plain path with the full weight or the packed
one; both compute from the same bytes).

A later commit supersedes a run: the commit and every install take one lock, and a run
installs nothing once a newer commit happened (generation counter), so a handle of an
older version never reaches a live layer. A layer whose prepack fails keeps the plain
path (correct, slower) and the failure is logged. The thread runs at nice 19, so the
serving thread (and the refit's own return) always comes first.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MODULE_SLOTS", "SKIP_FLAG", "BackgroundPrepack", "set_skip_flag", "shallow_layer"]

logger = logging.getLogger(__name__)

SKIP_FLAG = "_cpu_skip_gemm_dispatch"  # vLLM's own "plain F.linear path" flag on a linear layer
MODULE_SLOTS = ("_parameters", "_buffers", "_modules")


def shallow_layer(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` sharing its tensors but with dicts of its own: what a
    post-processing run on it rebinds (parameters, attributes) leaves ``module`` as is."""
    shadow = copy.copy(module)
    for slot_name in MODULE_SLOTS:
        object.__setattr__(shadow, slot_name, dict(getattr(module, slot_name)))
    return shadow


def set_skip_flag(module: torch.nn.Module, flag: bool | None) -> None:
    """Put vLLM's skip flag back to ``flag`` (None: the layer had none)."""
    if flag is None:
        module.__dict__.pop(SKIP_FLAG, None)
    else:
        module.__dict__[SKIP_FLAG] = flag


class BackgroundPrepack:
    """One background prepack run at a time for one vLLM model; see the module docstring."""

    def __init__(self) -> None:
        #: Held by the stage's commit and by every install.
        self.lock = threading.Lock()
        self._generation = 0
        self._thread: threading.Thread | None = None
        #: Layers switched to their packed kernel by the latest run.
        self.installed = 0
        self._finished = threading.Event()  # the latest run's: set when it ended
        self._finished.set()

    def supersede(self) -> None:
        """A commit is swapping new weights in (call with :attr:`lock` held)."""
        self._generation += 1

    def start(self, layers: Sequence[tuple[torch.nn.Module, bool | None, bool]], retired: list[Any]) -> None:
        """Prepack ``layers`` in the background: (live module, vLLM's own skip flag or None,
        whether vLLM drops its weight after packing — linear layers, not embeddings).
        ``retired``: what the commit replaced; the thread drops these references first."""
        with self.lock:
            generation = self._generation
        self.installed = 0
        self._finished = finished = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(generation, list(layers), finished, retired),
                                        daemon=True,
                                        name="policyworker-vllm-prepack")
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Wait for the latest run to end (True) or ``timeout_s`` to pass (False)."""
        return self._finished.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        with self.lock:
            self._generation += 1
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self, generation: int, layers: list[tuple[torch.nn.Module, bool | None, bool]],
             finished: threading.Event, retired: list[Any]) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        try:
            # The lowest CPU priority for this thread (Linux: nice is per thread; the OpenMP
            # team it starts inherits it): vLLM's serving thread always comes first.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass  # not Linux, or not allowed: it runs at the process's priority
        retired.clear()
        try:
            for module, flag, remove_weight in layers:
                if self._generation != generation:
                    return
                shadow = shallow_layer(module)
                bias = shadow._parameters.get("bias")
                if bias is not None:  # a packer may rebind .data (sgl: float32 bias): not the live one's
                    shadow._parameters["bias"] = torch.nn.Parameter(bias.data, requires_grad=False)
                try:
                    with torch.no_grad():
                        dispatch_cpu_unquantized_gemm(shadow, remove_weight=remove_weight)
                except Exception as exc:  # noqa: BLE001 - vLLM's packers raise what they raise
                    logger.warning("policyworker: background prepack of %s failed (%s); it keeps the plain "
                                   "torch linear path", type(module).__name__, exc)
                    continue
                with self.lock:
                    if self._generation != generation:
                        return  # a newer version is live: this handle is of the old bytes
                    module.__dict__["cpu_linear"] = shadow.__dict__["cpu_linear"]
                    if shadow._parameters.get("weight") is not module._parameters.get("weight"):
                        module._parameters["weight"] = shadow._parameters["weight"]  # vLLM's emptied one
                    set_skip_flag(module, flag)
                    self.installed += 1
        finally:
            finished.set()
