"""Failure paths that once broke the README's guarantees, each pinned by a real run.

nccl_reshard cases run as one world of three real processes (trainers tp=2, a
rollout tp=1, gloo) that plays the scenarios in turn, each with fresh workers and ports; the
rollout checks its weights bit for bit against an independent reference
(``seeded_state_dict`` sharded by the plan) and against a snapshot taken before the
failure (a failed refit that touched nothing must leave every byte as it was).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import anyio
import pytest
import torch

from policyworker import ConfigError, PolicyWorkerError, RolloutWorker
from policyworker.errors import RefitAborted, TornWeights, TransportError
from policyworker.transports.base import RefitReport, Transport, TransportContext
from policyworker.runtime.procs import free_port, process_context, start_world
from policyworker.layout import Parallelism, build_plan, dest_shards, source_shards
from policyworker.models import get_preset, seeded_state_dict

from .helpers import ShardTrainer, same_bits

PRESET = "tiny"
#: Slack past a deadline within which the typed error must arrive (README: deadline + 2 s).
SLACK_S = 2.0
N_TRAIN = 2
SCENARIOS = ("rollout_alone_deadline", "rollout_alone_group_timeout", "trainer_alone", "bucket_mismatch",
             "reconnect_fails")


def _plan():
    config = get_preset(PRESET)
    return config, build_plan(config, Parallelism.parse("tp=2"), "tp=1", N_TRAIN, 1, dtype=torch.float32)


def _reference(version: int) -> dict[str, torch.Tensor]:
    config, plan = _plan()
    return dest_shards(plan, 0, seeded_state_dict(config, seed=version, dtype=torch.float32))


async def _sync(barrier) -> None:
    await asyncio.to_thread(barrier.wait, 120)


class _Side:
    """One side's workers for one scenario (ports shared through ``ports``)."""

    def __init__(self, rank: int, ports: dict[str, int], *, timeout_s: float, options: dict[str, Any]):
        self.config, self.plan = _plan()
        self.rank, self.ports, self.timeout_s, self.options = rank, ports, timeout_s, options
        self.trainer = rank < N_TRAIN
        self.w: Any = None
        self.local: dict[str, torch.Tensor] = {}

    async def join(self, update: str = "update", stage: str = "stage") -> None:
        first = self.w is None
        if first:
            if self.trainer:
                self.local = source_shards(self.plan, self.rank, seeded_state_dict(self.config, seed=0,
                                                                                   dtype=torch.float32))
                self.w = ShardTrainer(local_params=self.local, source=self.config, rank=self.rank, world_size=N_TRAIN,
                                      device="cpu", timeout_s=self.timeout_s)
            else:
                self.w = RolloutWorker(rank=0, gen_world_size=1, device="cpu", timeout_s=self.timeout_s)
        await self.w.init_collective("127.0.0.1", self.ports[update], N_TRAIN + 1, train_world_size=N_TRAIN)
        if self.trainer:
            await self.w.init_nccl_reshard_comm_group(["127.0.0.1"], [self.ports[stage]], 1, 0, N_TRAIN + 1,
                                                      self.rank)
            info = await self.w.prepare_nccl_reshard_refit_info(Parallelism.parse("tp=2"), "tp=1", N_TRAIN, 1)
            if first:  # the setup, through the road; the shims keep it on every rejoin
                await self.w.attach_transport("nccl_reshard", connect=False, plan=info, group=self.w.pp_comm_group,
                                              stage=0, **self.options)
        else:
            await self.w.init_nccl_reshard_comm_groups(["127.0.0.1"], [self.ports[stage]], [N_TRAIN])
            if self.w.weight_version == 0:
                self.w.load_refit_plan(self.plan.refit_info())
            if first:
                await self.w.attach_transport("nccl_reshard", connect=False, plan=self.plan,
                                              groups=self.w.stage_groups, **self.options)

    async def refit(self, version: int | None = None, refit_timeout_s: float | None = None) -> dict[str, Any]:
        """One refit; the outcome as plain data (error type, seconds, torn, version, exactness)."""
        if self.trainer and version is not None:
            for name, t in source_shards(self.plan, self.rank, seeded_state_dict(self.config, seed=version,
                                                                          dtype=torch.float32)).items():
                self.local[name].copy_(t)
        before = None
        if not self.trainer:
            before = {k: v.clone() for k, v in self.w.params.items()}
        t0 = time.monotonic()
        out: dict[str, Any] = {}
        try:
            if self.trainer:
                rep = await self.w.nccl_reshard_refit(refit_timeout_s=refit_timeout_s)
            else:
                rep = await self.w.receive_nccl_reshard_refit(refit_timeout_s=refit_timeout_s)
            out.update(ok=True, version=rep.version)
        except PolicyWorkerError as exc:
            out.update(ok=False, error=type(exc).__name__, message=str(exc)[:400])
        except Exception as exc:  # the defect this file pins: anything untyped is reported, not raised
            out.update(ok=False, error=f"untyped {type(exc).__name__}", message=str(exc)[:400])
        out["seconds"] = time.monotonic() - t0
        if not self.trainer:
            out["torn"] = self.w.torn
            out["weight_version"] = self.w.weight_version
            params = self.w.params
            out["unchanged"] = all(same_bits(params[k], before[k]) for k in before)
            if out["ok"]:
                want = _reference(out["version"])
                out["exact"] = set(want) == set(params) and all(same_bits(params[k], want[k]) for k in want)
            try:
                self.w.weights()
                out["serves"] = True
            except PolicyWorkerError as exc:
                out["serves"] = type(exc).__name__
        return out

    async def close(self) -> bool:
        return await self.w.shutdown()


