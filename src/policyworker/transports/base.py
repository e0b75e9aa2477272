"""The transport contract: how one refit's bytes get from trainers to rollouts.

A transport is a small object with four coroutines. One instance lives on each side
of a refit (a trainer rank sends, a rollout rank receives); the worker owns it and
calls it in this order::

    await t.connect(ctx)                 # once, and again after a failure (re-entrant)
    report = await t.send(ctx, version)  # trainer side, once per refit   } every refit
    report = await t.receive(ctx, v)     # rollout side, once per refit   }
    await t.aclose()                     # once; idempotent

Contract, for implementers:

* ``connect`` builds what lives across refits (groups, sockets, staging buffers,
  exported handles) and keeps it in ``ctx.state`` — the worker's per-transport dict —
  not on the worker. It must verify the peers agree on the plan (``PlanMismatch``) so a
  bad pairing fails here, never mid-refit. Calling it again replaces old resources.
* ``send`` / ``receive`` move exactly one refit of ``version``. They are awaited on the
  worker's event loop, which they must never block: anything that waits on a peer or
  moves tensors goes through ``await ctx.blocking(fn, ...)``, which runs it on the
  worker's single refit executor thread (refits are serial). They must
  finish or raise before ``ctx.deadline`` (when set) and check ``ctx.deadline.fired``
  after every wait an abort can cut short. A receiver never exposes a partly applied
  refit: on failure it raises and leaves the old version (or marks it torn).
* Errors: raise only ``policyworker.errors`` types; translate zmq/gloo/nccl/http errors
  here, at the boundary (``PeerLost`` when a peer went away, ``RefitTimeout`` /
  ``RefitAborted`` on deadlines and aborts, ``ProtocolError`` on bad messages).
* Deadlock hazard: both sides must issue matching operations in the same order; a
  transport documents its order in its module docstring.
* No pickle on sockets; only ``policyworker.wire`` messages and raw tensor bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgspec

if TYPE_CHECKING:
    import torch

    from ..device import DeviceFacts
    from ..watchdog import Deadline

__all__ = ["RefitReport", "Transport", "TransportContext"]

T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class TransportContext:
    """Everything a transport may use. New fields get defaults, so plugins never break.

    ``params`` are this rank's local tensors: the sender's sources (its shards in the
    training layout) or the receiver's destinations (its shards in the generation
    layout, fused params included). ``plan`` is the ``ReshardPlan`` when the transport
    reshards. ``role`` is ``"send"`` or ``"receive"``.
    """

    worker: Any
    role: str
    rank: int
    device: DeviceFacts
    state: dict[str, Any]
    params: Mapping[str, torch.Tensor]
    plan: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)
    deadline: Deadline | None = None
    executor: Executor | None = None

    async def blocking(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the refit executor thread (or a fresh thread when none is set)."""
        from .._aio import run_in_executor

        return await run_in_executor(self.executor, fn, *args, **kwargs)


class RefitReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one side of one refit did. ``bytes`` counts payload bytes moved by this rank."""

    transport: str
    role: str
    version: int
    bytes: int
    seconds: float
    buckets: int = 0
    peak_extra_bytes: int = 0
    notes: tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Transport:
    """Base class of every transport; see the module docstring for the contract."""

    name: ClassVar[str] = ""

    async def connect(self, ctx: TransportContext) -> None:
        """Build groups, sockets and buffers that live across refits; check the plan."""
        raise NotImplementedError

    async def send(self, ctx: TransportContext, version: int) -> RefitReport:
        """Trainer side: move refit ``version`` out of ``ctx.params``."""
        raise NotImplementedError

    async def receive(self, ctx: TransportContext, version: int) -> RefitReport:
        """Rollout side: land refit ``version`` in ``ctx.params`` (or raise, leaving v-1)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release everything ``connect`` built. Idempotent."""
