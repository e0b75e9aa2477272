"""The transport contract: how one refit's bytes get from trainers to rollouts.

A transport is a small object with four coroutines. One instance lives on each side
of a refit (a trainer rank sends, a rollout rank receives); the worker owns it and
drives it, whatever its name, through one road::

    await worker.attach_transport(name, **setup)   # registry → Setup → from_setup → connect
    report = await worker.refit(name, **options)   # deadline → send | receive → ledger commit
    await worker.detach_transport(name)            # aclose

and the transport sees these calls, in this order::

    await t.connect(ctx)                 # once, and again after a failure (re-entrant)
    report = await t.send(ctx, version)  # trainer side, once per refit   } every refit
    report = await t.receive(ctx, v)     # rollout side, once per refit   }
    await t.aclose()                     # once; idempotent

Declaring what it takes, for implementers:

* ``Setup`` — a frozen, kw-only dataclass of what ``attach_transport(name, **setup)``
  accepts: wiring (groups, endpoints, directories) and the options fixed for the
  attachment (bucket sizes, checksums). The worker checks the keys and simple types
  (:func:`policyworker.config.parse`) and ``__post_init__`` may check values; both
  raise ``ConfigError`` at attach time. ``from_setup(setup)`` builds the instance
  (default: ``cls()``); an instance handed to ``attach_transport`` keeps the options
  it was constructed with and still receives the parsed ``Setup`` as ``ctx.setup``.
* ``Options`` — a frozen, kw-only dataclass of what ``refit(name, **options)`` accepts
  per refit (kv-scales, an engine handle); parsed the same way, as ``ctx.options``.
* ``needs_plan`` — True when the transport reshards and needs ``ctx.plan`` (a
  ``ReshardPlan``); the worker then refuses to attach without one. A plan-less
  transport moves ``ctx.params`` by name: the sender's local tensors and the
  receiver's destinations must share names, shapes and dtypes.

Contract of the four calls:

* ``connect`` builds what lives across refits (groups, sockets, staging buffers,
  exported handles) and keeps it in ``ctx.state`` — the worker's per-transport dict —
  not on the worker. It must verify the peers agree (plan hash, options:
  ``PlanMismatch`` / ``ConfigError``) so a bad pairing fails here, never mid-refit.
  Calling it again replaces old resources (recovery).
* ``send`` / ``receive`` move exactly one refit. ``version`` is the version the
  trainer announces (its last sent + 1) and, on the receiver, the version expected
  next (last committed + 1). A transport whose peers announce versions (headers) may
  land another, higher version and says so in its report: the worker's ledger commits
  ``report.version`` and refuses one that does not advance.
* They are awaited on the worker's event loop, which they must never block: anything
  that waits on a peer or moves tensors goes through ``await ctx.blocking(fn, ...)``,
  which runs it on the worker's single refit executor thread (refits are serial).
  They must finish or raise before ``ctx.deadline`` (when set) and check
  ``ctx.deadline.fired`` after every wait an abort can cut short. When the deadline
  fires the worker calls ``abort()`` on the transport (from another thread): cut the
  current wait short and raise ``RefitAborted``.
* A receiver never commits anything itself; the worker's ledger does, after
  ``receive`` returned. Before it first writes a live destination byte it sets
  ``ctx.touched = True``; a receiver that stages everything first and writes only at
  the end sets ``ctx.touched = False`` at the start and True just before it writes.
  A failed refit with ``ctx.touched`` not False leaves the rollout *torn* (it refuses
  to serve until a refit commits): a transport that never says is assumed to touch.
* Errors: raise only ``policyworker.errors`` types; translate zmq/gloo/nccl/http
  errors here, at the boundary (``PeerLost`` when a peer went away, ``RefitTimeout``
  / ``RefitAborted`` on deadlines and aborts, ``ProtocolError`` on bad messages).
* Deadlock hazard: both sides must issue matching operations in the same order; a
  transport documents its order in its module docstring.
* No pickle on sockets; only ``policyworker.wire``-style typed messages and raw bytes.
* On-demand destinations (``lands_on_demand = True``; only ``nccl_reshard`` today): when
  ``ctx.landing`` is set, a destination on the ``meta`` device is a placeholder (its
  shape and dtype only). The transport calls ``ctx.landing.open(name)`` for the real
  tensor just before it posts the first message that writes ``name``, and
  ``ctx.landing.landed(name)`` for *every* destination once all its bytes are in place
  (setting ``ctx.touched = True`` first: the consumer may install it live). After a
  failure it stops calling ``landed``. A consumer (the vLLM backend's ``staging="none"``)
  post-processes a layer as soon as its last tensor landed and drops its landing
  memory, so no full set is ever held. A transport that cannot do this leaves the flag
  False and the worker refuses a landing before a byte moves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import msgspec

from policyworker.config import EmptyOptions, EmptySetup

if TYPE_CHECKING:
    import torch

    from policyworker.runtime.device import DeviceFacts
    from policyworker.runtime.watchdog import Deadline

__all__ = ["Landing", "RefitReport", "Transport", "TransportContext"]

T = TypeVar("T")


class Landing(Protocol):
    """Receive destinations made on demand and handed back when complete (``ctx.landing``)."""

    def open(self, name: str) -> torch.Tensor:
        """The tensor to write ``name``'s bytes into (its placeholder's shape and dtype).
        It must not be served before :meth:`landed`: bytes written into it do not count
        as touching the served weights (a refit cut short before any hand-over, with no
        other destination written, leaves the rollout untorn)."""
        ...

    def landed(self, name: str) -> None:
        """Every byte of destination ``name`` is in place (called for every destination)."""
        ...


@dataclass(kw_only=True, slots=True)
class TransportContext:
    """Everything a transport may use. New fields get defaults, so plugins never break.

    ``params`` are this rank's local tensors: the sender's sources (its shards in the
    training layout, or its full tensors by name for a plan-less transport) or the
    receiver's destinations (its shards in the generation layout, fused params
    included). ``plan`` is the ``ReshardPlan`` when the transport reshards. ``role``
    is ``"send"`` or ``"receive"``. ``setup`` / ``options`` are the parsed ``Setup``
    and ``Options`` of the transport. ``update_group`` is the worker's update group
    (``init_collective``) when it has one; ``world_size`` the size of this side's world.
    """

    worker: Any
    role: str
    rank: int
    device: DeviceFacts
    state: dict[str, Any]
    params: Mapping[str, torch.Tensor]
    plan: Any = None
    setup: Any = None
    options: Any = None
    deadline: Deadline | None = None
    executor: Executor | None = None
    update_group: Any = None
    world_size: int = 1
    #: Receiver: None = unknown (assumed touched on failure), False = live bytes intact,
    #: True = live bytes were (possibly) overwritten.
    touched: bool | None = None
    #: Receiver on CUDA: a ``torch.cuda.Event`` recorded on the transport's stream after
    #: its last write; the received bytes are in place once it completed. The worker
    #: makes the stream that reads the weights wait on it (never a device synchronize).
    #: None: the bytes were in place when the transport returned.
    ready: Any = None
    #: Receiver: destinations made on demand (:class:`Landing`; see the module docstring),
    #: for the ``meta``-device placeholders in ``params``. None: every destination is real.
    landing: Landing | None = None

    async def blocking(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the refit executor thread (or a fresh thread when none is set)."""
        from policyworker.runtime._aio import run_in_executor

        return await run_in_executor(self.executor, fn, *args, **kwargs)

    def option(self, key: str, default: Any = None) -> Any:
        """``options.key`` (a dataclass or a mapping), else ``default``."""
        opts = self.options
        if opts is None:
            return default
        if isinstance(opts, Mapping):
            return opts.get(key, default)
        return getattr(opts, key, default)


class RefitReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one side of one refit did. ``bytes`` counts payload bytes moved by this rank.

    ``wire_bytes``: what crossed the wire when it differs from ``bytes`` (a delta refit
    lands and verifies ``bytes`` but moves only the changed elements); ``shadow_bytes``:
    memory the sender keeps across refits to know what changed. ``kv_scales``: the
    FP8 kv-cache scales (name → float) trainer rank 0 sent with this refit, as every
    rank of it received them (None: none were sent). ``base_bytes``: of ``bytes``, those
    of a LoRA adapter's base model, sent along with the adapter once to an engine that
    held another base (``seconds`` is then the whole refit's, base and adapter).
    """

    transport: str
    role: str
    version: int
    bytes: int
    seconds: float
    buckets: int = 0
    peak_extra_bytes: int = 0
    notes: tuple[str, ...] = ()
    wire_bytes: int | None = None
    shadow_bytes: int = 0
    kv_scales: dict[str, float] | None = None
    base_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Transport:
    """Base class of every transport; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    Setup: ClassVar[type] = EmptySetup
    Options: ClassVar[type] = EmptyOptions
    needs_plan: ClassVar[bool] = False
    #: Whether the transport honours ``ctx.landing`` (on-demand destinations).
    lands_on_demand: ClassVar[bool] = False

    @classmethod
    def from_setup(cls, setup: Any) -> Transport:
        """The instance ``attach_transport`` uses for this ``Setup`` (default: ``cls()``)."""
        return cls()

    async def connect(self, ctx: TransportContext) -> None:
        """Build groups, sockets and buffers that live across refits; check the peers agree."""
        raise NotImplementedError

    async def send(self, ctx: TransportContext, version: int) -> RefitReport:
        """Trainer side: move refit ``version`` out of ``ctx.params``."""
        raise NotImplementedError

    async def receive(self, ctx: TransportContext, version: int) -> RefitReport:
        """Rollout side: land a refit in ``ctx.params`` (or raise; never commit)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Cut the current wait short (any thread); the refit then raises ``RefitAborted``.

        Default: nothing — a transport whose waits are bounded by ``ctx.deadline`` alone
        needs no more (groups in ``ctx.state`` are aborted by the worker).
        """

    async def aclose(self) -> None:
        """Release everything ``connect`` built. Idempotent."""
