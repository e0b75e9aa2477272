"""AbstractPolicyWorker's surface and the shared core (single process)."""

import asyncio
import inspect
import os
import stat
import threading
import time

import pytest
import zmq

from policyworker import AbstractPolicyWorker, ConfigError, RolloutWorker, WorkerClosed
from policyworker.workers.core import private_runtime_dir

from .helpers import BareWorker

pytestmark = pytest.mark.anyio

# DESIGN §2, name for name: (name, is_async, parameters as "name" / "*name=default" for keyword-only)
SEED_SURFACE = {
    "init_collective": (True, ["ip", "port", "world_size", "*train_world_size", "*nccl_peer='nemo'"]),
    "init_nccl_reshard_comm_group": (True, ["pp_ips", "pp_ports", "pp_size", "my_pp_stage", "sub_world_size", "my_rank_in_group"]),
    "prepare_nccl_reshard_refit_info": (True, ["train_parallelism", "gen_parallelism", "train_world_size", "gen_world_size"]),
    "nccl_reshard_refit": (True, ["kv_scales=None", "refit_timeout_s=None"]),
    "_refit_transport_state": (False, ["key"]),
    "connect_sglang_rollout_engines": (True, ["*engine_gpu_counts", "*engine_gpu_offsets=None"]),
    "stand_down_refit_watchdog": (False, []),
    "is_alive": (False, []),
    "reset_peak_memory_stats": (False, []),
    "get_gpu_info": (False, []),
    "report_device_id": (False, []),
    "get_zmq_address": (False, []),
    "maybe_init_zmq": (False, []),
    "get_free_memory_bytes": (False, []),
    "shutdown": (True, []),
    "start_gpu_profiling": (False, []),
    "stop_gpu_profiling": (False, []),
    "report_node_ip_and_gpu_id": (False, []),
    "get_reference_policy_logprobs": (True, ["*data", "*micro_batch_size=None"]),
    "finalize_async_save": (True, []),
    "finish_training": (True, ["args", "kwargs"]),
}


def _describe(fn):
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        text = p.name
        if p.default is not inspect.Parameter.empty:
            text += f"={p.default!r}"
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            text = "*" + text
        out.append(text)
    return out


@pytest.mark.parametrize("name", sorted(SEED_SURFACE))
def test_seed_surface_matches_design(name):
    is_async, params = SEED_SURFACE[name]
    fn = getattr(AbstractPolicyWorker, name)
    assert inspect.iscoroutinefunction(fn) is is_async, name
    assert _describe(fn) == params


def test_training_chores_stay_abstract_and_no_transport_mixins_remain():
    assert {"get_reference_policy_logprobs"} <= AbstractPolicyWorker.__abstractmethods__
    assert "nccl_reshard_refit" not in AbstractPolicyWorker.__abstractmethods__  # a shim over refit()
    with pytest.raises(TypeError):
        AbstractPolicyWorker()  # type: ignore[abstract]
    from policyworker import TorchPolicyWorker

    for cls in (TorchPolicyWorker, RolloutWorker):
        bases = [c.__module__ for c in cls.__mro__]
        assert all("transports" not in m and "mixin" not in m.lower() for m in bases), bases


async def test_transport_state_is_lazy_and_per_key():
    w = BareWorker(device="cpu")
    assert w._transport_state == {}
    a = w._refit_transport_state("zmq")
    assert w._refit_transport_state("zmq") is a
    b = w._refit_transport_state("nccl_reshard")
    assert b is not a and a == {} and b == {}
    a["x"] = 1
    assert w._refit_transport_state("zmq")["x"] == 1 and "x" not in b
    with pytest.raises(ConfigError):
        w._refit_transport_state("")
    await w.shutdown()


async def test_zmq_address_pairs_colocated_peers_under_a_private_dir():
    trainer = BareWorker(rank=0, world_size=2, device="cpu", cpu_index=1)
    rollout = RolloutWorker(rank=0, device="cpu", cpu_index=1)
    other = RolloutWorker(rank=0, device="cpu", cpu_index=0)
    addr = trainer.get_zmq_address()
    assert addr == rollout.get_zmq_address() != other.get_zmq_address()
    directory = os.path.dirname(addr.removeprefix("ipc://"))
    st = os.stat(directory)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    for w in (trainer, rollout, other):
        await w.shutdown()