async def _scenario(rank: int, name: str, ports: dict[str, int], barrier) -> dict[str, Any]:
    res: dict[str, Any] = {}
    timeout_s = 4.0 if name == "rollout_alone_group_timeout" else 30.0
    trainer = rank < N_TRAIN
    options = {"bucket_bytes": (16 << 20) if trainer else (8 << 20)} if name == "bucket_mismatch" else {}
    side = _Side(rank, ports, timeout_s=timeout_s, options=options)
    await _sync(barrier)
    await side.join()
    if name in ("rollout_alone_deadline", "rollout_alone_group_timeout"):
        res["committed"] = await side.refit(1, refit_timeout_s=30.0)  # connected, v1 committed
        if not trainer:  # the trainers never call; without a refit deadline the group timeout bounds it
            res["first"] = await side.refit(refit_timeout_s=2.0 if name == "rollout_alone_deadline" else None)
        await _sync(barrier)
    elif name == "trainer_alone":
        res["committed"] = await side.refit(1, refit_timeout_s=30.0)
        if trainer:  # the rollout never calls this one
            res["first"] = await side.refit(2, refit_timeout_s=2.0)
        await _sync(barrier)
        # Both sides call again, no rebuild: the trainers' groups were aborted by their deadline.
        res["again"] = await side.refit(2, refit_timeout_s=4.0)
        await _sync(barrier)
        await side.join("update2", "stage2")  # the documented recovery: rebuild every side
        res["recovered"] = await side.refit(2, refit_timeout_s=30.0)
    elif name == "bucket_mismatch":
        res["first"] = await side.refit(1, refit_timeout_s=10.0)
    elif name == "reconnect_fails":
        res["first"] = await side.refit(1, refit_timeout_s=30.0)
        # A new update group resets every attachment; the stage groups are not re-joined, so
        # the next refit's lazy connect fails before any byte moves.
        await side.w.init_collective("127.0.0.1", ports["update2"], N_TRAIN + 1, train_world_size=N_TRAIN)
        if not trainer:
            res["again"] = await side.refit(refit_timeout_s=10.0)
        await _sync(barrier)
        await side.join("update3", "stage2")
        res["recovered"] = await side.refit(2, refit_timeout_s=30.0)
    res["shutdown"] = await side.close()
    return res


