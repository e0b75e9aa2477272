"""The conformance suite, through real workers, under asyncio and trio.

Built-ins that run both ends in one process pass it: memory, zmq (shm on CPU), and
nccl_reshard (real gloo groups joined from the two workers' executor threads). The
files plugin runs it in its own tests; sglang_ipc's receiver is the SGLang engine
itself, not a RolloutWorker (tests/test_sglang_ipc.py).

Liars fail it: a receiver that overwrites live bytes while saying ``ctx.touched =
False`` (three ways: on every refit, only when cut short, before waiting for data),
and one that ignores a mismatched peer.
"""

from __future__ import annotations

import itertools

import anyio
import pytest
import torch

from policyworker import RolloutWorker, TorchPolicyWorker
from policyworker.runtime.procs import free_port
from policyworker.runtime.comm import new_group
from policyworker.errors import ConfigError, RefitAborted
from policyworker.layout import build_plan, dest_shards
from policyworker.models import get_preset
from policyworker.testing import (
    InMemoryTransport,
    MemoryHub,
    TransportPair,
    check_transport,
    memory_pair_factory,
    plain_pair,
)
from policyworker.models.toy_model import build_model

pytestmark = pytest.mark.anyio

BACKENDS = [pytest.param(("asyncio", {}), id="asyncio"), pytest.param(("trio", {}), id="trio")]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request):
    return request.param


PARAMS = {"a.weight": torch.randn(64, 8), "a.bias": torch.randn(8), "b.index": torch.arange(12, dtype=torch.int64),
          "c.bf16": torch.randn(5, 3).to(torch.bfloat16)}


@pytest.mark.timeout(120)
async def test_memory_passes_the_suite():
    result = await check_transport(memory_pair_factory(PARAMS))
    assert [r.version for r in result.reports] == [1, 1, 2, 2, 3, 3]
    assert result.timeout_seconds < 4 and result.abort_seconds < 2
    # memory copies one tensor per step: cuts after the first copy fail with live bytes
    # changed, and the weights are torn (the rule ran on written bytes, every time).
    assert result.receive_steps == 1 + len(PARAMS)
    assert result.torn_checked
    assert [(c["before_step"], c["failed"], c["changed"] > 0, c["torn"]) for c in result.cuts] == [
        (1, True, False, False), (3, True, True, True), (5, True, True, True)]


# -- liars -----------------------------------------------------------------------------

class _Liar(InMemoryTransport):
    """Memory's wire, another name; subclasses lie in one way each."""

    name = "liar"


class SaysUntouched(_Liar):
    """Writes live bytes tensor by tensor and never says so (``touched`` stays False)."""

    async def receive(self, ctx, version):
        report = await super().receive(ctx, version)
        ctx.touched = False
        return report


class HonestOnlyWhenDone(_Liar):
    """Copies in place tensor by tensor with ``touched = False``; says True only once done —
    honest on success, a liar when cut short."""

    async def receive(self, ctx, version):
        ctx.touched = False
        incoming = await ctx.blocking(self._take, ctx, version, self.timeout_s)
        for name, dst in ctx.params.items():
            if self._aborted.is_set():
                raise RefitAborted("aborted", transport=self.name)
            await ctx.blocking(dst.copy_, incoming[name])
        ctx.touched = True
        from policyworker.transports.base import RefitReport

        return RefitReport(transport=self.name, role="receive", version=version, bytes=1, seconds=0.0)


class ScribblesFirst(_Liar):
    """Overwrites its live tensors before it waits for the data, saying ``touched = False``."""

    async def receive(self, ctx, version):
        await ctx.blocking(lambda: [t.fill_(1) for t in ctx.params.values()])
        return await super().receive(ctx, version)


class IgnoresMismatch(_Liar):
    """Never compares its peer's tensors at connect."""

    async def connect(self, ctx):
        ctx.state["hub"] = self.hub
        self._aborted.clear()


def _liar_factory(cls):
    async def factory() -> TransportPair:
        hub = MemoryHub()
        return plain_pair(lambda: cls(hub), PARAMS)

    return factory


@pytest.mark.timeout(120)
@pytest.mark.parametrize("liar, breach", [
    (SaysUntouched, "changed live bytes but left ctx.touched = False"),
    (HonestOnlyWhenDone, r"refit cut before step \d+: live bytes of .* changed but the weights are not torn"),
    (ScribblesFirst, "a never-sent version: live bytes of .* changed but the weights are not torn"),
    (IgnoresMismatch, "a mismatched pair .* attached"),
], ids=["says-untouched", "honest-only-when-done", "scribbles-before-waiting", "ignores-mismatch"])
async def test_liars_fail_the_suite(liar, breach):
    with pytest.raises(AssertionError, match=breach):
        await check_transport(_liar_factory(liar))


