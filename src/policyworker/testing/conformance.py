"""The transport conformance suite: :func:`check_transport` drives a transport through real workers.

Every built-in and third-party transport can run it on itself (trio's
``check_two_way_stream`` is the model; httpx's ``MockTransport`` runs through the
real ``Client``, and so do these pairs: a trainer-side worker and a ``RolloutWorker``,
``attach_transport`` → ``refit`` → the rollout's ledger). It runs under any anyio
backend (asyncio, trio). What it checks, each on a fresh pair from ``factory``:

1. **refits**: ``refits`` refits with the sender's tensors changed in between: each
   commits on the receiver (its ``weight_version`` is the report's version), lands
   bit for bit (``expected``), reports name the transport, role and version and count
   bytes > 0; a receive that changed live bytes must not have left ``ctx.touched``
   False (the transport's word is checked against the bytes). Then a closed
   transport (``aclose`` twice) refuses the next refit with ``TransportError``.
2. **never sent**: a receive of a version nobody sends, under a deadline of
   ``deadline_s``, raises a policyworker error within the deadline + 3 s, commits
   nothing, and is torn exactly when a live byte changed (none should: nothing came).
3. **abort mid-wait**: ``abort()`` on the receiving transport while it waits:
   ``RefitAborted`` within 5 s, nothing committed, torn exactly when a byte changed.
4. **cut short**: after a committed refit, the next one is cut before its receive's
   blocking step ``k`` (every ``ctx.blocking`` call is a step; up to ``cuts`` values
   of ``k`` spread over the steps a receive took in 1). Deterministic: the step does
   not run, the transport is aborted, the step raises ``RefitAborted``. The refit
   fails with a policyworker error (or, if the transport finishes regardless, commits
   bit for bit); on failure the version stays and **if any live byte changed the
   weights are torn** — judged by comparing bytes before and after, not by the flag.
5. **mismatched peer** (mandatory; no extra factory): the receiver of a fresh pair
   expects the same tensors in another dtype of the same element size (its
   destinations, or its ``plan=`` rebuilt so); attaching must fail with
   ``PlanMismatch`` / ``ConfigError`` on at least one side within 60 s, and no side
   may raise a foreign error.

Raises ``AssertionError`` naming the first breach; returns a :class:`ConformanceReport`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from policyworker.errors import ConfigError, PlanMismatch, PolicyWorkerError, RefitAborted, TransportError
from policyworker.transports.base import RefitReport, Transport
from policyworker.testing.pairs import TransportPair
from policyworker.testing.probes import ReceiveRecorder, SteppedExecutor, changed, mismatched_dtype, mismatched_plan, snapshot

__all__ = ["ConformanceReport", "TransportPair", "check_transport"]

_GRACE_S = 3.0
_SLOW_S = 60.0


@dataclass
class ConformanceReport:
    """What :func:`check_transport` ran and saw.

    ``receive_steps``: blocking steps one receive took (the most over the refits of 1).
    ``cuts``: per cut of 4, ``{"before_step", "failed", "changed", "torn"}``.
    ``torn_checked``: some cut failed after live bytes had changed (so the torn rule was
    exercised on written bytes, not only on untouched ones).
    """

    reports: list[RefitReport] = field(default_factory=list)
    timeout_seconds: float = 0.0
    abort_seconds: float = 0.0
    receive_steps: int = 0
    cuts: list[dict[str, Any]] = field(default_factory=list)
    torn_checked: bool = False


def _fail(msg: str) -> None:
    raise AssertionError(f"check_transport: {msg}")


def _perturb(params, gen: torch.Generator) -> None:
    with torch.no_grad():
        for t in params.values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
            else:
                t.copy_(torch.randint(0, 100, t.shape, generator=gen).to(t.dtype))


class _Outcome:
    def __init__(self) -> None:
        self.value: Any = None
        self.error: Exception | None = None
        self.done = False


async def _run(fn: Callable[[], Awaitable[Any]], out: _Outcome) -> None:
    try:
        out.value = await fn()
    except Exception as exc:  # recorded; the caller judges every outcome
        out.error = exc
    finally:
        out.done = True


async def _both(a: Callable[[], Awaitable[Any]], b: Callable[[], Awaitable[Any]], seconds: float,
                what: str) -> tuple[_Outcome, _Outcome]:
    """Run ``a`` and ``b`` concurrently; their outcomes (errors included), bounded."""
    oa, ob = _Outcome(), _Outcome()
    with anyio.move_on_after(seconds) as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_run, a, oa)
            tg.start_soon(_run, b, ob)
    if scope.cancelled_caught:
        _fail(f"{what} did not finish within {seconds:.0f} s")
    return oa, ob


class _Live:
    """A pair from the factory, attached, with the suite's probes on its receiver."""

    def __init__(self, pair: TransportPair) -> None:
        self.pair = pair
        self.sender = pair.sender
        self.receiver = pair.receiver
        self.stepper = SteppedExecutor(self.receiver._executor)
        self.receiver._executor = self.stepper
        self.name = ""
        self.recorder: ReceiveRecorder | None = None

    def transport(self, side: Any) -> Transport:
        return side.attachment(self.name).transport

    async def attach(self, receiver_setup: dict[str, Any] | None = None) -> tuple[_Outcome, _Outcome]:
        pair = self.pair
        s_inst, r_inst = pair.instance(), pair.instance()
        self.name = s_inst if isinstance(s_inst, str) else type(s_inst).name
        r_setup = dict(pair.receiver_setup if receiver_setup is None else receiver_setup)
        return await _both(lambda: self.sender.attach_transport(s_inst, **pair.sender_setup),
                           lambda: self.receiver.attach_transport(r_inst, **r_setup), _SLOW_S, "attach")

    async def close(self) -> None:
        with anyio.move_on_after(_SLOW_S, shield=True):
            for worker in (self.sender, self.receiver):
                await worker.shutdown()
            if self.pair.close is not None:
                await self.pair.close()


