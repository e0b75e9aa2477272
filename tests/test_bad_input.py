"""Bad input catalogue: every public entry point, fed garbage, answers with a typed,
clear error and leaves the worker exactly as it was."""

from __future__ import annotations

import copy
import math
import socket

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker import ConfigError, PlanError, PlanMismatch, PolicyWorkerError, ProtocolError, RolloutWorker, TorchPolicyWorker, TransportLoadError
from policyworker.registry import TransportRegistry
from policyworker.layout import ReshardPlan, build_plan
from policyworker.models import get_preset
from policyworker.models.toy_model import build_model
from policyworker.transports.nccl_reshard.transport import NcclReshardTransport
from policyworker.transports.nccl_reshard.schedule import _buckets
from policyworker.runtime.watchdog import RefitWatchdog
from policyworker.wire import Decoder, Message

pytestmark = pytest.mark.anyio

TINY = get_preset("tiny")


def _state(w) -> dict:
    """What must not change when a call is refused."""
    return {
        "transport_state": {k: dict(v) for k, v in w._transport_state.items()},
        "update_group": w.model_update_group,
        "pp_group": getattr(w, "pp_comm_group", None),
        "alive": w.is_alive(),
        "params": {k: v.clone() for k, v in getattr(w, "params", {}).items()},
        "version": getattr(w, "weight_version", None),
    }


def _same(a: dict, b: dict) -> bool:
    return (a["transport_state"].keys() == b["transport_state"].keys()
            and all(a["transport_state"][k] == b["transport_state"][k] for k in a["transport_state"])
            and a["update_group"] is b["update_group"] and a["pp_group"] is b["pp_group"]
            and a["alive"] == b["alive"] and a["version"] == b["version"]
            and a["params"].keys() == b["params"].keys()
            and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]))


@pytest.fixture
async def trainer():
    w = TorchPolicyWorker(build_model(TINY, seed=0), rank=0, world_size=2, device="cpu", timeout_s=5)
    yield w
    await w.shutdown()


@pytest.fixture
async def rollout():
    w = RolloutWorker(rank=0, gen_world_size=2, device="cpu", timeout_s=5)
    yield w
    await w.shutdown()


BAD_TIMEOUTS = [0, -1, float("nan"), float("inf"), "3", True]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
async def test_bad_refit_timeouts(trainer, rollout, bad):
    for w, call in ((trainer, lambda: trainer.nccl_reshard_refit(refit_timeout_s=bad)),
                    (rollout, lambda: rollout.receive_nccl_reshard_refit(refit_timeout_s=bad))):
        before = _state(w)
        with pytest.raises(ConfigError, match="refit_timeout_s"):
            await call()
        assert _same(before, _state(w))


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_bad_worker_and_watchdog_timeouts(bad):
    with pytest.raises(ConfigError):
        RolloutWorker(device="cpu", timeout_s=bad)
    with pytest.raises(ConfigError):
        RefitWatchdog().arm(bad)


@pytest.mark.parametrize("scales", [{"k": float("nan")}, {"k": math.inf}, {1: 1.0}, {"k": "x"}, [("k", 1.0)], {"k": True}])
async def test_bad_kv_scales(trainer, scales):
    await trainer.prepare_nccl_reshard_refit_info("tp=2", "tp=2", 2, 2)
    before = _state(trainer)
    with pytest.raises(ConfigError, match="kv_scales"):
        await trainer.nccl_reshard_refit(kv_scales=scales)
    assert _same(before, _state(trainer))


@pytest.mark.parametrize(
    "args, kind",
    [
        (("tp=3", "tp=1", 3, 1), PlanError),  # tp does not divide 4 heads
        (("tp=2", "tp=1", 4, 1), ConfigError),  # world size != tp*pp*dp
        (("tp=2", "tp=1", 2, 3), ConfigError),
        (("tp=1,ep=3", "tp=1", 1, 1), ConfigError),  # ep does not divide dp*tp
        (("tp=0", "tp=1", 0, 1), ConfigError),
        (("bogus=2", "tp=1", 2, 1), ConfigError),
        ((None, "tp=1", 2, 1), ConfigError),
    ],
)
async def test_bad_layouts(trainer, args, kind):
    before = _state(trainer)
    with pytest.raises(kind) as info:
        await trainer.prepare_nccl_reshard_refit_info(*args)
    assert str(info.value)
    assert _same(before, _state(trainer))


def test_ep_not_dividing_experts_and_unknown_params():
    with pytest.raises(PlanError, match="ep"):
        build_plan(get_preset("tiny-moe"), "dp=3,ep=3", "tp=1", 3, 1)
    specs = {"model.layers.0.mystery.weight": ((4, 4), torch.float32)}
    with pytest.raises(PlanError, match="mystery"):
        build_plan(specs, "tp=1", "tp=1", 1, 1)


