"""WorkerCore: the one refit road that trainer-side and rollout-side workers share.

Every refit, whatever the transport, built-in or plugin, goes::

    attach_transport(name, **setup)   registry → Setup parsed → from_setup → connect(ctx)
    refit(name, **options)            Options parsed → deadline armed for this worker →
                                      send(ctx, v) | receive(ctx, v) → ledger commit
    detach_transport(name)            aclose

The core knows no transport by name. It owns one refit executor thread (refits are
serial), device facts resolved once, the per-transport state dicts
(``_refit_transport_state``) and the update group; its groups, control endpoint and
idempotent shutdown are :mod:`~policyworker.workers.lifecycle`'s. Nothing here reads
``RANK`` or other globals.
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from policyworker.runtime import device as _device
from policyworker.runtime._aio import run_in_executor
from policyworker.runtime.comm import DEFAULT_TIMEOUT_S, CommGroup
from policyworker.config import parse, positive_seconds
from policyworker.errors import ConfigError, RefitAborted, TransportError, WorkerClosed
from policyworker.runtime.facts import DeviceQueries
from policyworker.ledger import WeightLedger
from policyworker.registry import TransportRegistry, default_registry
from policyworker.transports.base import RefitReport, Transport, TransportContext
from policyworker.runtime.watchdog import process_watchdog
from policyworker.workers.lifecycle import WorkerLifecycle, drain, groups_in

__all__ = ["RUNTIME_DIR_ENV", "Attachment", "WorkerCore", "private_runtime_dir"]

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


@dataclass(slots=True)
class Attachment:
    """One attached transport of a worker: its instance, parsed setup, plan, connect state."""

    name: str
    transport: Transport
    setup: Any
    plan: Any = None
    connected: bool = False
    raw_setup: dict[str, Any] = field(default_factory=dict)


class WorkerCore(WorkerLifecycle, DeviceQueries):
    """Shared machinery of ``AbstractPolicyWorker`` and ``RolloutWorker``: the one refit road.

    ``rank`` is this process's rank in its own world (trainer world or rollout world).
    ``zmq_pair`` tells colocated pairs on one device apart (0 unless several trainer/
    rollout pairs share a GPU): it is part of the IPC endpoint's name.
    ``device``: a torch device / CUDA index, or None for the current CUDA device (CPU
    when there is no GPU). ``cpu_index`` names the CPU "device" for pairing colocated
    peers when there is no GPU (defaults to ``rank``). ``registry``: where transport
    names resolve (default: the installed entry points).

    Subclasses say which side they are (``transport_role``: ``"send"`` or
    ``"receive"``) and provide ``_transport_params(attachment)`` (the tensors a refit
    moves) and ``_adopt_plan(name, plan)``; a receiving worker also has a ``ledger``.
    """

    role = "worker"
    transport_role = "send"

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
        registry: TransportRegistry | None = None,
    ) -> None:
        _check_index(rank, "rank")
        _check_index(zmq_pair, "zmq_pair")
        _check_index(cpu_index, "cpu_index")
        positive_seconds(timeout_s, "timeout_s", optional=False)
        positive_seconds(zmq_timeout_s, "zmq_timeout_s", optional=False)
        if registry is not None and not isinstance(registry, TransportRegistry):
            raise ConfigError(f"registry must be a TransportRegistry, got {type(registry).__name__}")
        self.rank = rank
        self.zmq_pair = zmq_pair
        self.timeout_s = float(timeout_s)
        self.zmq_timeout_s = float(zmq_timeout_s)
        self.device_facts = _device.device_facts(device, cpu_index=rank if cpu_index is None else cpu_index)
        self.device = self.device_facts.torch_device
        self.runtime_dir = private_runtime_dir(runtime_dir)
        self._registry = registry
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"policyworker-{self.role}-{rank}")
        self._transport_state: dict[str, dict[str, Any]] = {}
        self._attachments: dict[str, Attachment] = {}
        self._state_lock = threading.Lock()
        self._closed = False
        self.model_update_group: CommGroup | None = None
        #: The update group's shared secret (new at every init_collective); see control.py.
        self.control_token: str | None = None
        self._control = None
        self._profiler = None
        self.profile_dir = os.path.join(self.runtime_dir, "profiles")
        self.last_profile_path = None
        self.ledger: WeightLedger | None = None
        #: Aborted groups the executor did not leave in time: never closed under it.
        self._leaked: list[CommGroup] = []
        #: False when shutdown could not wait the executor out (see ``shutdown``).
        self.shutdown_clean: bool | None = None
        #: Closers of resources the seed shims opened outside any transport (run at shutdown).
        self._closers: list[Callable[[], None]] = []

    # -- plumbing ------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._closed:
            raise WorkerClosed(f"{self.role} rank {self.rank} was shut down", rank=self.rank)

    def ensure_open(self) -> None:
        """Raise ``WorkerClosed`` if this worker was shut down (engine adapters check it
        before they touch the worker's tensors)."""
        self._ensure_open()

    async def _run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run a blocking body on the refit executor thread."""
        self._ensure_open()
        return await run_in_executor(self._executor, fn, *args, **kwargs)

    def _check_refit_timeout(self, refit_timeout_s: float | None) -> float | None:
        return positive_seconds(refit_timeout_s, "refit_timeout_s")

    def _refit_transport_state(self, key: str) -> dict[str, Any]:
        """The bookkeeping dict of transport ``key``: same dict per key, created lazily."""
        if not isinstance(key, str) or not key:
            raise ConfigError(f"transport state key must be a non-empty string, got {key!r}")
        with self._state_lock:
            state = self._transport_state.get(key)
            if state is None:
                state = self._transport_state[key] = {}
            return state

    def _peek_state(self, key: str) -> Mapping[str, Any]:
        """Transport ``key``'s state if it exists, else an empty mapping (creates nothing)."""
        with self._state_lock:
            return self._transport_state.get(key) or {}

    # -- the generic road --------------------------------------------------------------
    def _resolve(self, name: str | Transport) -> tuple[str, type, Transport | None]:
        if isinstance(name, Transport):
            cls = type(name)
            if not cls.name:
                raise ConfigError(f"transport instance {name!r} has no name")
            return cls.name, cls, name
        if not isinstance(name, str) or not name:
            raise ConfigError(f"transport must be a registered name or a Transport instance, got {name!r}")
        registry = self._registry if self._registry is not None else default_registry()
        return name, registry.load(name), None

    def _adopt_plan(self, name: str, plan: Any) -> Any:
        """Check (and adopt) ``plan`` for transport ``name``; subclasses allocate or verify tensors."""
        return plan

    def _transport_params(self, att: Attachment) -> Mapping[str, torch.Tensor]:
        raise NotImplementedError

    def _context(self, att: Attachment, *, options: Any = None, deadline: Any = None) -> TransportContext:
        landing = getattr(self, "landing", None) if self.transport_role == "receive" else None
        if landing is not None and not type(att.transport).lands_on_demand:
            raise ConfigError(f"transport {att.name!r} cannot land destinations on demand (worker.landing is "
                              f"set); nothing received", rank=self.rank, transport=att.name)
        return TransportContext(
            worker=self, role=self.transport_role, rank=self.rank, device=self.device_facts,
            state=self._refit_transport_state(att.name), params=self._transport_params(att), plan=att.plan,
            setup=att.setup, options=options, deadline=deadline, executor=self._executor,
            update_group=self.model_update_group, world_size=getattr(self, "world_size", 1), landing=landing,
        )

    async def attach_transport(self, name: str | Transport, /, *, connect: bool = True, **setup: Any) -> None:
        """Attach transport ``name`` (a registered name, or an instance) and connect it.

        ``setup`` is checked against the transport's ``Setup`` (unknown keys and bad
        values: ``ConfigError`` now). The key ``plan`` (a ``ReshardPlan`` or its
        refit-info dict) is the worker's: required by transports that reshard.
        Attaching the same name again reconnects (recovery): the instance is kept when
        the setup is unchanged, replaced (old one closed) otherwise. ``connect`` is
        collective with the peers: every side attaches at the same time. With
        ``connect=False`` the connect is left to the next ``refit`` (inside its
        deadline), for a side whose peers connect when their refit starts.
        """
        if not isinstance(connect, bool):
            raise ConfigError(f"connect must be a bool, got {connect!r}")
        att = await self._attach(name, setup)
        if connect:
            await self._connect(att, None)

    async def _attach(self, name: str | Transport, setup: Mapping[str, Any]) -> Attachment:
        """Attach without connecting (the NeMo-named shims connect inside the refit's deadline)."""
        self._ensure_open()
        key, cls, instance = self._resolve(name)
        setup = dict(setup)
        plan = setup.pop("plan", None)
        parsed = parse(cls.Setup, setup, what=f"setup of transport {key!r}")
        if cls.needs_plan and plan is None:
            raise ConfigError(f"transport {key!r} reshards: attach it with plan=...", transport=key, rank=self.rank)
        plan = self._adopt_plan(key, plan)
        old = self._attachments.get(key)
        if instance is None:
            if old is not None and type(old.transport) is cls and old.raw_setup == setup:
                instance = old.transport
            else:
                instance = cls.from_setup(parsed)
        if old is not None and old.transport is not instance:
            await old.transport.aclose()
        att = Attachment(key, instance, parsed, plan, False, setup)
        self._attachments[key] = att
        state = self._refit_transport_state(key)
        state["transport"], state["plan"] = instance, plan
        return att

    async def _connect(self, att: Attachment, deadline: Any) -> None:
        await att.transport.connect(self._context(att, deadline=deadline))
        att.connected = True

    def attachment(self, name: str) -> Attachment:
        """The attachment of ``name``; ``ConfigError`` when none."""
        att = self._attachments.get(name)
        if att is None:
            known = ", ".join(sorted(self._attachments)) or "none"
            raise ConfigError(f"transport {name!r} is not attached (attached: {known}); call attach_transport first",
                              transport=name, rank=self.rank)
        return att

    def attached_transports(self) -> list[str]:
        return sorted(self._attachments)

    async def detach_transport(self, name: str) -> None:
        """Close transport ``name`` and forget it (its state dict too). Unknown names are a no-op."""
        att = self._attachments.pop(name, None)
        if att is not None:
            await att.transport.aclose()
        with self._state_lock:
            state = self._transport_state.pop(name, None) or {}
        for group in groups_in(state):
            group.close()

    def transport_version(self, name: str) -> int:
        """The last version this worker sent (trainer) or committed (rollout) over ``name``."""
        if self.ledger is not None:
            return self.ledger.version
        return int(self._peek_state(name).get("version", 0))

    async def refit(self, name: str, /, *, version: int | None = None, refit_timeout_s: float | None = None,
                    **options: Any) -> RefitReport:
        """One refit over attached transport ``name``: this side sends or receives.

        ``options`` are checked against the transport's ``Options`` and reach it as
        ``ctx.options``. ``version``: default the last sent + 1 (trainer) or the last
        committed + 1 (rollout). With ``refit_timeout_s`` a deadline is armed for this
        worker; when it passes the transport and its groups are aborted and this
        raises ``RefitTimeout``. A receiving worker commits through its ledger only on
        success; on failure — or cancellation, which aborts the refit and returns once
        the executor stopped touching the weights — the version stays and touched
        weights are marked torn.
        """
        self._ensure_open()
        att = self.attachment(name)
        timeout = self._check_refit_timeout(refit_timeout_s)
        opts = parse(type(att.transport).Options, options, what=f"options of transport {name!r}")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
            raise ConfigError(f"version must be an int >= 1, got {version!r}")
        state = self._refit_transport_state(name)
        ledger = self.ledger
        if version is None:
            version = (ledger.version if ledger is not None else int(state.get("version", 0))) + 1
        ctx = self._context(att, options=opts)
        aborts = [att.transport.abort, *(g.abort for g in groups_in(state))]
        tx = ledger.transaction(version).open() if ledger is not None else None
        deadline = None
        if timeout is not None:
            deadline = ctx.deadline = process_watchdog().arm(
                timeout, aborts, label=f"{name} {self.role} rank {self.rank}", owner=self)
        moving = False  # connect builds resources and never writes a live byte: untouched until send/receive
        try:
            if not att.connected:
                await self._connect(att, deadline)
            moving = True
            if ctx.role == "send":
                report = await att.transport.send(ctx, version)
            else:
                report = await att.transport.receive(ctx, version)
            if not isinstance(report, RefitReport):
                raise TransportError(f"transport {name!r} returned {type(report).__name__}, not a RefitReport",
                                     transport=name, rank=self.rank)
            if tx is not None:
                tx.commit(report.version, received_bytes=report.bytes, expected_bytes=self._expected_bytes(att))
        except Exception as exc:
            if tx is not None:
                tx.touched = ctx.touched if moving else False
            if isinstance(exc, RefitAborted) and deadline is not None:
                deadline.check()  # fired: a RefitTimeout, not a bare abort
            raise
        except BaseException:  # cancelled (asyncio, anyio, trio): abort, let the executor leave, then mark
            for abort in aborts:
                abort()
            drained = await drain(self._executor, self.timeout_s)
            if tx is not None:
                tx.touched = (ctx.touched if drained else True) if moving else False
            raise
        finally:
            if tx is not None:
                tx.close()  # no commit: the refit failed (a no-op after a commit, refused or not)
            if deadline is not None:
                process_watchdog().disarm(deadline)
        state["version"] = report.version
        self._after_refit(att, ctx, report)
        return report

    def _expected_bytes(self, att: Attachment) -> int | None:
        """Bytes a receiver must land per refit (the ledger's manifest check); None: unknown."""
        return None

    def _after_refit(self, att: Attachment, ctx: TransportContext, report: RefitReport) -> None:
        """Hook after a successful refit (the rollout keeps received kv-scales)."""

    # -- cheap queries (never block, never touch CUDA) -------------------------------
    def is_alive(self) -> bool:
        """True until ``shutdown``; answers from the loop without waiting on a refit."""
        return not self._closed

    def stand_down_refit_watchdog(self) -> int:
        """Disarm this worker's armed refit deadlines without firing; return the count.

        Other workers in the process keep theirs. What bounds a refit after a stand-down:
        its transport's own waits (group timeout ``timeout_s``, ``zmq_timeout_s``) and a
        dead peer's connection error; the controller then rebuilds (``init_collective``
        again and re-attaches) — see README "Embedding in a controller".
        """
        return process_watchdog().stand_down(self)

    def get_zmq_address(self) -> str:
        """The IPC endpoint shared with the colocated peer on the same device.

        Both sides derive it from the device id and ``zmq_pair``, under the private
        runtime dir, so the two processes of a pair meet and other pairs never do.
        """
        return f"ipc://{self.runtime_dir}/policyworker-{self.device_facts.device_id}-{self.zmq_pair}.sock"
