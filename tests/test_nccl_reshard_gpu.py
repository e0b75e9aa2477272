"""nccl_reshard on one GPU (issue 14.4): what a single device can prove.

NCCL cannot put two ranks on one GPU, so the two-sided refit itself needs the
multi-GPU issue. What one GPU does test, with real NCCL communicators of world size 1:

* the group's communicator exists when the group does (eager init, no lazy pair
  communicator), and single sends/receives are batches on it;
* workers build their groups on their own device, with the backend of that device,
  under several ``CUDA_VISIBLE_DEVICES`` settings (fresh processes);
* headers and verdicts are read from the GPU through one event on the current
  stream: a long kernel on another stream does not hold them up, an abort or the
  deadline cuts them short;
* the refit runs on the transport's own stream and hands its results to the consumer
  through an event (no host wait, no ``torch.cuda.synchronize``), and
  ``RolloutWorker.weights()`` makes the reading stream wait on it;
* our groups are built with NCCL's error handling at CleanUpOnly, whatever the
  process's ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says, which stays as the user set it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# ~1-2 s of GPU time on an H200 (torch.cuda._sleep spins for a number of cycles).
_LONG = int(2e9)


def _group(name: str = "g", **kw):
    from policyworker.runtime.procs import free_port
    from policyworker.runtime.comm import new_group

    return new_group(host="127.0.0.1", port=free_port(), rank=0, world_size=1, name=name, timeout_s=30, **kw)


@pytest.mark.timeout(120)
def test_the_communicator_exists_at_construction_and_p2p_runs_on_it():
    g = _group(device=0)
    try:
        assert g.backend == "nccl" and g.device == torch.device("cuda", 0)
        initialized = getattr(g.pg, "_is_initialized", None)
        if initialized is not None:
            assert initialized()  # eager: created with the group, before any op
        src = torch.arange(4096, dtype=torch.int64, device=g.device)
        dst = torch.zeros_like(src)
        works = g.batch_isend_irecv([("send", src, 0, 7), ("recv", dst, 0, 7)])
        assert len(works) == 2 and works[0] is works[1]  # one coalesced NCCL call
        g.wait_all(works, deadline=time.monotonic() + 30)
        assert torch.equal(g.read(dst, deadline=time.monotonic() + 30), src.cpu())
    finally:
        g.close()


@pytest.mark.timeout(120)
def test_our_groups_clean_up_only_and_the_users_setting_stays():
    before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"  # a user's "tear down on error"
    try:
        from policyworker.errors import RefitTimeout

        g = _group(device=0)
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
        try:
            buf = torch.zeros(16, device=g.device)
            torch.cuda._sleep(_LONG)  # what a dead peer looks like: a work that never completes
            with pytest.raises(RefitTimeout, match="communicator was aborted"):
                g.all_reduce(buf, deadline=time.monotonic() + 0.3)
            assert g.aborted
        finally:
            g.close()
        torch.cuda.synchronize()
        time.sleep(1.0)  # the watchdog had its chance to act on the aborted communicator
        assert torch.ones(1, device="cuda").item() == 1.0  # the process and its CUDA context live on
    finally:
        if before is None:
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before


@pytest.mark.timeout(120)
def test_a_header_read_does_not_wait_for_other_streams():
    g = _group(device=0)
    try:
        side = torch.cuda.Stream(g.device)
        with torch.cuda.stream(side):
            torch.cuda._sleep(_LONG)  # an unrelated long kernel: a device sync would wait for it
        header = torch.arange(6, dtype=torch.int64, device=g.device)
        t0 = time.monotonic()
        host = g.read(header, deadline=time.monotonic() + 30)
        quick = time.monotonic() - t0
        assert host.tolist() == list(range(6)) and host.device.type == "cpu"
        assert not side.query()  # the long kernel was still running when the read returned
        assert quick < 0.5
        side.synchronize()
    finally:
        g.close()


@pytest.mark.timeout(120)
def test_a_read_is_cut_short_by_the_deadline_and_by_an_abort():
    from policyworker.errors import RefitAborted, RefitTimeout

    g = _group(device=0)
    try:
        t = torch.ones(6, dtype=torch.int64, device=g.device)
        torch.cuda._sleep(_LONG)  # the current stream is busy: the read's event cannot complete
        with pytest.raises(RefitTimeout):
            g.read(t, deadline=time.monotonic() + 0.2)
        torch.cuda._sleep(_LONG)
        threading.Timer(0.2, g.abort).start()
        with pytest.raises(RefitAborted):
            g.read(t, deadline=time.monotonic() + 30)
        torch.cuda.synchronize()
    finally:
        g.close()


@pytest.mark.timeout(120)
def test_the_refit_runs_on_the_transports_stream_and_hands_over_an_event():
    from policyworker import RolloutWorker
    from policyworker.transports.base import RefitReport, TransportContext
    from policyworker.transports.nccl_reshard.transport import NcclReshardTransport

    g = _group(device=0)
    w = RolloutWorker(rank=0, gen_world_size=1, device="cuda:0",
                      params={"w": torch.zeros(1 << 20, device="cuda:0")})
    try:
        ctx = TransportContext(worker=w, role="receive", rank=0, device=w.device_facts, state={"groups": {0: g}},
                               params=w.params)
        t = NcclReshardTransport()
        seen = {}

        def body(ctx, version):
            seen["stream"] = torch.cuda.current_stream(g.device)
            torch.cuda._sleep(_LONG)  # a slow last unpack
            ctx.params["w"].fill_(7.0)
            return RefitReport(transport="nccl_reshard", role="receive", version=1, bytes=4 << 20, seconds=0.0)

        t._refit_body = body
        t0 = time.monotonic()
        t._refit(ctx, 1)
        returned = time.monotonic() - t0
        assert seen["stream"] == ctx.state["stream"] != torch.cuda.default_stream(g.device)
        assert ctx.ready is not None and not ctx.ready.query()  # handed over before the GPU finished
        assert returned < 0.5  # no host wait for the GPU
        w._ready = ctx.ready  # what the road's _after_refit does after the commit
        weights = w.weights()  # the default stream now waits on the event (on the GPU)
        total = weights["w"].sum()  # queued on the default stream, after the event
        assert total.item() == 7.0 * (1 << 20)
    finally:
        g.close()


_CHILD = r"""
import json, sys, torch
from policyworker import RolloutWorker
from policyworker.runtime.procs import free_port
from policyworker.runtime.comm import backend_for, new_group
from policyworker.errors import ConfigError
out = {"count": torch.cuda.device_count(), "cpu_backend": backend_for("cpu"), "default": backend_for(None)}
if torch.cuda.device_count():
    w = RolloutWorker(rank=0, gen_world_size=1, device=f"cuda:{torch.cuda.device_count() - 1}")
    g = new_group(host="127.0.0.1", port=free_port(), rank=0, world_size=1, name="v", timeout_s=30, device=w.device)
    init = getattr(g.pg, "_is_initialized", None)
    out["group"] = [g.backend, str(g.device), bool(init()) if init is not None else True]
    g.close()
