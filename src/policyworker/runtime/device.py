"""Device facts: one answer on a GPU (CUDA + NVML) and on a CPU-only host.

Everything here is safe to import without a GPU, a driver or NVML: the NVML library
is opened lazily, and ``NVMLError_LibraryNotFound`` (or any NVML failure) selects the
CPU answers instead of crashing.

Device ids (``device_id``):

* GPU: NVML's uuid, ``GPU-xxxxxxxx-xxxx-...``, the same string for every process
  that sees that GPU, whatever ``CUDA_VISIBLE_DEVICES`` renumbered it to.
* CPU: ``CPU-<hostname>-<index>``, where ``index`` is the worker's device index (its
  local rank, given explicitly). It is stable across processes and restarts on one
  host, so a trainer and its colocated rollout peer with the same index pair up —
  which is what the id is for. (A pid-based id would never pair.)
"""

from __future__ import annotations

import functools
import os
import platform
import socket
import threading
from dataclasses import dataclass

import torch

__all__ = [
    "DeviceFacts",
    "cpu_model_name",
    "device_facts",
    "free_memory_bytes",
    "node_ip",
    "peak_memory_bytes",
    "reset_peak_memory",
    "rss_bytes",
    "start_profile",
    "stop_profile",
]

_nvml_lock = threading.Lock()
_nvml_state: dict[str, object] = {}


def _nvml():
    """The pynvml module, initialised once; None when NVML is missing or fails."""
    with _nvml_lock:
        if "module" in _nvml_state:
            return _nvml_state["module"]
        module = None
        try:
            import pynvml

            pynvml.nvmlInit()
            module = pynvml
        except Exception:  # NVMLError_LibraryNotFound, ImportError, driver errors: all mean "no NVML"
            module = None
        _nvml_state["module"] = module
        return module


def _cuda_index(device: torch.device | int | str | None) -> int | None:
    if not torch.cuda.is_available():
        return None
    if device is None:
        return torch.cuda.current_device()
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        return None
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _gpu_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return text if text.startswith("GPU-") else f"GPU-{text}"
    nvml = _nvml()
    if nvml is None:
        return f"GPU-{socket.gethostname()}-{index}"
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    value = nvml.nvmlDeviceGetUUID(handle)
    return value.decode() if isinstance(value, bytes) else value


def _nvml_handle(index: int):
    nvml = _nvml()
    if nvml is None:
        return None, None
    try:
        return nvml, nvml.nvmlDeviceGetHandleByUUID(_gpu_uuid(index))
    except Exception:  # uuid lookup unsupported (MIG, old driver): fall back to index
        try:
            return nvml, nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            return None, None


@functools.lru_cache(maxsize=1)
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _meminfo_kb(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def free_memory_bytes(device: torch.device | int | str | None = None) -> int:
    """Free memory device-wide: NVML on a GPU (all processes), MemAvailable on CPU."""
    index = _cuda_index(device)
    if index is not None:
        nvml, handle = _nvml_handle(index)
        if handle is not None:
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).free)
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)
    kb = _meminfo_kb("MemAvailable")
    if kb is not None:
        return kb * 1024
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _status_kb(key: str) -> int:
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def peak_memory_bytes(device: torch.device | int | str | None = None) -> int:
    """Peak memory since the last reset: CUDA allocator peak, or this process's VmHWM."""
    index = _cuda_index(device)
    if index is not None:
        return int(torch.cuda.max_memory_allocated(index))
    return _status_kb("VmHWM") * 1024


def reset_peak_memory(device: torch.device | int | str | None = None) -> None:
    """Reset the peak counter: CUDA allocator stats, or VmHWM via /proc/self/clear_refs."""
    index = _cuda_index(device)
    if index is not None:
        torch.cuda.reset_peak_memory_stats(index)
        return
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # 5 = reset the peak resident set size (Linux >= 4.0)
    except OSError:
        pass  # not Linux or not permitted: the peak then counts from process start


@functools.lru_cache(maxsize=1)
def node_ip() -> str:
    """This host's address as peers would dial it; POLICYWORKER_NODE_IP overrides.

    Resolved from the hostname (no packets sent); falls back to 127.0.0.1.
    """
    override = os.environ.get("POLICYWORKER_NODE_IP")
    if override:
        return override
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
    return ip or "127.0.0.1"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceFacts:
    """What a worker's device is, resolved once per worker."""

    kind: str  # "cuda" | "cpu"
    index: int  # CUDA device index, or the worker's CPU device index (local rank)
    device_id: str  # "GPU-…" or "CPU-<host>-<index>"
    name: str

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")


def device_facts(device: torch.device | int | str | None = None, *, cpu_index: int = 0) -> DeviceFacts:
    """Resolve the device a worker runs on. CPU when CUDA is absent or ``device`` is CPU."""
    index = _cuda_index(device)
    if index is not None:
        return DeviceFacts(
            kind="cuda",
            index=index,
            device_id=_gpu_uuid(index),
            name=torch.cuda.get_device_name(index),
        )
    return DeviceFacts(
        kind="cpu",
        index=cpu_index,
        device_id=f"CPU-{socket.gethostname()}-{cpu_index}",
        name=cpu_model_name(),
    )


def rss_bytes() -> int:
    """This process's resident set size now."""
    return _status_kb("VmRSS") * 1024


def start_profile(facts: DeviceFacts):
    """Begin a profile: cudaProfilerStart + an NVTX range on GPU, torch.profiler on CPU."""
    if facts.kind == "cuda":
        torch.cuda.synchronize(facts.index)
        torch.cuda.profiler.start()
        torch.cuda.nvtx.range_push("policyworker")
        return ("cuda", facts.index)
    from torch.profiler import ProfilerActivity, profile

    # torch.profiler records only the starting thread's ops by default; the work worth
    # seeing (forwards, refit copies) runs on the worker's executor thread, so ask for
    # every thread. Torch builds without the option record the starting thread only.
    try:
        from torch.profiler import _ExperimentalConfig

        extra = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        extra = {}
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, **extra)
    prof.start()
    return ("cpu", prof)


def stop_profile(handle, path: str) -> str | None:
    """End a profile from :func:`start_profile`; on CPU write Chrome trace JSON to ``path``."""
    kind, obj = handle
    if kind == "cuda":
        torch.cuda.synchronize(obj)
        torch.cuda.nvtx.range_pop()
        torch.cuda.profiler.stop()
        return None  # the trace belongs to the outer profiler (nsys / ncu) that captured the range
    obj.stop()
    obj.export_chrome_trace(path)
    return path
