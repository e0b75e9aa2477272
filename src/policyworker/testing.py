"""Test doubles and the transport conformance suite.

* :class:`InMemoryTransport` moves a refit between two transport instances of one
  process through a shared :class:`MemoryHub` — the test double for controllers.
* :func:`check_transport` drives any transport through the contract in
  ``policyworker.transports.base`` and checks the result bit for bit; every built-in
  and third-party transport can run it on itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from dataclasses import dataclass as _dc
from typing import Any

import torch

from .errors import ConfigError, ProtocolError, RefitTimeout, TransportError
from .transports.base import RefitReport, Transport, TransportContext

__all__ = ["InMemoryTransport", "MemoryHub", "TransportPair", "check_transport"]


class MemoryHub:
    """A mailbox of (version → cloned tensors) shared by the two ends of a channel."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._box: dict[int, dict[str, torch.Tensor]] = {}

    def put(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._box[version] = tensors
            self._cond.notify_all()

    def take(self, version: int, timeout_s: float) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while version not in self._box:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RefitTimeout(f"in-memory refit {version} never arrived", transport="memory")
                self._cond.wait(remaining)
            return self._box.pop(version)


@_dc(frozen=True, kw_only=True, slots=True)
class MemorySetup:
    """``hub``: the MemoryHub both ends share (one process); ``timeout_s`` bounds a receive."""

    hub: Any = None
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.hub is not None and not isinstance(self.hub, MemoryHub):
            raise ConfigError(f"hub must be a MemoryHub, got {type(self.hub).__name__}", transport="memory")
        if not 0 < self.timeout_s < float("inf"):
            raise ConfigError(f"timeout_s must be a finite number > 0, got {self.timeout_s!r}", transport="memory")


class InMemoryTransport(Transport):
    """Sends ``ctx.params`` by value to the receiver sharing ``hub``; same layout both sides."""

    name = "memory"
    Setup = MemorySetup

    @classmethod
    def from_setup(cls, setup: MemorySetup) -> InMemoryTransport:
        return cls(setup.hub, timeout_s=setup.timeout_s)

    def __init__(self, hub: MemoryHub | None = None, *, timeout_s: float = 10.0) -> None:
        self.hub = hub if hub is not None else MemoryHub()
        self.timeout_s = timeout_s
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed", transport=self.name)

    async def connect(self, ctx: TransportContext) -> None:
        self._check_open()
        ctx.state["hub"] = self.hub

    async def send(self, ctx: TransportContext, version: int) -> RefitReport:
        self._check_open()
        t0 = time.perf_counter()
        copies = await ctx.blocking(lambda: {k: v.detach().clone() for k, v in ctx.params.items()})
        self.hub.put(version, copies)
        nbytes = sum(t.numel() * t.element_size() for t in copies.values())
        return RefitReport(transport=self.name, role="send", version=version, bytes=nbytes,
                           seconds=time.perf_counter() - t0, buckets=1)

    async def receive(self, ctx: TransportContext, version: int) -> RefitReport:
        self._check_open()
        t0 = time.perf_counter()
        ctx.touched = False
        wait = self.timeout_s if ctx.deadline is None else max(0.0, min(self.timeout_s, ctx.deadline.remaining()))
        incoming = await ctx.blocking(self.hub.take, version, wait)
        missing = set(ctx.params) - set(incoming)
        extra = set(incoming) - set(ctx.params)
        if missing or extra:
            raise ProtocolError(f"refit {version}: missing {sorted(missing)}, unexpected {sorted(extra)}",
                                transport=self.name)
        for name, dst in ctx.params.items():
            src = incoming[name]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ProtocolError(f"refit {version}: {name} is {src.dtype}{list(src.shape)}, "
                                    f"expected {dst.dtype}{list(dst.shape)}", transport=self.name, param=name)
        # Validate everything before touching any destination: nothing half-applied.
        ctx.touched = True
        nbytes = 0
        for name, dst in ctx.params.items():
            dst.copy_(incoming[name])
            nbytes += dst.numel() * dst.element_size()
        return RefitReport(transport=self.name, role="receive", version=version, bytes=nbytes,
                           seconds=time.perf_counter() - t0, buckets=1)

    async def aclose(self) -> None:
        self._closed = True


@dataclass
class TransportPair:
    """What a conformance factory returns: one connected sender and one receiver.

    ``sender_ctx.params`` are the source tensors; ``receiver_ctx.params`` the
    destinations; ``expected(sender_params)`` returns what the receiver must hold
    afterwards (identity for same-layout transports). ``sender_ctx`` and
    ``receiver_ctx`` may live in other processes for real transports; in-process
    factories run both ends on one loop.
    """

    sender: Transport
    sender_ctx: TransportContext
    receiver: Transport
    receiver_ctx: TransportContext
    expected: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] = lambda p: p