async def test_maybe_init_zmq_is_idempotent_and_bounded():
    trainer = BareWorker(device="cpu", zmq_timeout_s=0.2)
    trainer.maybe_init_zmq()
    sock = trainer.zmq_socket
    trainer.maybe_init_zmq()
    assert trainer.zmq_socket is sock
    assert sock.getsockopt(zmq.LINGER) == 0
    assert sock.getsockopt(zmq.SNDTIMEO) == 200 and sock.getsockopt(zmq.RCVTIMEO) == 200
    rollout = RolloutWorker(device="cpu")
    rollout.maybe_init_zmq()
    rollout.zmq_socket.send(b"ping")
    assert trainer.zmq_socket.recv() == b"ping"
    t0 = time.monotonic()
    with pytest.raises(zmq.Again):
        trainer.zmq_socket.recv()  # nothing sent: bounded by RCVTIMEO, no hang
    assert time.monotonic() - t0 < 2.0
    assert await trainer.shutdown() is True
    assert trainer.zmq_socket is None
    await rollout.shutdown()


async def test_shutdown_is_safe_twice_and_closes_the_worker():
    w = BareWorker(device="cpu")
    assert w.is_alive()
    assert await w.shutdown() is True
    assert await w.shutdown() is True
    assert not w.is_alive()
    with pytest.raises(WorkerClosed):
        w.maybe_init_zmq()
    with pytest.raises(WorkerClosed):
        await w.init_collective("127.0.0.1", 29500, 2, train_world_size=1)


async def test_unknown_nccl_peer_lists_supported():
    w = BareWorker(device="cpu")
    with pytest.raises(ConfigError, match="supported: nemo"):
        await w.init_collective("127.0.0.1", 29500, 2, train_world_size=1, nccl_peer="mpi")
    await w.shutdown()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(world_size=0, train_world_size=1),
        dict(world_size=2, train_world_size=3),
        dict(world_size=2, train_world_size=0),
        dict(world_size="2", train_world_size=1),
    ],
)
async def test_bad_world_sizes_are_config_errors(kwargs):
    w = BareWorker(device="cpu")
    kwargs = dict(kwargs)
    ws = kwargs.pop("world_size")
    with pytest.raises(ConfigError):
        await w.init_collective("127.0.0.1", 29500, ws, **kwargs)
    assert w.model_update_group is None
    await w.shutdown()


@pytest.mark.parametrize(
    "args",
    [
        (["a"], [1, 2], 2, 0, 3, 0),  # lengths differ from pp_size
        (["a", "b"], [1, 2], 2, 2, 3, 0),  # stage out of range
        (["a", "b"], [1, 2], 2, 0, 3, 3),  # rank outside group
        (["a", "b"], [1, 2], 0, 0, 3, 0),  # pp_size 0
    ],
)
async def test_bad_reshard_group_args_are_config_errors(args):
    w = BareWorker(device="cpu")
    with pytest.raises(ConfigError):
        await w.init_nccl_reshard_comm_group(*args)
    assert w.pp_comm_group is None
    await w.shutdown()


def test_bad_constructor_args():
    with pytest.raises(ConfigError):
        BareWorker(rank=2, world_size=2, device="cpu")
    with pytest.raises(ConfigError):
        BareWorker(timeout_s=0, device="cpu")
    with pytest.raises(ConfigError):
        BareWorker(rank=-1, device="cpu")


def test_runtime_dir_refuses_a_shared_directory(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ConfigError, match="0700"):
        private_runtime_dir(shared)
    fresh = tmp_path / "fresh"
    assert private_runtime_dir(fresh) == str(fresh)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700


async def test_stand_down_answers_from_the_loop_while_a_refit_blocks_the_executor():
    w = BareWorker(device="cpu")
    release = threading.Event()
    from policyworker.runtime.watchdog import process_watchdog

    deadline = process_watchdog().arm(30.0, [release.set], label="stuck", owner=w)
    blocked = asyncio.ensure_future(w._run(release.wait, 10.0))
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    count = w.stand_down_refit_watchdog()
    alive = w.is_alive()
    addr = w.get_zmq_address()
    elapsed = time.perf_counter() - t0
    release.set()
    await blocked
    assert count >= 1 and deadline.stood_down and alive and addr.startswith("ipc://")
    assert elapsed < 1e-3, f"{elapsed * 1e3:.3f} ms"
    await w.shutdown()


async def test_device_facts_on_the_worker():
    w = BareWorker(rank=1, world_size=2, device="cpu")
    info = w.get_gpu_info()
    for key in ("rank", "device", "name", "memory_allocated_bytes", "memory_reserved_bytes",
                "peak_memory_bytes", "cuda_visible_devices", "device_id", "free_memory_bytes"):
        assert key in info, key
    assert info["rank"] == 1 and info["device"] == "cpu"
    assert w.report_device_id() == info["device_id"]
    ip, idx = w.report_node_ip_and_gpu_id()
    assert isinstance(ip, str) and idx == 1
    assert w.get_free_memory_bytes() > 0
    w.reset_peak_memory_stats()
    w.start_gpu_profiling()
    sum(range(1000))
    path = w.stop_gpu_profiling()
    assert path and os.path.exists(path) and path.startswith(w.runtime_dir)
    await w.shutdown()