def _world_body(rank: int, ports: dict[str, dict[str, int]], barrier) -> dict[str, Any]:
    torch.set_num_threads(1)

    async def main() -> dict[str, Any]:
        return {name: await _scenario(rank, name, ports[name], barrier) for name in SCENARIOS}

    return asyncio.run(main())


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:

    ports = {name: {k: free_port() for k in ("update", "stage", "update2", "stage2", "update3")} for name in SCENARIOS}
    barrier = process_context().Barrier(N_TRAIN + 1)
    w = start_world(_world_body, N_TRAIN + 1, (ports, barrier))
    out = w.collect(150)
    return [out[r] for r in range(N_TRAIN + 1)]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_rollout_alone_times_out_typed_within_its_deadline(world):
    assert world[-1]["rollout_alone_deadline"]["committed"]["exact"]
    first = world[-1]["rollout_alone_deadline"]["first"]
    assert first["error"] == "RefitTimeout", first
    assert first["seconds"] <= 2.0 + SLACK_S, first
    assert first["torn"] is False and first["unchanged"] and first["serves"] is True, first
    assert first["weight_version"] == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_rollout_alone_without_a_deadline_is_bounded_by_the_group_timeout(world):
    assert world[-1]["rollout_alone_group_timeout"]["committed"]["exact"]
    first = world[-1]["rollout_alone_group_timeout"]["first"]
    assert first["error"] == "RefitTimeout", first
    assert first["seconds"] <= 4.0 + SLACK_S, first
    assert first["torn"] is False and first["unchanged"] and first["serves"] is True, first


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_trainer_timeout_does_not_poison_the_rollouts_next_refit(world):
    trainer, rollout = world[0]["trainer_alone"], world[-1]["trainer_alone"]
    assert rollout["committed"]["exact"], rollout
    assert trainer["first"]["error"] == "RefitTimeout", trainer
    again = rollout["again"]
    # The stale attempt's bytes are never taken: the rollout fails typed, at once, untorn.
    assert again["ok"] is False and not again["error"].startswith("untyped"), again
    assert again["seconds"] <= SLACK_S, again
    assert again["torn"] is False and again["unchanged"] and again["serves"] is True, again
    assert again["weight_version"] == 1 and "rebuild" in again["message"], again
    assert trainer["again"]["ok"] is False, trainer
    # After the documented recovery (every side rebuilds its groups) the refit commits.
    assert trainer["recovered"]["ok"], trainer
    rec = rollout["recovered"]
    assert rec["ok"] and rec["exact"] and rec["weight_version"] == 2, rec


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_mismatched_bucket_bytes_fail_at_connect_and_leave_the_rollout_untorn(world):
    for side in world:
        first = side["bucket_mismatch"]["first"]
        assert first["error"] == "ConfigError" and "bucket_bytes" in first["message"], first
    first = world[-1]["bucket_mismatch"]["first"]
    assert first["torn"] is False and first["unchanged"] and first["serves"] is True, first


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_failed_lazy_connect_leaves_committed_weights_servable(world):
    rollout = world[-1]["reconnect_fails"]
    assert rollout["first"]["ok"] and rollout["first"]["exact"], rollout
    again = rollout["again"]
    assert again["ok"] is False and not again["error"].startswith("untyped"), again
    assert again["torn"] is False and again["unchanged"] and again["serves"] is True, again
    assert again["weight_version"] == 1
    rec = rollout["recovered"]
    assert rec["ok"] and rec["exact"] and rec["weight_version"] == 2, rec


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_every_process_shut_down(world):
    for side in world:
        assert all(res["shutdown"] is True for res in side.values()), side


# -- the caller's tensors -------------------------------------------------------------------


