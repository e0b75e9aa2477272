"""Where the vLLM backend stages the next version, and how much memory that costs.

``init_info.staging`` picks one of three modes (docs/vllm-staging.md); none holds more
than one extra set of this rank's weights:

``"device"``
    One staging set on the engine's device. After each commit, a staging tensor that a
    live layer now reads (vLLM kept it as is: a norm weight, a layer on the plain linear
    path) is found by its storage (:func:`live_storages`), and the live tensor it
    displaced becomes the next staging tensor when shape, dtype and device match (else a
    fresh one is allocated). Overlap and delta refits work.
``"host"``
    The staging set in host memory (pinned when the engine is on CUDA). The commit copies
    each layer to the device, post-processes it off the live layer and swaps it in, layer
    by layer: the device holds one layer more at most. Overlap and delta refits work; a
    failure *during that commit* leaves the engine torn (a full refit heals it).
``"none"``
    No staging: each box lands straight in the live tensor that vLLM reads as is (on CPU
    with ``cpu_linear="torch"`` every linear layer, through vLLM's plain
    ``torch.nn.functional.linear`` path). A parameter with no such live tensor (packed by
    vLLM's CPU kernels, repacked MoE experts, quantized) lands **layer by layer**
    (:mod:`.landing`): its landing tensor is made when its first bytes come, and the layer
    is post-processed and swapped in as soon as all its tensors are in place, so only the
    layers in flight are ever held. A refit that fails after its first byte leaves the
    engine torn until a full refit commits. Neither overlap nor delta refits.

``"auto"`` (:func:`choose`) picks from free memory: device memory (NVML / CUDA) on a GPU,
``MemAvailable`` on CPU, and says which and why (:class:`StagingReport`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from policyworker.errors import ConfigError
from policyworker.integrations.vllm.loader_check import check_with_vllm_loaders
from policyworker.integrations.vllm.stage import VllmStage

__all__ = ["MODES", "StagingReport", "choose", "mem_available", "build", "decide", "report", "validate"]

MODES = ("auto", "device", "host", "none")
#: "device" on CPU needs this many staging sets' worth of MemAvailable (one for the set,
#: the rest as headroom for the refit's transients and everything else on the host).
CPU_HEADROOM_SETS = 3
#: "device" on a GPU: the set plus this fraction of the free memory left over.
GPU_HEADROOM = 0.10


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingReport:
    """What the backend chose and what it holds (``engine.staging_report``, a dict)."""

    mode: str
    requested: str
    reason: str
    #: One full set of this rank's weights in the form vLLM loads them.
    set_bytes: int
    #: Staging bytes held now that no live layer reads (device memory, or host for "host").
    extra_bytes_steady: int
    #: The most such bytes held at once so far, including a refit's landing tensors.
    extra_bytes_peak: int
    #: Where the extra bytes live: "device" memory or "host" memory.
    where: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate(staging: Any, *, overlap: bool, delta: bool) -> None:
    """Refuse a bad ``init_info.staging`` (or a combination the mode cannot do) at init."""
    if staging not in MODES:
        raise ConfigError(f"init_info.staging must be one of {', '.join(map(repr, MODES))}, got {staging!r}")
    if staging == "none" and overlap:
        raise ConfigError("init_info.staging='none' writes into vLLM's live tensors, so it cannot overlap a "
                          "refit with generation (overlap needs a staging set nothing live reads): use "
                          "staging='device' or 'host'")
    if staging == "none" and delta:
        raise ConfigError("init_info.staging='none' cannot apply delta refits: a delta needs a base known to "
                          "hold the newest version, and an in-place receive that fails leaves none; use "
                          "staging='device' or 'host'")


def mem_available() -> int:
    """The host's ``MemAvailable`` in bytes (Linux)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("no MemAvailable in /proc/meminfo: cannot choose init_info.staging='auto'; pass a mode")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def choose(requested: str, *, set_bytes: int, device: torch.device, overlap: bool, delta: bool,
           free_device: int | None = None, free_host: int | None = None) -> tuple[str, str]:
    """(mode, reason) for ``requested``; "auto" decides from free memory (see the module docstring).

    ``free_device`` / ``free_host``: measured now unless given (tests pass their own).
    """
    validate(requested, overlap=overlap, delta=delta)
    if requested != "auto":
        return requested, f"init_info.staging={requested!r}"
    in_place_ok = not (overlap or delta)
    if device.type == "cuda":
        if free_device is None:
            free_device = torch.cuda.mem_get_info(device)[0]
        if free_device >= set_bytes + GPU_HEADROOM * free_device:
            return "device", (f"free device memory {_gib(free_device)} holds one staging set ({_gib(set_bytes)}) "
                              f"with {GPU_HEADROOM:.0%} to spare")
        if free_host is None:
            free_host = mem_available()
        if free_host >= CPU_HEADROOM_SETS * set_bytes:
            return "host", (f"free device memory {_gib(free_device)} is short of one staging set "
                            f"({_gib(set_bytes)}) + {GPU_HEADROOM:.0%}; host MemAvailable {_gib(free_host)} "
                            f">= {CPU_HEADROOM_SETS} sets")
        where = f"free device memory {_gib(free_device)} and host MemAvailable {_gib(free_host)}"
    else:
        if free_host is None:
            free_host = mem_available()
        if free_host >= CPU_HEADROOM_SETS * set_bytes:
            return "device", (f"host MemAvailable {_gib(free_host)} >= {CPU_HEADROOM_SETS} staging sets "
                              f"({_gib(set_bytes)} each)")
        where = f"host MemAvailable {_gib(free_host)}"
    if not in_place_ok:
        raise ConfigError(f"init_info.staging='auto': {where} cannot hold a staging set ({_gib(set_bytes)}), and "
                          f"{'overlap' if overlap else 'delta refits'} need one; free memory or turn it off")
    return "none", f"{where} cannot hold a staging set ({_gib(set_bytes)}): refits land in place"


def decide(init_info: Any, *, set_bytes: int, device: torch.device) -> tuple[str, str, str]:
    """(mode, reason, the ``cpu_linear`` the stage uses) for ``init_info`` (:func:`choose`)."""
    mode, reason = choose(init_info.staging, set_bytes=set_bytes, device=device, overlap=init_info.overlap,
                          delta=bool(init_info.reshard_options.get("delta")))
    if mode == "none":
        reason += "; parameters vLLM post-processes land layer by layer"
    return mode, reason, init_info.cpu_linear


def build(model: torch.nn.Module, targets: Any, *, device: torch.device, staging: str) -> VllmStage:
    """A stage of mode ``staging``, checked against vLLM's own weight loaders."""
    stage = VllmStage(model, targets, device=device, staging=staging)
    check_with_vllm_loaders(stage)
    return stage


def report(stage: VllmStage, *, requested: str, reason: str, device: torch.device) -> StagingReport:
    """What ``stage`` holds now (``engine.staging_report``)."""
    return StagingReport(mode=stage.staging, requested=requested, reason=reason, set_bytes=stage.set_bytes,
                         extra_bytes_steady=stage.extra_bytes(), extra_bytes_peak=stage.peak_extra,
                         where="host" if stage.staging == "host" else device.type)