c = new_group(host="127.0.0.1", port=free_port(), rank=0, world_size=1, name="c", timeout_s=30, device="cpu")
out["cpu_group"] = c.backend
c.close()
try:
    new_group(host="127.0.0.1", port=free_port(), rank=0, world_size=1, name="x", timeout_s=5,
              device=torch.device("cuda", torch.cuda.device_count()))
except ConfigError:
    out["beyond"] = "ConfigError"
print(json.dumps(out))
"""


def _uuid0() -> str | None:
    """GPU 0's uuid as CUDA_VISIBLE_DEVICES takes it ("GPU-…"), from nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("GPU-")]
    return lines[0] if lines else None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("visible", [None, "0", "uuid", ""])
def test_worker_groups_follow_the_workers_device_under_visible_device_settings(visible):
    env = dict(os.environ)
    if visible is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    elif visible == "uuid":
        uuid = _uuid0()
        if uuid is None:
            pytest.skip("nvidia-smi gives no device uuid here")
        env["CUDA_VISIBLE_DEVICES"] = uuid
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["cpu_backend"] == "gloo" and out["cpu_group"] == "gloo" and out["beyond"] == "ConfigError"
    if visible == "":
        assert out["count"] == 0 and out["default"] == "gloo" and "group" not in out
    else:
        last = out["count"] - 1
        assert out["count"] >= 1 and out["default"] == "nccl"
        assert out["group"] == ["nccl", f"cuda:{last}", True]
        if visible in ("0", "uuid"):
            assert out["count"] == 1