def test_a_plan_that_does_not_fit_the_callers_params_is_refused_and_leaves_them():
    _config, plan = _plan()
    mine = {"x": torch.arange(6, dtype=torch.float32)}
    snapshot = mine["x"].clone()
    r = RolloutWorker(params=mine, device="cpu")
    with pytest.raises(ConfigError) as info:
        r.load_refit_plan(plan.refit_info())
    text = str(info.value)
    assert "missing" in text and "model.embed_tokens.weight" in text, text
    assert r.params["x"] is mine["x"] and torch.equal(mine["x"], snapshot) and set(r.params) == {"x"}


def test_a_plan_with_another_shape_or_dtype_names_them_and_changes_nothing():
    _config, plan = _plan()
    want = _reference(0)
    bad = {k: v.clone() for k, v in want.items()}
    name = sorted(bad)[0]
    bad[name] = torch.zeros(3, 5, dtype=torch.float16)
    other = sorted(bad)[1]
    bad[other] = bad[other].to(torch.float64)
    r = RolloutWorker(params=bad, device="cpu")
    with pytest.raises(ConfigError) as info:
        r.load_refit_plan(plan.refit_info())
    text = str(info.value)
    assert name in text and "float16[3, 5]" in text and other in text and "float64" in text, text
    assert all(r.params[k] is bad[k] for k in bad)


def test_params_that_fit_the_plan_are_kept_not_replaced():
    _config, plan = _plan()
    mine = {k: v.clone() for k, v in _reference(3).items()}
    r = RolloutWorker(params=mine, device="cpu")
    r.load_refit_plan(plan.refit_info())
    assert all(r.params[k] is mine[k] for k in mine)
    assert all(same_bits(r.params[k], v) for k, v in _reference(3).items())


# -- cancellation under every anyio backend ---------------------------------------------------

_ANYIO_BACKENDS = [pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
                   pytest.param(("trio", {}), id="trio")]


class _HoldingTransport(Transport):
    """A receiver that writes ``touch`` bytes of the live tensor, then waits (as a slow peer
    would) until aborted or ``hold_s`` passed; it records when its body left the weights."""

    name = "holding"

    def __init__(self, *, touch: bool, hold_s: float = 8.0) -> None:
        self.touch, self.hold_s = touch, hold_s
        self.aborted = threading.Event()
        self.left_at: float | None = None

    async def connect(self, ctx: TransportContext) -> None:
        return None

    def abort(self) -> None:
        self.aborted.set()

    async def receive(self, ctx: TransportContext, version: int) -> RefitReport:
        return await ctx.blocking(self._body, ctx, version)

    def _body(self, ctx: TransportContext, version: int) -> RefitReport:
        try:
            ctx.touched = self.touch
            if self.touch:
                next(iter(ctx.params.values())).view(-1)[0] += 1.0
            if self.aborted.wait(self.hold_s):
                raise RefitAborted("aborted", transport=self.name)
            raise TransportError("no peer came", transport=self.name)
        finally:
            self.left_at = time.monotonic()


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", _ANYIO_BACKENDS)
@pytest.mark.parametrize("touch", [False, True], ids=["untouched", "touched"])
async def test_a_cancel_scope_aborts_a_refit_on_every_backend(anyio_backend, touch):
    params = {"w": torch.arange(8, dtype=torch.float32)}
    before = params["w"].clone()
    r = RolloutWorker(params=params, device="cpu", timeout_s=10.0)
    t = _HoldingTransport(touch=touch)
    try:
        await r.attach_transport(t)
        t0 = time.monotonic()
        with anyio.move_on_after(1.0) as scope:
            await r.refit("holding")
        returned = time.monotonic()
        assert scope.cancelled_caught
        assert returned - t0 < 1.0 + SLACK_S
        assert t.aborted.is_set() and t.left_at is not None and t.left_at <= returned  # left before return
        assert r.weight_version == 0 and r.torn is touch
        assert torch.equal(params["w"], before) is not touch  # torn iff a live byte changed
        if touch:
            with pytest.raises(TornWeights):
                r.weights()
        else:
            assert r.weights()["w"] is params["w"]
    finally:
        await r.shutdown()


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", _ANYIO_BACKENDS)
async def test_files_refit_is_cancelled_by_a_scope_then_the_next_commits(anyio_backend, tmp_path):
    from policyworker import TorchPolicyWorker
    from policyworker.models.toy_model import build_model

    config = get_preset(PRESET)
    trainer = TorchPolicyWorker(build_model(config, seed=0), device="cpu", timeout_s=30.0)
    names = dict(trainer.model.named_parameters())
    params = {n: torch.zeros_like(p.detach()) for n, p in names.items()}
    rollout = RolloutWorker(params=params, device="cpu", timeout_s=30.0)

    def set_weights(version: int) -> dict[str, torch.Tensor]:
        new = seeded_state_dict(config, seed=version, dtype=torch.float32)
        with torch.no_grad():
            for n, p in names.items():
                p.copy_(new[n])
        return new

    try:
        d = str(tmp_path / "files")
        async with anyio.create_task_group() as tg:  # the two sides meet at connect
            tg.start_soon(lambda: trainer.attach_transport("files", directory=d, timeout_s=8.0))
            tg.start_soon(lambda: rollout.attach_transport("files", directory=d, timeout_s=8.0))
        want = set_weights(1)
        await trainer.refit("files")
        await rollout.refit("files", refit_timeout_s=10.0)
        t0 = time.monotonic()
        with anyio.move_on_after(1.0) as scope:  # v2 is never written
            await rollout.refit("files")
        assert scope.cancelled_caught and time.monotonic() - t0 < 1.0 + SLACK_S
        assert rollout.weight_version == 1 and not rollout.torn
        assert all(same_bits(rollout.weights()[n], want[n]) for n in want)
        want = set_weights(2)
        await trainer.refit("files")
        await rollout.refit("files", refit_timeout_s=10.0)
        assert rollout.weight_version == 2 and all(same_bits(rollout.weights()[n], want[n]) for n in want)
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


