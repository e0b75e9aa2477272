"""Device queries and profiling of a worker: cheap, plain methods (the seed surface).

``report_device_id``, ``get_free_memory_bytes``, ``report_node_ip_and_gpu_id``,
``reset_peak_memory_stats``, ``get_gpu_info``, ``start_gpu_profiling`` /
``stop_gpu_profiling``. They read ``self.device_facts`` (resolved once by the core)
and never wait on a refit.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from policyworker.runtime import device as _device

__all__ = ["DeviceQueries"]


class DeviceQueries:
    """Mixed into ``WorkerCore``; needs ``rank``, ``role``, ``device``, ``device_facts``."""

    _profiler: Any = None
    last_profile_path: str | None = None

    # -- device facts ----------------------------------------------------------------
    def report_device_id(self) -> str:
        """``GPU-<uuid>`` (NVML) or ``CPU-<host>-<index>`` (see ``policyworker.runtime.device``)."""
        return self.device_facts.device_id

    def get_free_memory_bytes(self) -> int:
        """Free memory of the whole device (NVML), or the host's MemAvailable on CPU."""
        return _device.free_memory_bytes(self.device)

    def report_node_ip_and_gpu_id(self) -> tuple[str, int]:
        return _device.node_ip(), self.device_facts.index

    def reset_peak_memory_stats(self) -> None:
        _device.reset_peak_memory(self.device)

    def get_gpu_info(self) -> dict[str, Any]:
        """A plain dict describing this worker's device and its memory use."""
        facts = self.device_facts
        info: dict[str, Any] = {
            "rank": self.rank,
            "role": self.role,
            "kind": facts.kind,
            "device": str(self.device),
            "device_index": facts.index,
            "device_id": facts.device_id,
            "name": facts.name,
            "node_ip": _device.node_ip(),
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "free_memory_bytes": self.get_free_memory_bytes(),
            "peak_memory_bytes": _device.peak_memory_bytes(self.device),
        }
        if facts.kind == "cuda":
            info["memory_allocated_bytes"] = int(torch.cuda.memory_allocated(facts.index))
            info["memory_reserved_bytes"] = int(torch.cuda.memory_reserved(facts.index))
        else:
            rss = _device.rss_bytes()
            info["memory_allocated_bytes"] = rss
            info["memory_reserved_bytes"] = rss
        return info

    # -- profiling -------------------------------------------------------------------
    def start_gpu_profiling(self) -> None:
        """Start a profile: a CUDA profiler range on GPU; a torch.profiler trace on CPU."""
        self._ensure_open()
        if self._profiler is not None:
            return
        self._profiler = _device.start_profile(self.device_facts)

    def stop_gpu_profiling(self) -> str | None:
        """Stop the profile; return the path of the written trace (CPU), else None.

        The CPU trace is Chrome trace JSON (open it in chrome://tracing or Perfetto).
        """
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        os.makedirs(self.profile_dir, mode=0o700, exist_ok=True)
        path = os.path.join(
            self.profile_dir, f"{self.role}-rank{self.rank}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
        self.last_profile_path = _device.stop_profile(profiler, path)
        return self.last_profile_path