async def check_transport(factory: Callable[[], Awaitable[TransportPair]], *, refits: int = 2) -> list[RefitReport]:
    """Run the transport contract against ``factory``'s pair; raise AssertionError on a breach.

    Checks: connect on both ends; ``refits`` refits with weights changed in between,
    each landing bit for bit; reports name the transport, role and version, count
    bytes > 0; a version that was never sent times out with a policyworker error
    rather than hanging (when the receiver supports a deadline); ``aclose`` twice is
    fine and a closed transport refuses to send with ``TransportError``.
    """
    pair = await factory()
    if not isinstance(pair.sender, Transport) or not isinstance(pair.receiver, Transport):
        raise ConfigError("factory must return Transport instances")
    reports: list[RefitReport] = []
    await asyncio.gather(pair.sender.connect(pair.sender_ctx), pair.receiver.connect(pair.receiver_ctx))
    gen = torch.Generator().manual_seed(1234)
    for version in range(1, refits + 1):
        with torch.no_grad():
            for t in pair.sender_ctx.params.values():
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
                else:
                    t.copy_(torch.randint(0, 100, t.shape, generator=gen).to(t.dtype))
        sent, got = await asyncio.gather(
            pair.sender.send(pair.sender_ctx, version), pair.receiver.receive(pair.receiver_ctx, version)
        )
        expected = pair.expected(pair.sender_ctx.params)
        for name, want in expected.items():
            have = pair.receiver_ctx.params[name]
            if not torch.equal(have.cpu(), want.cpu()):
                raise AssertionError(f"refit {version}: {name} differs after receive")
        for rep, role in ((sent, "send"), (got, "receive")):
            if not isinstance(rep, RefitReport):
                raise AssertionError(f"{role} returned {type(rep).__name__}, not RefitReport")
            if rep.transport != pair.sender.name or rep.role != role or rep.version != version:
                raise AssertionError(f"bad report for {role}: {rep}")
            if rep.bytes <= 0 or rep.seconds < 0:
                raise AssertionError(f"bad byte/second counts in {rep}")
        reports += [sent, got]
    await pair.sender.aclose()
    await pair.sender.aclose()
    await pair.receiver.aclose()
    try:
        await pair.sender.send(pair.sender_ctx, refits + 1)
    except TransportError:
        pass
    else:
        raise AssertionError("a closed transport accepted send()")
    return reports


def memory_pair_factory(params: Mapping[str, torch.Tensor], *, device=None) -> Callable[[], Awaitable[TransportPair]]:
    """A conformance factory for :class:`InMemoryTransport` (used by our own tests)."""
    from .device import device_facts

    async def factory() -> TransportPair:
        hub = MemoryHub()
        facts = device_facts("cpu")
        src = {k: v.clone() for k, v in params.items()}
        dst = {k: torch.zeros_like(v) for k, v in params.items()}
        s_ctx = TransportContext(worker=None, role="send", rank=0, device=facts, state={}, params=src)
        r_ctx = TransportContext(worker=None, role="receive", rank=0, device=facts, state={}, params=dst)
        return TransportPair(InMemoryTransport(hub), s_ctx, InMemoryTransport(hub), r_ctx)

    return factory