async def _open(factory: Callable[[], Awaitable[TransportPair]]) -> _Live:
    pair = await factory()
    if not isinstance(pair, TransportPair):
        raise ConfigError(f"a conformance factory must return a TransportPair, got {type(pair).__name__}")
    if getattr(pair.sender, "transport_role", None) != "send" or getattr(pair.receiver, "ledger", None) is None:
        raise ConfigError("TransportPair needs a trainer-side worker as sender and a RolloutWorker as receiver")
    live = _Live(pair)
    sa, ra = await live.attach()
    for out, side in ((sa, "sender"), (ra, "receiver")):
        if out.error is not None:
            await live.close()
            _fail(f"the {side} could not attach a matched pair: {out.error!r}")
    live.recorder = ReceiveRecorder(live.transport(live.receiver))
    return live


def _check_torn(live: _Live, before, what: str, *, exact: bool) -> list[str]:
    """After a failed refit: torn if a live byte changed (``exact``: and only then)."""
    diff = changed(before, live.receiver.params)
    torn = live.receiver.torn
    if diff and not torn:
        said = live.recorder.last[1] if live.recorder and live.recorder.last else "?"
        _fail(f"{what}: live bytes of {diff[:3]} changed but the weights are not torn "
              f"(the transport left ctx.touched = {said}); judge by bytes, set ctx.touched before writing")
    if exact and torn and not diff:
        _fail(f"{what}: no live byte changed but the weights are torn: a receive that wrote nothing must "
              "leave ctx.touched False")
    return diff


