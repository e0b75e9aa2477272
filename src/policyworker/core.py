"""WorkerCore: what trainer-side and rollout-side workers share.

One refit executor thread (refits are serial), device facts resolved once, the
per-transport state dicts, the ZMQ endpoint, the groups, profiling, and an
idempotent shutdown. Nothing here reads ``RANK`` or other globals: rank, device and
directories are passed in.
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from . import device as _device
from ._aio import run_in_executor
from .comm import DEFAULT_TIMEOUT_S, CommGroup, _check_timeout
from .errors import ConfigError, RefitAborted, WorkerClosed
from .watchdog import process_watchdog

__all__ = ["RUNTIME_DIR_ENV", "WorkerCore", "private_runtime_dir"]

T = TypeVar("T")
RUNTIME_DIR_ENV = "POLICYWORKER_RUNTIME_DIR"


def private_runtime_dir(path: str | os.PathLike[str] | None = None) -> str:
    """A directory only this user can enter (mode 0700), created if missing, checked if not.

    Default: ``$POLICYWORKER_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/policyworker``, else
    ``<tmp>/policyworker-<uid>``. IPC sockets live here, never in a world-writable path.
    Raises ``ConfigError`` if the directory is owned by someone else or open to others.
    """
    if path is None:
        path = os.environ.get(RUNTIME_DIR_ENV)
    if path is None:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        path = os.path.join(xdg, "policyworker") if xdg else os.path.join(tempfile.gettempdir(), f"policyworker-{os.getuid()}")
    path = os.fspath(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"runtime dir {path!r} exists and is not a directory")
    if st.st_uid != os.getuid():
        raise ConfigError(f"runtime dir {path!r} is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"runtime dir {path!r} has mode {stat.S_IMODE(st.st_mode):o}; it must be private (0700)"
        )
    return path


def _check_index(value: int | None, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    return value


class WorkerCore:
    """Shared machinery of ``AbstractPolicyWorker`` and ``RolloutWorker``.

    ``rank`` is this process's rank in its own world (trainer world or rollout world).
    ``zmq_pair`` tells colocated pairs on one device apart (0 unless several trainer/
    rollout pairs share a GPU): it is part of the IPC endpoint's name.
    ``device``: a torch device / CUDA index, or None for the current CUDA device (CPU
    when there is no GPU). ``cpu_index`` names the CPU "device" for pairing colocated
    peers when there is no GPU (defaults to ``rank``).
    """

    role = "worker"

    def __init__(
        self,
        *,
        rank: int = 0,
        device: torch.device | int | str | None = None,
        cpu_index: int | None = None,
        runtime_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        zmq_timeout_s: float = 30.0,
        zmq_pair: int = 0,
    ) -> None:
        _check_index(rank, "rank")
        _check_index(zmq_pair, "zmq_pair")
        _check_index(cpu_index, "cpu_index")
        for value, name in ((timeout_s, "timeout_s"), (zmq_timeout_s, "zmq_timeout_s")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        self.rank = rank
        self.zmq_pair = zmq_pair
        self.timeout_s = float(timeout_s)
        self.zmq_timeout_s = float(zmq_timeout_s)
        self.device_facts = _device.device_facts(device, cpu_index=rank if cpu_index is None else cpu_index)
        self.device = self.device_facts.torch_device
        self.runtime_dir = private_runtime_dir(runtime_dir)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"policyworker-{self.role}-{rank}")
        self._transport_state: dict[str, dict[str, Any]] = {}
        self._state_lock = threading.Lock()
        self._closed = False
        self._zmq_ctx = None
        self._zmq_socket = None
        self._zmq_lock = threading.Lock()
        self.model_update_group: CommGroup | None = None
        #: The update group's shared secret (new at every init_collective); see control.py.
        self.control_token: str | None = None
        self._control = None
        self._profiler = None
        self.profile_dir = os.path.join(self.runtime_dir, "profiles")
        self.last_profile_path: str | None = None

    # -- plumbing ------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._closed:
            raise WorkerClosed(f"{self.role} rank {self.rank} was shut down", rank=self.rank)

    async def _run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run a blocking body on the refit executor thread."""
        self._ensure_open()
        return await run_in_executor(self._executor, fn, *args, **kwargs)

    def _check_refit_timeout(self, refit_timeout_s: float | None) -> float | None:
        if refit_timeout_s is None:
            return None
        return _check_timeout(refit_timeout_s, "refit_timeout_s")

    async def _refit_under_deadline(
        self, transport: Any, ctx: Any, *, timeout: float | None, aborts: list[Callable[[], None]],
        version: int | None = None,
    ) -> Any:
        """Connect ``transport`` if the plan changed, then send or receive one refit.

        With ``timeout`` a watchdog deadline is armed around both (``aborts`` run when it
        fires; ``ctx.deadline`` is set) and an abort it caused surfaces as
        ``RefitTimeout``. The deadline is disarmed however the refit ends.
        """
        deadline = None
        if timeout is not None:
            deadline = ctx.deadline = process_watchdog().arm(
                timeout, aborts, label=f"{transport.name} {self.role} rank {self.rank}")
        try:
            if ctx.state.get("connected_hash") != ctx.plan.hash:
                await transport.connect(ctx)
            if ctx.role == "send":
                return await transport.send(ctx, version)
            return await transport.receive(ctx)
        except RefitAborted:
            if deadline is not None:
                deadline.check()  # fired: a RefitTimeout, not a bare abort
            raise
        finally:
            if deadline is not None:
                process_watchdog().disarm(deadline)

    def _refit_transport_state(self, key: str) -> dict[str, Any]:
        """The bookkeeping dict of transport ``key``: same dict per key, created lazily."""
        if not isinstance(key, str) or not key:
            raise ConfigError(f"transport state key must be a non-empty string, got {key!r}")
        with self._state_lock:
            state = self._transport_state.get(key)
            if state is None:
                state = self._transport_state[key] = {}
            return state

    def _replace_group(self, attr: str, group: CommGroup | None) -> None:
        old = getattr(self, attr, None)
        setattr(self, attr, group)
        if old is not None and old is not group:
            old.close()

    # -- cheap queries (never block, never touch CUDA) -------------------------------
    def is_alive(self) -> bool:
        """True until ``shutdown``; answers from the loop without waiting on a refit."""
        return not self._closed

    def stand_down_refit_watchdog(self) -> int:
        """Disarm every armed refit deadline in this process without firing; return the count."""
        return process_watchdog().stand_down()

    def get_zmq_address(self) -> str:
        """The IPC endpoint shared with the colocated peer on the same device.

        Both sides derive it from the device id and ``zmq_pair``, under the private
        runtime dir, so the two processes of a pair meet and other pairs never do.
        """
        return f"ipc://{self.runtime_dir}/policyworker-{self.device_facts.device_id}-{self.zmq_pair}.sock"

    # -- control endpoint ------------------------------------------------------------
    def start_control_endpoint(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve status and stand-down requests over TCP for holders of the group token.

        Returns the ``tcp://host:port`` address (port 0: a free one). Idempotent: a
        running endpoint's address is returned. Needs ``init_collective`` first.
        """
        self._ensure_open()
        if self._control is None:
            from .control import ControlServer

            self._control = ControlServer(self, host=host, port=port)
        return self._control.address

    # -- zmq -------------------------------------------------------------------------
    def maybe_init_zmq(self) -> None:
        """Create this side's ZMQ socket once (idempotent): bounded send/recv, linger 0."""
        self._ensure_open()
        with self._zmq_lock:
            if self._zmq_socket is not None:
                return
            import zmq

            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            ms = int(self.zmq_timeout_s * 1000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, ms)
            sock.setsockopt(zmq.RCVTIMEO, ms)
            address = self.get_zmq_address()
            try:
                if self._zmq_binds():
                    sock.bind(address)
                else:
                    sock.connect(address)
            except zmq.ZMQError as exc:
                sock.close(0)
                ctx.term()
                raise ConfigError(f"cannot open ZMQ endpoint {address}: {exc}", rank=self.rank) from exc
            self._zmq_ctx, self._zmq_socket = ctx, sock

    def _zmq_binds(self) -> bool:
        """Trainers bind the device's endpoint; rollouts connect to it."""
        return True

    @property
    def zmq_socket(self):
        return self._zmq_socket

    def _close_zmq(self) -> None:
        with self._zmq_lock:
            sock, ctx = self._zmq_socket, self._zmq_ctx
            self._zmq_socket = self._zmq_ctx = None
        if sock is not None:
            sock.close(0)
        if ctx is not None:
            ctx.term()

    # -- device facts ----------------------------------------------------------------
    def report_device_id(self) -> str:
        """``GPU-<uuid>`` (NVML) or ``CPU-<host>-<index>`` (see ``policyworker.device``)."""
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

    # -- lifecycle -------------------------------------------------------------------
    def _groups(self) -> list[CommGroup]:
        """Every group this worker is in (aborted first on shutdown)."""
        return [g for g in (getattr(self, a, None) for a in ("model_update_group", "pp_comm_group")) if g is not None]

    def _close_resources(self) -> None:
        """Subclasses release their own resources here (runs once, on shutdown)."""

    async def shutdown(self) -> bool:
        """Close transports, groups, sockets and the executor. Safe to call twice."""
        if self._closed:
            return True
        self._closed = True
        # Abort groups first: a refit blocked in a collective then returns promptly,
        # so the executor below drains instead of waiting out a deadline.
        for group in self._groups():
            group.abort()
        for state in list(self._transport_state.values()):
            transport = state.get("transport")
            if transport is not None and hasattr(transport, "aclose"):
                await transport.aclose()
            for value in list(state.values()):
                if isinstance(value, CommGroup):
                    value.close()
        await run_in_executor(None, self._executor.shutdown, True)
        self._close_resources()
        for attr in ("model_update_group", "pp_comm_group"):
            self._replace_group(attr, None)
        self._close_zmq()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._profiler is not None:
            self.stop_gpu_profiling()
        return True