async def test_a_model_whose_tensors_do_not_fit_the_plan():
    model = build_model(TINY, seed=0)
    wrong = {n: torch.zeros(3, 3) for n, _ in model.named_parameters()}
    w = TorchPolicyWorker(model, device="cpu", refit_params=wrong, refit_source=TINY)
    before = _state(w)
    with pytest.raises(ConfigError, match="the plan says"):
        await w.prepare_nccl_reshard_refit_info("tp=1", "tp=1", 1, 1)
    assert _same(before, _state(w))
    await w.shutdown()


async def test_rollout_refuses_plans_that_do_not_fit(rollout):
    good = build_plan(TINY, "tp=2", "tp=2", 2, 2, dtype=torch.float32)
    before = _state(rollout)
    other_world = build_plan(TINY, "tp=2", "tp=1", 2, 1, dtype=torch.float32)
    with pytest.raises(ConfigError, match="generation ranks"):
        rollout.load_refit_plan(other_world.refit_info())
    tampered = good.refit_info()
    tampered["hash"] = "0" * 64
    with pytest.raises(PlanMismatch):
        rollout.load_refit_plan(tampered)
    with pytest.raises(PlanError):
        rollout.load_refit_plan({"params": "nonsense"})
    with pytest.raises(ConfigError):
        rollout.load_refit_plan(42)  # type: ignore[arg-type]
    # dtype and shape mismatches of given params
    params = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in good.local_tensors("dst", 0).items()}
    with pytest.raises(ConfigError, match="float64"):
        rollout.load_refit_plan(good, params=params)
    params = {k: torch.zeros(1) for k in good.local_tensors("dst", 0)}
    with pytest.raises(ConfigError, match="the plan says"):
        rollout.load_refit_plan(good, params=params)
    assert _same(before, _state(rollout))


async def test_refit_before_setup_is_a_config_error(trainer, rollout):
    for call, what in ((trainer.nccl_reshard_refit, "prepare_nccl_reshard_refit_info"),
                       (rollout.receive_nccl_reshard_refit, "load_refit_plan")):
        with pytest.raises(ConfigError, match=what):
            await call()


async def test_a_port_already_in_use(trainer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        before = _state(trainer)
        with pytest.raises(ConfigError, match="already in use"):
            await trainer.init_collective("127.0.0.1", s.getsockname()[1], 3, train_world_size=2)
        assert _same(before, _state(trainer))


@pytest.mark.parametrize("port", [0, -5, 70000, "29500", None])
async def test_bad_ports(trainer, port):
    with pytest.raises(ConfigError, match="port"):
        await trainer.init_collective("127.0.0.1", port, 3, train_world_size=2)
    assert trainer.model_update_group is None


def test_unknown_and_broken_transports():
    import importlib.metadata as md

    with pytest.raises(ConfigError, match="unknown transport"):
        TransportRegistry([]).load("carrier-pigeon")
    ep = md.EntryPoint(name="broken", value="no_such_module_at_all:T", group="policyworker.transports")
    with pytest.raises(TransportLoadError, match="broken"):
        TransportRegistry([ep]).load("broken")


@pytest.mark.parametrize("kwargs", [dict(bucket_bytes=100), dict(bucket_bytes=2.5), dict(in_flight=0),
                                    dict(staging=-1), dict(bucket_bytes=True)])
def test_bad_transport_options(kwargs):
    with pytest.raises(ConfigError):
        NcclReshardTransport(**kwargs)


def test_tensors_larger_than_a_bucket_are_split_and_rows_larger_than_a_bucket_go_alone():
    plan = build_plan(TINY, "tp=1", "tp=1", 1, 1, dtype=torch.float32)
    (t,) = plan.transfers
    msgs = _buckets(plan, t.copies, 1024)  # embed rows are 64 * 4 = 256 B; whole tensors are 64 KiB
    sizes = [sum(math.prod(b - a for a, b in zip(c.start, c.stop)) * 4 for c in m) for m in msgs]
    assert sum(sizes) == t.nbytes
    assert max(sizes) <= 1024
    # a bucket smaller than one row (256 B): each row travels alone, nothing is lost
    msgs = _buckets(plan, t.copies, 100)
    sizes = [sum(math.prod(b - a for a, b in zip(c.start, c.stop)) * 4 for c in m) for m in msgs]
    assert sum(sizes) == t.nbytes
    assert all(len(m) == 1 and m[0].stop[0] - m[0].start[0] == 1 for m, n in zip(msgs, sizes) if n > 100)


class _Ping(Message, tag="Ping"):
    seq: int
    name: str


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_malformed_wire_bytes_are_protocol_errors(data):
    dec = Decoder(_Ping)
    try:
        msg = dec.decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, _Ping)  # whatever decodes is a well-typed message


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=10**6), st.text(max_size=20), st.data())
def test_truncated_wire_messages_are_protocol_errors(seq, name, data):
    raw = msgspec.msgpack.encode(_Ping(seq=seq, name=name))
    cut = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
    with pytest.raises(ProtocolError):
        Decoder(_Ping).decode(raw[:cut])


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=256))
def test_garbage_plans_are_plan_errors(data):
    try:
        ReshardPlan.from_wire(data)
    except PlanError:
        return
    except PolicyWorkerError as exc:  # pragma: no cover - any other error type is a bug
        pytest.fail(f"untyped plan error {exc!r}")