async def _refit(live: _Live, gen: torch.Generator, timeout_s: float) -> tuple[RefitReport, RefitReport, int]:
    """One refit through both workers' road; every check of step 1 on it."""
    pair, r = live.pair, live.receiver
    _perturb(pair.sources(), gen)
    before, version = snapshot(r.params), r.weight_version + 1
    live.stepper.arm()
    so, ro = await _both(lambda: live.sender.refit(live.name, refit_timeout_s=timeout_s),
                         lambda: r.refit(live.name, refit_timeout_s=timeout_s), timeout_s + 30, f"refit {version}")
    live.stepper.disarm()
    for out, side in ((so, "send"), (ro, "receive")):
        if out.error is not None:
            _fail(f"refit {version}: {side} failed: {out.error!r}")
    sent, got = so.value, ro.value
    for rep, role in ((sent, "send"), (got, "receive")):
        if not isinstance(rep, RefitReport):
            _fail(f"{role} returned {type(rep).__name__}, not RefitReport")
        if rep.transport != live.name or rep.role != role or rep.version != version:
            _fail(f"bad report for {role} of refit {version}: {rep}")
        if rep.bytes <= 0 or rep.seconds < 0:
            _fail(f"bad byte/second counts in {rep}")
    if r.weight_version != version or r.torn:
        _fail(f"refit {version}: the receiver holds version {r.weight_version} (torn: {r.torn})")
    for name, want in pair.expected(pair.sources()).items():
        if not torch.equal(r.weights()[name].detach().cpu(), want.detach().cpu()):
            _fail(f"refit {version}: {name} differs after receive")
    if changed(before, r.params) and live.recorder.last == (True, False):
        _fail(f"refit {version}: the receive changed live bytes but left ctx.touched = False "
              "(a failure at that point would have served torn weights as intact)")
    return sent, got, live.stepper.steps


