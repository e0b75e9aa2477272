"""The in-memory test double: :class:`InMemoryTransport` over a shared :class:`MemoryHub`.

It moves a refit between two transport instances of one process (registered as
``memory``): the test double for controllers and for the worker's road itself.
Same layout on both sides (plan-less); everything it copies runs on the refit
executor, and ``abort()`` cuts a waiting receive short. Each side leaves its
tensors' names, dtypes and shapes on the hub at ``connect``; whichever connects
second compares them with its peer's (``PlanMismatch``), so a mismatched pairing
fails at connect, in either order, without waiting for the peer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policyworker.config import positive_seconds
from policyworker.errors import ConfigError, PlanMismatch, ProtocolError, RefitAborted, RefitTimeout, TransportError
from policyworker.transports.base import Transport, TransportContext, RefitReport
from policyworker.testing.pairs import TransportPair, plain_pair

__all__ = ["InMemoryTransport", "MemoryHub", "memory_pair_factory"]


class MemoryHub:
    """A mailbox of (version → cloned tensors) shared by the two ends of a channel."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._box: dict[int, dict[str, torch.Tensor]] = {}
        self._signatures: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}

    def meet(self, role: str, signature: dict[str, tuple[str, tuple[int, ...]]]):
        """Leave this side's signature; return the peer's (None if it has not connected)."""
        with self._cond:
            self._signatures[role] = signature
            return self._signatures.get("receive" if role == "send" else "send")

    def put(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._box[version] = tensors
            self._cond.notify_all()

    def take(self, version: int, timeout_s: float, aborted: threading.Event | None = None) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while version not in self._box:
                if aborted is not None and aborted.is_set():
                    raise RefitAborted(f"in-memory refit {version} was aborted", transport="memory")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RefitTimeout(f"in-memory refit {version} never arrived", transport="memory")
                self._cond.wait(min(remaining, 0.05))
            return self._box.pop(version)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySetup:
    """``hub``: the MemoryHub both ends share (one process); ``timeout_s`` bounds a receive."""

    hub: Any = None
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.hub is not None and not isinstance(self.hub, MemoryHub):
            raise ConfigError(f"hub must be a MemoryHub, got {type(self.hub).__name__}", transport="memory")
        positive_seconds(self.timeout_s, "timeout_s", optional=False)


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
        self._aborted = threading.Event()

    def abort(self) -> None:
        self._aborted.set()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed", transport=self.name)

    async def connect(self, ctx: TransportContext) -> None:
        self._check_open()
        mine = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in ctx.params.items()}
        theirs = self.hub.meet(ctx.role, mine)
        if theirs is not None and theirs != mine:
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise PlanMismatch(f"the peer's tensors differ from this side's at {diff[:3]} "
                               f"(this side: {[mine.get(k) for k in diff[:3]]}, peer: {[theirs.get(k) for k in diff[:3]]})",
                               transport=self.name, rank=ctx.rank)
        ctx.state["hub"] = self.hub
        self._aborted.clear()

    async def send(self, ctx: TransportContext, version: int) -> RefitReport:
        self._check_open()
        t0 = time.perf_counter()
        copies = await ctx.blocking(lambda: {k: v.detach().clone() for k, v in ctx.params.items()})
        self.hub.put(version, copies)
        nbytes = sum(t.numel() * t.element_size() for t in copies.values())
        return RefitReport(transport=self.name, role="send", version=version, bytes=nbytes,
                           seconds=time.perf_counter() - t0, buckets=1)

    async def receive(self, ctx: TransportContext, version: int) -> RefitReport:
        """Take and validate the whole refit first (live bytes intact), then copy one tensor
        per executor step, checking for an abort between them: an abort mid-copy leaves
        the weights torn, as in any transport that writes in place."""
        self._check_open()
        # An abort belongs to the refit it ended: a cancelled or timed-out receive must
        # not fail the next one (a deadline that fired before this point leaves no wait).
        self._aborted.clear()
        ctx.touched = False
        t0 = time.perf_counter()
        wait = self.timeout_s if ctx.deadline is None else max(0.0, min(self.timeout_s, ctx.deadline.remaining()))
        incoming = await ctx.blocking(self._take, ctx, version, wait)
        ctx.touched = True  # everything validated; from here on the live bytes change
        nbytes = 0
        for name, dst in ctx.params.items():
            if self._aborted.is_set():
                raise RefitAborted(f"in-memory refit {version} was aborted mid-copy", transport=self.name)
            await ctx.blocking(dst.copy_, incoming[name])
            nbytes += dst.numel() * dst.element_size()
        return RefitReport(transport=self.name, role="receive", version=version, bytes=nbytes,
                           seconds=time.perf_counter() - t0, buckets=len(ctx.params))

    def _take(self, ctx: TransportContext, version: int, wait: float) -> dict[str, torch.Tensor]:
        incoming = self.hub.take(version, wait, self._aborted)
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
        return incoming

    async def aclose(self) -> None:
        self._closed = True


def memory_pair_factory(params: Mapping[str, torch.Tensor]) -> Callable[[], Awaitable[TransportPair]]:
    """A conformance factory for :class:`InMemoryTransport`: CPU workers over copies of
    ``params``, a fresh hub per pair."""

    async def factory() -> TransportPair:
        return plain_pair("memory", params, setup={"hub": MemoryHub()})

    return factory