async def test_the_memory_double_refuses_a_mismatched_peer_in_either_order():
    hub = MemoryHub()
    pair = plain_pair(lambda: InMemoryTransport(hub), PARAMS,
                      receiver_params={**PARAMS, "a.bias": torch.zeros(9)})
    try:
        await pair.receiver.attach_transport(InMemoryTransport(hub))
        with pytest.raises(Exception) as info:
            await pair.sender.attach_transport(InMemoryTransport(hub))
        assert type(info.value).__name__ == "PlanMismatch" and "a.bias" in str(info.value)
    finally:
        await pair.sender.shutdown()
        await pair.receiver.shutdown()


async def test_a_factory_must_return_worker_pairs():
    async def factory():
        return "not a pair"

    with pytest.raises(ConfigError, match="TransportPair"):
        await check_transport(factory)


# -- resharding built-ins through workers ------------------------------------------------

CONFIG = get_preset("tiny")


def _plan():
    return build_plan(CONFIG, "tp=1", "tp=1", 1, 1, dtype=torch.float32)


async def _join(port: int, name: str):
    """A 2-rank gloo group (trainer rank 0, rollout rank 1) joined from two threads."""
    groups = [None, None]

    async def one(rank):
        groups[rank] = await anyio.to_thread.run_sync(lambda: new_group(
            host="127.0.0.1", port=port, rank=rank, world_size=2, name=name, timeout_s=20))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0)
        tg.start_soon(one, 1)
    return groups


def _nccl_factory(delta: bool = False):
    plan = _plan()
    # delta: every refit after the first a delta, even at 100% changed (the suite's perturbation)
    extra = {"delta": True, "delta_max_fraction": 1.0} if delta else {}

    async def factory() -> TransportPair:
        trainer = TorchPolicyWorker(build_model(CONFIG, seed=0), device="cpu", timeout_s=20)
        rollout = RolloutWorker(device="cpu", timeout_s=20)
        port = free_port()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: trainer.init_collective("127.0.0.1", port, 2, train_world_size=1))
            tg.start_soon(lambda: rollout.init_collective("127.0.0.1", port, 2, train_world_size=1))
        s_stage, r_stage = await _join(free_port(), "reshard_pp0")

        async def close() -> None:
            for g in (s_stage, r_stage):
                g.abort()
                g.close()

        source = dict(trainer.model.named_parameters())
        return TransportPair(trainer, rollout, "nccl_reshard",
                             {"plan": plan, "group": s_stage, "stage": 0, "bucket_bytes": 4096, **extra},
                             {"plan": plan, "groups": {0: r_stage}, "bucket_bytes": 4096, **extra},
                             source=source, expected=lambda p: dest_shards(plan, 0, p), close=close)

    return factory


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
async def test_nccl_reshard_passes_the_suite():
    result = await check_transport(_nccl_factory())
    assert [r.version for r in result.reports] == [1, 1, 2, 2, 3, 3]
    assert result.timeout_seconds < 4 and result.abort_seconds < 2
    assert result.receive_steps >= 1 and result.cuts


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
async def test_nccl_reshard_in_delta_mode_passes_the_suite():
    result = await check_transport(_nccl_factory(delta=True))
    assert [r.version for r in result.reports] == [1, 1, 2, 2, 3, 3]
    kinds = [r.notes[-1].split(" ")[0] for r in result.reports]
    assert kinds == ["full:", "full:", "delta", "delta", "delta", "delta"], [r.notes for r in result.reports]
    assert result.timeout_seconds < 4 and result.abort_seconds < 2


def _zmq_factory(directory):
    plan = _plan()
    count = itertools.count()

    async def factory() -> TransportPair:
        trainer = TorchPolicyWorker(build_model(CONFIG, seed=0), device="cpu", timeout_s=20)
        rollout = RolloutWorker(device="cpu", timeout_s=20)
        setup = {"plan": plan, "endpoint": f"ipc://{directory}/conf-{next(count)}.sock", "timeout_s": 10}
        return TransportPair(trainer, rollout, "zmq", setup, setup, source=dict(trainer.model.named_parameters()),
                             expected=lambda p: dest_shards(plan, 0, p))

    return factory


@pytest.mark.timeout(300)
async def test_zmq_passes_the_suite(tmp_path):
    # Both ends in one process works on CPU (shm files map twice); CUDA IPC cannot open
    # a handle in the process that exported it (tests/test_zmq_gpu.py runs two processes).
    result = await check_transport(_zmq_factory(tmp_path))
    assert [r.version for r in result.reports] == [1, 1, 2, 2, 3, 3]
    assert result.timeout_seconds < 4 and result.abort_seconds < 2


def test_the_docs_example_runs_as_written(capsys):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "writing-a-transport.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    exec(compile(block, "docs/writing-a-transport.md", "exec"), {"__name__": "docs_example"})
    assert "6 reports" in capsys.readouterr().out


def test_plain_pair_refuses_names_a_module_cannot_hold():
    with pytest.raises(ConfigError, match="'x.half'"):
        plain_pair("memory", {"x.half": torch.zeros(2)})