async def check_transport(
    factory: Callable[[], Awaitable[TransportPair]],
    *,
    refits: int = 3,
    deadline_s: float = 1.0,
    cuts: int = 3,
) -> ConformanceReport:
    """Run the contract against ``factory``'s pairs (see the module docstring).

    ``factory``: an async callable returning a fresh :class:`TransportPair` each call
    (the suite uses several: a transport whose groups died in an abort needs new ones);
    the suite attaches, refits and shuts the workers down itself.
    """
    if not callable(factory):
        raise ConfigError("check_transport needs a factory: an async callable returning a TransportPair")
    result = ConformanceReport()
    gen = torch.Generator().manual_seed(1234)

    # 1. refits through the road, bit for bit; then a closed transport refuses to send
    live = await _open(factory)
    try:
        for _ in range(refits):
            sent, got, steps = await _refit(live, gen, _SLOW_S)
            result.reports += [sent, got]
            result.receive_steps = max(result.receive_steps, steps)
        t = live.transport(live.sender)
        await t.aclose()
        await t.aclose()  # idempotent
        try:
            await live.sender.refit(live.name, refit_timeout_s=deadline_s + _GRACE_S)
        except TransportError:
            pass
        except PolicyWorkerError as exc:
            _fail(f"a closed transport refused send with {type(exc).__name__}, not TransportError: {exc}")
        else:
            _fail("a closed transport accepted send()")
    finally:
        await live.close()

    # 2. a version never sent: a policyworker error inside the deadline, nothing committed
    live = await _open(factory)
    try:
        before = snapshot(live.receiver.params)
        t0 = time.monotonic()
        with anyio.move_on_after(deadline_s + 30) as scope:
            try:
                await live.receiver.refit(live.name, refit_timeout_s=deadline_s)
            except PolicyWorkerError:
                pass
            else:
                _fail("a receive of a version that was never sent returned")
        if scope.cancelled_caught:
            _fail(f"a receive of a never-sent version ignored its {deadline_s} s deadline for 30 s more")
        result.timeout_seconds = time.monotonic() - t0
        if result.timeout_seconds > deadline_s + _GRACE_S:
            _fail(f"the never-sent version failed after {result.timeout_seconds:.1f} s, deadline {deadline_s} s")
        if live.receiver.weight_version != 0:
            _fail("a receive that got nothing committed a version")
        _check_torn(live, before, "a never-sent version", exact=True)
    finally:
        await live.close()

    # 3. an abort while the receiver waits: RefitAborted promptly
    live = await _open(factory)
    try:
        before = snapshot(live.receiver.params)
        out = _Outcome()
        with anyio.move_on_after(_SLOW_S) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_run, lambda: live.receiver.refit(live.name), out)
                await anyio.sleep(0.2)
                t0 = time.monotonic()
                live.transport(live.receiver).abort()
        if scope.cancelled_caught:
            _fail(f"an aborted receive did not return within {_SLOW_S:.0f} s")
        result.abort_seconds = time.monotonic() - t0
        if out.error is None:
            _fail("an aborted receive returned")
        if not isinstance(out.error, RefitAborted):
            _fail(f"an aborted receive raised {type(out.error).__name__}, not RefitAborted: {out.error}")
        if result.abort_seconds > 5:
            _fail(f"an abort took {result.abort_seconds:.1f} s to cut the receive short")
        if live.receiver.weight_version != 0:
            _fail("an aborted receive committed a version")
        _check_torn(live, before, "an aborted wait", exact=True)
    finally:
        await live.close()

    # 4. cut short before each of several blocking steps: torn iff live bytes changed
    steps = result.receive_steps
    points = sorted({max(1, round(1 + i * (steps - 1) / max(1, cuts - 1))) for i in range(cuts)}) if steps else []
    for k in points:
        live = await _open(factory)
        try:
            await _refit(live, gen, _SLOW_S)
            _perturb(live.pair.sources(), gen)
            before = snapshot(live.receiver.params)
            r_t, s_t = live.transport(live.receiver), live.transport(live.sender)
            live.stepper.arm(cut_before=k, on_cut=r_t.abort)

            sender_done = anyio.Event()

            async def send():
                try:
                    return await live.sender.refit(live.name, refit_timeout_s=_SLOW_S)
                finally:
                    sender_done.set()

            async def receive():
                try:
                    return await live.receiver.refit(live.name, refit_timeout_s=_SLOW_S)
                except BaseException:
                    # A sender waiting for this receiver must not wait out its deadline. The
                    # cut may come before the sender's attempt began (an abort then has nothing
                    # to cut), so abort until the sender has returned.
                    with anyio.CancelScope(shield=True), anyio.move_on_after(_SLOW_S):
                        while not sender_done.is_set():
                            s_t.abort()
                            with anyio.move_on_after(0.05):
                                await sender_done.wait()
                    raise

            so, ro = await _both(send, receive, _SLOW_S + 30, f"a refit cut before step {k}")
            live.stepper.disarm()
            for o, side in ((so, "send"), (ro, "receive")):
                if o.error is not None and not isinstance(o.error, PolicyWorkerError):
                    _fail(f"a refit cut before step {k}: {side} raised a foreign error {o.error!r}")
            if ro.error is None:  # the transport finished regardless: it must have committed exactly
                if live.receiver.weight_version != 2 or live.receiver.torn:
                    _fail(f"a refit cut before step {k} returned but holds version {live.receiver.weight_version}")
                for name, want in live.pair.expected(live.pair.sources()).items():
                    if not torch.equal(live.receiver.weights()[name].detach().cpu(), want.detach().cpu()):
                        _fail(f"a refit cut before step {k} returned but {name} differs")
                diff: list[str] = []
            else:
                if live.receiver.weight_version != 1:
                    _fail(f"a refit cut before step {k} moved the version to {live.receiver.weight_version}")
                diff = _check_torn(live, before, f"a refit cut before step {k}", exact=False)
                result.torn_checked |= bool(diff)
            result.cuts.append({"before_step": k, "failed": ro.error is not None, "changed": len(diff),
                                "torn": live.receiver.torn, "cut": live.stepper.cut})
        finally:
            await live.close()

    # 5. a mismatched peer fails at attach (connect)
    pair = await factory()
    live = _Live(pair)
    try:
        r_setup = dict(pair.receiver_setup)
        if r_setup.get("plan") is not None:
            r_setup["plan"] = mismatched_plan(r_setup["plan"])
        else:
            r = live.receiver
            r.params = {k: torch.zeros(v.shape, dtype=mismatched_dtype(v.dtype), device=v.device)
                        for k, v in r.params.items()}
        sa, ra = await live.attach(r_setup)
        errors = [o.error for o in (sa, ra) if o.error is not None]
        foreign = [e for e in errors if not isinstance(e, PolicyWorkerError)]
        if foreign:
            _fail(f"a mismatched attach raised a foreign error: {foreign[0]!r}")
        if not any(isinstance(e, (PlanMismatch, ConfigError)) for e in errors):
            _fail(f"a mismatched pair (the receiver expects other dtypes) attached: {errors or 'no error'}")
    finally:
        await live.close()
    return result