# -- how processes end ------------------------------------------------------------------------


def _exit_body(role: str, update: int, stage: int, vocab: int, hidden: int, mid_transfer: bool) -> None:
    """One process of a trainer/rollout pair (tp=1 each) as a user would run it: a script whose
    main is ``asyncio.run``. ``mid_transfer``: the trainer (one bucket in flight) stalls at its
    3rd group wait, the rollout (16 in flight, so receives stay posted that no send will meet)
    prints ``bulk`` at its 4th (past the connect and the header) and holds there until its
    groups are aborted, so a signal sent then lands mid-transfer whatever the load; a clean run refits once, prints
    ``shutdown True`` and returns from main."""
    import dataclasses
    import sys

    from policyworker.runtime.comm import CommGroup

    torch.set_num_threads(1)
    config = dataclasses.replace(get_preset(PRESET), vocab_size=vocab, hidden_size=hidden)
    plan = build_plan(config, Parallelism.parse("tp=1"), "tp=1", 1, 1, dtype=torch.float32)
    real_wait, calls = CommGroup.wait, [0]

    def hold_at(k: int, say: str | None, cap_s: float):
        def wait(group, *args, **kwargs):
            calls[0] += 1
            if calls[0] == k:  # say so, then hold until this side's groups are aborted (cap_s at most)
                if say:
                    print(say, flush=True)
                until = time.monotonic() + cap_s
                while not group.aborted and time.monotonic() < until:
                    time.sleep(0.005)
            return real_wait(group, *args, **kwargs)

        return wait

    async def main() -> None:
        if role == "trainer":
            local = source_shards(plan, 0, seeded_state_dict(config, seed=1, dtype=torch.float32))
            w = ShardTrainer(local_params=local, source=config, rank=0, world_size=1, device="cpu", timeout_s=60)
            if mid_transfer:  # the trainer stalls after its first buckets: the rollout's later receives stay posted
                CommGroup.wait = hold_at(3, None, 10.0)
            await w.init_collective("127.0.0.1", update, 2, train_world_size=1)
            await w.init_nccl_reshard_comm_group(["127.0.0.1"], [stage], 1, 0, 2, 0)
            info = await w.prepare_nccl_reshard_refit_info(Parallelism.parse("tp=1"), "tp=1", 1, 1)
            await w.attach_transport("nccl_reshard", connect=False, plan=info, group=w.pp_comm_group, stage=0,
                                     in_flight=1)
            try:
                # The interrupted rollout's sockets close, but a send already handed to gloo
                # learns nothing of it: the trainer ends at its deadline (RefitTimeout).
                await w.nccl_reshard_refit(refit_timeout_s=6 if mid_transfer else 60)
            except PolicyWorkerError as exc:  # the rollout was interrupted: expected in that case
                print("trainer", type(exc).__name__, flush=True)
        else:
            w = RolloutWorker(rank=0, gen_world_size=1, device="cpu", timeout_s=60)
            await w.init_collective("127.0.0.1", update, 2, train_world_size=1)
            await w.init_nccl_reshard_comm_groups(["127.0.0.1"], [stage], [1])
            w.load_refit_plan(plan.refit_info())
            await w.attach_transport("nccl_reshard", connect=False, plan=plan, groups=w.stage_groups, in_flight=16)
            if mid_transfer:
                CommGroup.wait = hold_at(4, "bulk", 60.0)
            try:
                await w.receive_nccl_reshard_refit(refit_timeout_s=60)
                print("committed", flush=True)
            finally:
                print("shutdown", await w.shutdown(), flush=True)
            return
        print("shutdown", await w.shutdown(), flush=True)

    asyncio.run(main())
    sys.stdout.flush()


