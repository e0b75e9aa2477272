"""The transport conformance suite: :func:`check_transport` drives any transport through the contract.

Every built-in and third-party transport can run it on itself (trio's
``check_two_way_stream`` is the model). The suite owns a
:class:`~policyworker.ledger.WeightLedger` for the receiver, exactly as a worker
does, so it checks what a worker relies on:

1. ``connect`` on both ends, then ``refits`` refits with the sender's tensors changed
   in between: each lands bit for bit (``expected``), reports name the transport,
   role and version and count bytes > 0, and the ledger commits each version;
2. a version that is never sent: the receiver, under a deadline of ``deadline_s``
   whose firing calls ``abort()``, raises a policyworker error within the deadline
   + 3 s, commits nothing, and does not claim to have touched the weights;
3. an abort while the receiver waits mid-refit (``abort()`` from another thread):
   ``RefitAborted`` (or ``RefitTimeout``) promptly, nothing committed;
4. a refit cut short after the receiver said it touched live bytes leaves the
   ledger torn (checked when the suite catches the receiver between its first
   write and its end; ``ConformanceReport.torn_checked`` says whether it did);
5. a mismatched peer (``mismatched_factory``, optional) fails at ``connect`` with
   ``PlanMismatch`` / ``ConfigError`` on at least one side, within 60 s;
6. ``aclose`` twice is fine and a closed transport refuses ``send`` with
   ``TransportError``.

``factory`` is called once for step 1 and once more for each of steps 2–4 (a
transport whose groups died in an abort needs fresh ones): for multi-process
transports it may hand out pairs whose peers live in other processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError, PlanMismatch, PolicyWorkerError, RefitAborted, TransportError
from ..ledger import WeightLedger
from ..transports.base import RefitReport, Transport, TransportContext
from ..watchdog import process_watchdog

__all__ = ["ConformanceReport", "TransportPair", "check_transport"]


@dataclass
class TransportPair:
    """What a conformance factory returns: one sender and one receiver, not yet connected.

    ``sender_ctx.params`` are the source tensors; ``receiver_ctx.params`` the
    destinations; ``expected(sender_params)`` returns what the receiver must hold
    afterwards (identity for same-layout transports). ``close`` (optional) releases
    what the factory built (groups, peers) after the suite is done with the pair.
    """

    sender: Transport
    sender_ctx: TransportContext
    receiver: Transport
    receiver_ctx: TransportContext
    expected: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] = lambda p: p
    close: Callable[[], Awaitable[None]] | None = None


@dataclass
class ConformanceReport:
    """What :func:`check_transport` ran and saw."""

    reports: list[RefitReport] = field(default_factory=list)
    timeout_seconds: float = 0.0
    abort_seconds: float = 0.0
    torn_checked: bool = False


def _fail(msg: str) -> None:
    raise AssertionError(f"check_transport: {msg}")


def _perturb(params: Mapping[str, torch.Tensor], gen: torch.Generator) -> None:
    with torch.no_grad():
        for t in params.values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
            else:
                t.copy_(torch.randint(0, 100, t.shape, generator=gen).to(t.dtype))


async def _bounded(aw: Awaitable, seconds: float, what: str):
    try:
        return await asyncio.wait_for(aw, seconds)
    except asyncio.TimeoutError:
        _fail(f"{what} did not finish within {seconds:.0f} s")


async def _connected(factory) -> TransportPair:
    """A fresh pair from ``factory``, both ends connected (bounded)."""
    pair = await factory()
    if not isinstance(pair.sender, Transport) or not isinstance(pair.receiver, Transport):
        raise ConfigError("factory must return Transport instances")
    await _bounded(asyncio.gather(pair.sender.connect(pair.sender_ctx), pair.receiver.connect(pair.receiver_ctx)),
                   60, "connect")
    return pair


async def _close(pair: TransportPair) -> None:
    for t in (pair.sender, pair.receiver):
        await t.aclose()
    if pair.close is not None:
        await pair.close()


async def _refits(pair: TransportPair, ledger: WeightLedger, n: int, gen: torch.Generator) -> list[RefitReport]:
    out = []
    for _ in range(n):
        version = ledger.version + 1
        _perturb(pair.sender_ctx.params, gen)
        ledger.begin(version)
        try:
            sent, got = await _bounded(asyncio.gather(pair.sender.send(pair.sender_ctx, version),
                                                      pair.receiver.receive(pair.receiver_ctx, version)),
                                       120, f"refit {version}")
        except BaseException:
            ledger.fail(pair.receiver_ctx.touched)
            raise
        ledger.commit(got.version)
        for name, want in pair.expected(pair.sender_ctx.params).items():
            if not torch.equal(pair.receiver_ctx.params[name].cpu(), want.cpu()):
                _fail(f"refit {version}: {name} differs after receive")
        for rep, role in ((sent, "send"), (got, "receive")):
            if not isinstance(rep, RefitReport):
                _fail(f"{role} returned {type(rep).__name__}, not RefitReport")
            if rep.transport != pair.sender.name or rep.role != role or rep.version != version:
                _fail(f"bad report for {role} of refit {version}: {rep}")
            if rep.bytes <= 0 or rep.seconds < 0:
                _fail(f"bad byte/second counts in {rep}")
        out += [sent, got]
    return out


async def check_transport(
    factory: Callable[[], Awaitable[TransportPair]],
    *,
    refits: int = 3,
    deadline_s: float = 1.0,
    mismatched_factory: Callable[[], Awaitable[TransportPair]] | None = None,
) -> ConformanceReport:
    """Run the contract against ``factory``'s pairs (see the module docstring).

    Raises ``AssertionError`` naming the first breach; returns what it saw.
    """
    result = ConformanceReport()
    gen = torch.Generator().manual_seed(1234)

    # 1. several versions, bit for bit
    pair = await _connected(factory)
    ledger = WeightLedger(what="conformance receiver")
    result.reports = await _refits(pair, ledger, refits, gen)
    await pair.sender.aclose()
    await pair.sender.aclose()  # idempotent
    try:
        await pair.sender.send(pair.sender_ctx, ledger.version + 1)
    except TransportError:
        pass
    else:
        _fail("a closed transport accepted send()")
    await _close(pair)

    # 2. a version never sent: a policyworker error inside the deadline, nothing committed
    pair = await _connected(factory)
    ledger = WeightLedger(what="conformance receiver")
    ctx = pair.receiver_ctx
    deadline = ctx.deadline = process_watchdog().arm(deadline_s, [pair.receiver.abort], label="conformance")
    ledger.begin(1)
    t0 = time.monotonic()
    try:
        await _bounded(pair.receiver.receive(ctx, 1), deadline_s + 30, "a receive of a never-sent version")
    except PolicyWorkerError:
        ledger.fail(ctx.touched)
    else:
        _fail("a receive of a version that was never sent returned")
    finally:
        process_watchdog().disarm(deadline)
        ctx.deadline = None
    result.timeout_seconds = time.monotonic() - t0
    if result.timeout_seconds > deadline_s + 3:
        _fail(f"the never-sent version failed after {result.timeout_seconds:.1f} s, deadline {deadline_s} s")
    if ledger.version != 0 or ctx.touched:
        _fail("a receive that got nothing committed or claimed to touch the weights")
    await _close(pair)

    # 3. an abort mid-wait: RefitAborted promptly
    pair = await _connected(factory)
    ctx = pair.receiver_ctx
    task = asyncio.ensure_future(pair.receiver.receive(ctx, 1))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    pair.receiver.abort()
    try:
        await _bounded(task, 30, "an aborted receive")
    except RefitAborted:
        pass
    except PolicyWorkerError as exc:
        _fail(f"an aborted receive raised {type(exc).__name__}, not RefitAborted: {exc}")
    else:
        _fail("an aborted receive returned")
    result.abort_seconds = time.monotonic() - t0
    if result.abort_seconds > 5:
        _fail(f"an abort took {result.abort_seconds:.1f} s to cut the receive short")
    await _close(pair)

    # 4. cut short after the first touched byte: torn
    pair = await _connected(factory)
    ledger = WeightLedger(what="conformance receiver")
    ctx = pair.receiver_ctx
    ledger.begin(1)
    send = asyncio.ensure_future(pair.sender.send(pair.sender_ctx, 1))
    recv = asyncio.ensure_future(pair.receiver.receive(ctx, 1))
    while not recv.done() and not ctx.touched:
        await asyncio.sleep(0)
    if not recv.done():
        pair.receiver.abort()
        pair.sender.abort()
        result.torn_checked = True
    for task, what in ((recv, "receive"), (send, "send")):
        try:
            rep = await _bounded(task, 30, f"the cut-short {what}")
            if what == "receive":
                ledger.commit(rep.version)
        except PolicyWorkerError:
            if what == "receive":
                ledger.fail(ctx.touched)
    if result.torn_checked and ledger.version == 0 and not ledger.torn:
        _fail("a receive cut short after it touched live bytes left the weights not torn")
    await _close(pair)

    # 5. a mismatched peer fails at connect
    if mismatched_factory is not None:
        pair = await mismatched_factory()
        outcome = await _bounded(asyncio.gather(pair.sender.connect(pair.sender_ctx),
                                                pair.receiver.connect(pair.receiver_ctx), return_exceptions=True),
                                 60, "connect of a mismatched pair")
        if not any(isinstance(o, (PlanMismatch, ConfigError)) for o in outcome):
            _fail(f"a mismatched pair connected: {outcome}")
        bad = [o for o in outcome if isinstance(o, BaseException) and not isinstance(o, PolicyWorkerError)]
        if bad:
            _fail(f"a mismatched connect raised a foreign error: {bad[0]!r}")
        await _close(pair)
    return result