def test_truncated_plan_is_a_plan_error():
    raw = build_plan(TINY, "tp=2", "tp=1", 2, 1).to_wire()
    for cut in (0, 1, len(raw) // 2, len(raw) - 1):
        with pytest.raises(PlanError):
            ReshardPlan.from_wire(raw[:cut])


def test_state_snapshot_helper_detects_changes():
    a = {"transport_state": {"x": {"a": 1}}, "update_group": None, "pp_group": None, "alive": True,
         "params": {"w": torch.zeros(2)}, "version": 0}
    b = copy.deepcopy(a)
    assert _same(a, b)
    b["params"]["w"][0] = 1
    assert not _same(a, b)


# -- resource limits are errors, not crashes (issue 14) --------------------------------
def test_shm_too_small_is_a_config_error_with_needed_and_available(monkeypatch):
    import os as _os

    from policyworker.transports import ipc_handles

    real = _os.statvfs

    def tiny_mount(path):
        st = real(path)
        # a 64 MB container mount with 1 MiB left
        return _os.statvfs_result((st.f_bsize, 4096, 16384, 256, 256, *tuple(st)[5:]))

    monkeypatch.setattr(_os, "statvfs", tiny_mount)  # ipc_handles reads os.statvfs at call time
    t = torch.zeros(1 << 20)  # 4 MiB of float32
    before = t.untyped_storage().data_ptr()
    with pytest.raises(ConfigError) as info:
        ipc_handles.share_cpu(t)
    msg = str(info.value)
    assert f"needs {4 << 20} bytes" in msg and f"only {256 * 4096} are free" in msg
    assert t.untyped_storage().data_ptr() == before and not t.untyped_storage().is_shared()
    with pytest.raises(ConfigError, match="needs .* bytes"):
        ipc_handles.flatten_into([torch.zeros(1 << 20), torch.zeros(10)], device=torch.device("cpu"),
                                 shared_cpu=True)


def test_shm_space_check_passes_when_it_fits():
    from policyworker.transports import ipc_handles

    t = torch.arange(16, dtype=torch.float32)
    assert ipc_handles.share_cpu(t) in (True, False)
    assert t.untyped_storage().is_shared() and torch.equal(t, torch.arange(16, dtype=torch.float32))


def test_ipc_socket_path_over_the_platform_limit_is_refused_at_maybe_init_zmq(tmp_path):
    from policyworker.transports.zmq.channel import IPC_PATH_MAX

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    w = RolloutWorker(rank=0, gen_world_size=1, device="cpu", runtime_dir=deep)
    assert len(w.get_zmq_address()) - len("ipc://") > IPC_PATH_MAX
    before = _state(w)
    with pytest.raises(ConfigError, match=f"platform limit is {IPC_PATH_MAX}"):
        w.maybe_init_zmq()
    assert w.zmq_socket is None
    assert _state(w)["transport_state"].get("zmq", {}).get("socket") is None
    assert before["alive"] and w.is_alive()


@pytest.mark.timeout(60)
def test_store_connect_timeout_names_the_address_and_prints_no_cpp_frames():
    import subprocess
    import sys

    from policyworker.runtime.procs import free_port

    port = free_port()
    code = (
        "from policyworker.runtime.comm import new_group\n"
        "from policyworker.errors import RefitTimeout, PeerLost\n"
        f"try:\n    new_group(host='127.0.0.1', port={port}, rank=1, world_size=2, name='model_update', timeout_s=1)\n"
        "except (RefitTimeout, PeerLost) as e:\n    print('TYPED', type(e).__name__, e)\n"
        f"try:\n    new_group(host='127.0.0.1', port={port}, rank=0, world_size=2, name='model_update', timeout_s=1)\n"
        "except (RefitTimeout, PeerLost) as e:\n    print('TYPED', type(e).__name__, e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    out = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TYPED")]
    assert len(lines) == 2, out
    assert f"127.0.0.1:{port}" in lines[0] and "rank 0 (the store's host) is missing" in lines[0]
    assert "rank(s) [1] of 2 did not join" in lines[1]
    assert "frame #" not in out and "Exception raised from" not in out, out


def test_free_ports_are_distinct_even_from_a_narrow_range(monkeypatch):
    # Two draws from a narrow slice would often collide; free_ports never hands one out twice.
    from policyworker.runtime.procs import free_ports

    monkeypatch.setenv("POLICYWORKER_PORTS", "24000:24004")
    for _ in range(20):
        ports = free_ports(3)
        assert len(set(ports)) == 3, ports



def test_free_port_does_not_repeat_its_recent_draws(monkeypatch):
    # Two free_port() calls for one world (its update and stage ports) must not collide: 200
    # draws from 600 ports would repeat one ~33 times over if drawn independently.
    from policyworker.runtime.procs import free_port

    monkeypatch.setenv("POLICYWORKER_PORTS", "24000:24600")
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200 and all(24000 <= p < 24600 for p in ports)
