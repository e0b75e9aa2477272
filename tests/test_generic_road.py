"""The one refit road: attach_transport / refit / detach_transport, ledger, deadlines (one process).

Transports here are the in-memory double and two small transports written for these
tests (as a plugin author would): every one goes through the same worker path as
the built-ins, with the watchdog, the ledger and torn marking applying to it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from policyworker import (
    ConfigError,
    RefitAborted,
    RefitInProgress,
    RefitTimeout,
    RolloutWorker,
    TornWeights,
    TorchPolicyWorker,
    Transport,
    TransportError,
)
from policyworker.models import get_preset
from policyworker.models.toy_model import build_model
from policyworker.testing import InMemoryTransport, MemoryHub
from policyworker.transports.base import RefitReport
from policyworker.runtime.watchdog import process_watchdog

pytestmark = pytest.mark.anyio


def _pair(seed: int = 0):
    model = build_model(get_preset("tiny"), seed=seed)
    trainer = TorchPolicyWorker(model, device="cpu", timeout_s=10)
    dst = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    rollout = RolloutWorker(device="cpu", params=dst, timeout_s=10)
    return model, trainer, rollout


def _perturb(model, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))


async def test_a_transport_by_name_refits_bit_exact_and_versions_advance():
    model, trainer, rollout = _pair()
    hub = MemoryHub()
    try:
        await asyncio.gather(trainer.attach_transport("memory", hub=hub), rollout.attach_transport("memory", hub=hub))
        for v in (1, 2, 3):
            _perturb(model, v)
            sent, got = await asyncio.gather(trainer.refit("memory"), rollout.refit("memory"))
            assert (sent.version, got.version, rollout.weight_version) == (v, v, v)
            for name, p in model.named_parameters():
                assert torch.equal(rollout.weights()[name], p.detach())
        assert trainer.transport_version("memory") == 3
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_attach_without_connect_connects_inside_the_first_refit():
    model, trainer, rollout = _pair()
    hub = MemoryHub()
    try:
        with pytest.raises(ConfigError, match="connect must be a bool"):
            await rollout.attach_transport("memory", connect="later", hub=hub)
        await rollout.attach_transport("memory", connect=False, hub=hub)
        assert rollout.attachment("memory").connected is False  # nothing collective yet
        await trainer.attach_transport("memory", connect=False, hub=hub)
        _perturb(model, 1)
        sent, got = await asyncio.gather(trainer.refit("memory"), rollout.refit("memory"))
        assert (sent.version, got.version, rollout.attachment("memory").connected) == (1, 1, True)
        for name, p in model.named_parameters():
            assert torch.equal(rollout.weights()[name], p.detach())
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_an_instance_is_accepted_and_detach_closes_it():
    model, trainer, rollout = _pair()
    hub = MemoryHub()
    send, recv = InMemoryTransport(hub), InMemoryTransport(hub)
    try:
        await trainer.attach_transport(send)
        await rollout.attach_transport(recv)
        assert trainer.attached_transports() == ["memory"]
        await asyncio.gather(trainer.refit("memory"), rollout.refit("memory"))
        await trainer.detach_transport("memory")
        with pytest.raises(ConfigError, match="not attached"):
            await trainer.refit("memory")
        with pytest.raises(TransportError):
            await send.send(None, 9)  # closed by detach
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_bad_setup_and_options_fail_before_anything_happens():
    _, trainer, rollout = _pair()
    try:
        with pytest.raises(ConfigError, match="unknown key.*bucket_size"):
            await trainer.attach_transport("memory", bucket_size=1)
        with pytest.raises(ConfigError, match="timeout_s"):
            await trainer.attach_transport("memory", timeout_s="soon")
        with pytest.raises(ConfigError, match="unknown transport"):
            await trainer.attach_transport("no-such-transport")
        with pytest.raises(ConfigError, match="reshards: attach it with plan"):
            await trainer.attach_transport("nccl_reshard")
        assert trainer.attached_transports() == []
        # The deprecated spellings check a setup when it is given, too (and warn).
        with pytest.raises(ConfigError, match="options of transport 'nccl_reshard'.*bucket_bytes"), \
                pytest.warns(DeprecationWarning, match="reshard_options="):
            TorchPolicyWorker(build_model(get_preset("tiny"), seed=0), device="cpu",
                              reshard_options={"bucket_bytes": "big"})
        with pytest.raises(ConfigError, match="unknown key"), pytest.warns(DeprecationWarning, match="transport_options="):
            RolloutWorker(device="cpu", transport_options={"zmq": {"stagingg": 2}})
        await rollout.attach_transport("memory", hub=MemoryHub())
        with pytest.raises(ConfigError, match="unknown key"):
            await rollout.refit("memory", kv_scales={"a": 1.0})  # memory takes no options
        assert (rollout.weight_version, rollout.torn) == (0, False)
        rollout.weights()  # still servable
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_a_version_never_sent_times_out_inside_the_deadline_and_changes_nothing():
    _, trainer, rollout = _pair()
    try:
        await rollout.attach_transport("memory", hub=MemoryHub())
        t0 = time.monotonic()
        with pytest.raises(RefitTimeout):
            await rollout.refit("memory", refit_timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0
        assert (rollout.weight_version, rollout.torn) == (0, False)
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


@dataclass(frozen=True, kw_only=True, slots=True)
class _StuckSetup:
    events: object = None


class HalfThenStuck(Transport):
    """Writes the first destination tensor, then waits for an abort (a plugin that touches in place)."""

    name = "half_then_stuck"
    Setup = _StuckSetup

    def __init__(self) -> None:
        self._abort = threading.Event()
        self.entered = threading.Event()
        self.left = threading.Event()

    async def connect(self, ctx) -> None:
        pass

    def _body(self, ctx) -> None:
        self.entered.set()
        try:
            first = next(iter(ctx.params.values()))
            ctx.touched = True
            with torch.no_grad():
                first.fill_(7)
            while not self._abort.wait(0.01):
                pass
            time.sleep(0.2)  # still inside the copy when the abort arrives: the core must wait
            raise RefitAborted("aborted", transport=self.name)
        finally:
            self.left.set()

    async def receive(self, ctx, version) -> RefitReport:
        await ctx.blocking(self._body, ctx)
        raise AssertionError("unreachable")

    async def send(self, ctx, version) -> RefitReport:
        await ctx.blocking(self._body, ctx)
        raise AssertionError("unreachable")

    def abort(self) -> None:
        self._abort.set()

    async def aclose(self) -> None:
        self._abort.set()


async def test_a_cancelled_refit_is_torn_never_served_as_the_old_version():
    _, trainer, rollout = _pair()
    stuck = HalfThenStuck()
    try:
        await rollout.attach_transport(stuck)
        task = asyncio.ensure_future(rollout.refit("half_then_stuck"))
        while not stuck.entered.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(RefitInProgress):
            rollout.weights()  # mid-refit: no bytes of an uncommitted version go out
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stuck.left.is_set(), "refit returned while the executor was still touching the weights"
        assert (rollout.weight_version, rollout.torn) == (0, True)
        with pytest.raises(TornWeights):
            rollout.weights()
        # A full refit commits and clears the mark.
        hub = MemoryHub()
        await rollout.attach_transport("memory", hub=hub)
        await trainer.attach_transport("memory", hub=hub)
        await asyncio.gather(trainer.refit("memory"), rollout.refit("memory"))
        assert (rollout.weight_version, rollout.torn) == (1, False)
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_wait_for_around_refit_is_cancel_safe_too():
    _, trainer, rollout = _pair()
    stuck = HalfThenStuck()
    try:
        await rollout.attach_transport(stuck)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(rollout.refit("half_then_stuck"), 0.2)
        assert stuck.left.is_set()
        assert (rollout.weight_version, rollout.torn) == (0, True)
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_a_deadline_aborts_a_plugin_and_marks_touched_weights_torn():
    _, trainer, rollout = _pair()
    try:
        await rollout.attach_transport(HalfThenStuck())
        t0 = time.monotonic()
        with pytest.raises(RefitTimeout):
            await rollout.refit("half_then_stuck", refit_timeout_s=0.3)
        assert time.monotonic() - t0 < 3.0
        assert (rollout.weight_version, rollout.torn) == (0, True)
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_stand_down_is_scoped_to_the_worker():
    _, a, _r1 = _pair()
    _, b, _r2 = _pair()
    sa, sb = HalfThenStuck(), HalfThenStuck()
    try:
        await a.attach_transport(sa)
        await b.attach_transport(sb)
        ta = asyncio.ensure_future(a.refit("half_then_stuck", refit_timeout_s=30))
        tb = asyncio.ensure_future(b.refit("half_then_stuck", refit_timeout_s=30))
        while not (sa.entered.is_set() and sb.entered.is_set()):
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        assert a.stand_down_refit_watchdog() == 1
        assert time.perf_counter() - t0 < 0.05
        assert process_watchdog().armed_count(a) == 0
        assert process_watchdog().armed_count(b) == 1  # b keeps its deadline
        sa.abort()
        sb.abort()
        for t in (ta, tb):
            with pytest.raises(RefitAborted):
                await t
    finally:
        for w in (a, b, _r1, _r2):
            await w.shutdown()


def test_one_hanging_abort_callback_does_not_delay_other_deadlines():
    wd = process_watchdog()
    hang = threading.Event()
    fired = threading.Event()
    wd.arm(0.05, [lambda: hang.wait(5)], label="hangs")
    t0 = time.monotonic()
    wd.arm(0.1, [fired.set], label="other")
    assert fired.wait(2.0)
    assert time.monotonic() - t0 < 1.0
    hang.set()


async def test_shutdown_detaches_every_transport():
    _, trainer, rollout = _pair()
    send = InMemoryTransport(MemoryHub())
    await trainer.attach_transport(send)
    await trainer.shutdown()
    assert trainer.attached_transports() == []
    with pytest.raises(TransportError):
        await send.send(None, 1)
    await rollout.shutdown()


def test_a_ledger_transaction_commits_once_or_fails_with_what_it_touched():
    from policyworker.errors import ProtocolError
    from policyworker.ledger import WeightLedger

    ledger = WeightLedger(rank=0)
    with ledger.transaction(1) as tx:  # committed inside: the exit adds nothing
        with pytest.raises(RefitInProgress):
            ledger.check_servable()
        tx.commit(received_bytes=8, expected_bytes=8)
    assert (ledger.version, ledger.torn, ledger.in_flight) == (1, False, False)
    with pytest.raises(RuntimeError), ledger.transaction(2):  # an error before any write: untouched
        raise RuntimeError("lost before the first byte")
    assert (ledger.version, ledger.torn, ledger.in_flight) == (1, False, False)
    with ledger.transaction(2) as tx:  # left without a commit after a write: torn, version kept
        tx.touched = True
    assert (ledger.version, ledger.torn) == (1, True)
    with pytest.raises(TornWeights):
        ledger.check_servable()
    tx = ledger.transaction(2).open()  # a refused commit ends the transaction as torn
    with pytest.raises(ProtocolError):
        tx.commit(received_bytes=4, expected_bytes=8)
    tx.close()
    assert (ledger.version, ledger.torn, ledger.in_flight, tx.done) == (1, True, False, True)
    with ledger.transaction(2) as tx:
        tx.commit()
    assert (ledger.version, ledger.torn) == (2, False)
    staged = WeightLedger(staged=True)  # a staged receiver never tears the live set
    with staged.transaction(1, touched=None):
        staged.check_servable()
    assert (staged.version, staged.torn) == (0, False)


@pytest.mark.timeout(120)
async def test_nemo_named_shims_ride_the_road_and_keep_the_setup_attached_through_it(tmp_path):
    from policyworker.layout import dest_shards
    from policyworker.layout.local import as_plan

    model = build_model(get_preset("tiny"), seed=0)
    kw = dict(device="cpu", cpu_index=0, runtime_dir=str(tmp_path), timeout_s=10, zmq_timeout_s=10)
    trainer, rollout = TorchPolicyWorker(model, **kw), RolloutWorker(**kw)
    try:
        info = await trainer.prepare_zmq_refit_info("tp=1", 1)
        rollout.load_colocated_plan(info)

        async def shim_refit(step):
            _perturb(model, step)
            sent, got = await asyncio.gather(trainer.stream_weights_via_ipc_zmq(refit_timeout_s=30),
                                             rollout.update_weights_via_ipc_zmq(refit_timeout_s=30))
            want = dest_shards(as_plan(info), 0, {n: p.detach() for n, p in model.named_parameters()})
            assert want.keys() == rollout.weights().keys()
            for name, t in want.items():
                assert torch.equal(rollout.weights()[name], t), name
            return sent, got

        sent, _ = await shim_refit(1)  # the shims attach with the transport's defaults: every source mapped
        assert (sent.buckets, sent.peak_extra_bytes) == (1, 0) and trainer.attached_transports() == ["zmq"]
        # The one way to give a setup: attach through the road, with the plan the wiring built.
        setup = {"plan": info, "staged": True, "bucket_bytes": 4096, "timeout_s": 10.0}
        await asyncio.gather(trainer.attach_transport("zmq", **setup), rollout.attach_transport("zmq", **setup))
        sent, got = await shim_refit(2)  # a shim refit keeps the attached setup: staged, small buckets
        assert sent.buckets > 1 and (sent.version, got.version, rollout.weight_version) == (2, 2, 2)
        # The old spellings still work and say they are deprecated.
        with pytest.warns(DeprecationWarning, match="attach_transport"):
            trainer.zmq_options = {"bucket_bytes": 8192, "staged": True}
        with pytest.warns(DeprecationWarning, match="attach_transport"):
            rollout.zmq_options = {"bucket_bytes": 8192, "staged": True}
        sent8, _ = await shim_refit(3)
        assert 1 < sent8.buckets < sent.buckets
    finally:
        await trainer.shutdown()
        await rollout.shutdown()