def _spawn_exit_body(role: str, update: int, stage: int, vocab: int, hidden: int, mid_transfer: bool = False):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import tests.test_failure_regressions as t; t._exit_body({role!r}, {update}, {stage}, {vocab}, {hidden}, {mid_transfer})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sigint_mid_transfer_exits_as_a_keyboard_interrupt_not_an_abort():
    import signal

    # 16384 x 1024 float32 embeddings and lm_head: ~135 MB in 16 MiB buckets; the signal lands
    # mid-transfer (the rollout never prints "committed") with receives still posted.
    update, stage = free_port(), free_port()
    trainer = _spawn_exit_body("trainer", update, stage, 16384, 1024, True)
    rollout = _spawn_exit_body("rollout", update, stage, 16384, 1024, True)
    try:
        assert rollout.stdout.readline().strip() == "bulk"
        rollout.send_signal(signal.SIGINT)
        r_out, r_err = rollout.communicate(timeout=120)
        t_out, t_err = trainer.communicate(timeout=120)
    finally:
        for p in (trainer, rollout):
            if p.poll() is None:
                p.kill()
    assert "committed" not in r_out, r_out  # interrupted mid-transfer
    assert "shutdown True" in r_out, (r_out, r_err[-3000:])  # the cancelled refit let shutdown run
    assert "KeyboardInterrupt" in r_err and "terminate called" not in r_err, r_err[-3000:]
    assert rollout.returncode == -signal.SIGINT, (rollout.returncode, r_err[-3000:])
    assert trainer.returncode == 0 and "shutdown True" in t_out, (trainer.returncode, t_out, t_err[-3000:])
    assert "terminate called" not in t_err, t_err[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_clean_shutdowns_exit_zero_every_time():
    pairs = []
    for _ in range(3):  # 6 processes at once
        update, stage = free_port(), free_port()
        pairs.append((_spawn_exit_body("trainer", update, stage, 256, 64),
                      _spawn_exit_body("rollout", update, stage, 256, 64)))
    outcomes = []
    try:
        for procs in pairs:
            for p in procs:
                out, err = p.communicate(timeout=180)
                outcomes.append((p.returncode, out, err[-2000:]))
    finally:
        for procs in pairs:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert all(code == 0 and "shutdown True" in out for code, out, _ in outcomes), outcomes
