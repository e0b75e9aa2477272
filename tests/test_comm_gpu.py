"""NCCL groups on one GPU (issue 14): the worker's own device, eager init, batched p2p,
abort on timeout, the event hand-off of the zmq GPU wait. Run on the device machine.

What one GPU can test: world-size-1 NCCL groups (a real communicator), device
selection under several CUDA_VISIBLE_DEVICES settings (in fresh processes), a
timeout that aborts the communicator and raises RefitTimeout without NCCL's watchdog
tearing the process down. The multi-GPU run is a separate issue.
"""

from __future__ import annotations

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


def _group(port_name: str = "g", **kw):
    from policyworker.runtime.procs import free_port
    from policyworker.runtime.comm import new_group

    return new_group(host="127.0.0.1", port=free_port(), rank=0, world_size=1, name=port_name, backend="nccl",
                     timeout_s=30, **kw)


@pytest.mark.timeout(120)
def test_world_size_one_nccl_group_uses_the_given_device_and_all_reduces():
    g = _group(device=torch.cuda.device_count() - 1)
    try:
        assert g.device == torch.device("cuda", torch.cuda.device_count() - 1)
        t = torch.arange(8, dtype=torch.float32, device=g.device)
        g.all_reduce(t, deadline=time.monotonic() + 30)
        assert torch.equal(t.cpu(), torch.arange(8, dtype=torch.float32))
        g.barrier(deadline=time.monotonic() + 30)
    finally:
        g.close()


@pytest.mark.timeout(120)
def test_group_device_is_fixed_not_the_issuing_threads_current_device():
    g = _group(device=0)
    seen: dict = {}

    def other_thread():
        # another thread with another current device would have fooled current_device()
        seen["device"] = g.device
        t = torch.ones(4, device=g.device)
        g.all_reduce(t, deadline=time.monotonic() + 30)
        seen["ok"] = bool(torch.equal(t.cpu(), torch.ones(4)))

    try:
        th = threading.Thread(target=other_thread)
        th.start()
        th.join(60)
        assert seen == {"device": torch.device("cuda", 0), "ok": True}
    finally:
        g.close()


@pytest.mark.timeout(120)
def test_batch_isend_irecv_to_self_moves_bytes_exactly():
    g = _group(device=0)
    try:
        src = torch.arange(1024, dtype=torch.int32, device=g.device)
        dst = torch.zeros_like(src)
        works = g.batch_isend_irecv([("send", src, 0), ("recv", dst, 0)])
        g.wait_all(works, deadline=time.monotonic() + 30)
        torch.cuda.synchronize(g.device)
        assert torch.equal(dst.cpu(), src.cpu())
    finally:
        g.close()


@pytest.mark.timeout(120)
def test_timeout_aborts_the_communicator_and_raises_refit_timeout():
    from policyworker.errors import RefitTimeout

    before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    g = _group(device=0)
    try:
        buf = torch.zeros(16, device=g.device)
        # NCCL's stream waits on the current stream: a long kernel there keeps the
        # all_reduce from finishing (what a dead peer looks like: a work that never
        # completes, no error). The deadline must end it by aborting the communicator.
        torch.cuda._sleep(int(5e9))
        t0 = time.monotonic()
        with pytest.raises(RefitTimeout, match="communicator was aborted"):
            g.all_reduce(buf, deadline=time.monotonic() + 0.3)
        assert time.monotonic() - t0 < 10
        assert g.aborted
    finally:
        g.close()
    torch.cuda.synchronize()
    # Our groups are built at CleanUpOnly; the process's own setting is left as it was.
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == before


_CHILD = r"""
import json, sys, torch
from policyworker.runtime.comm import nccl_device
from policyworker.errors import ConfigError
out = {"count": torch.cuda.device_count(), "default": str(nccl_device(None)), "last": str(nccl_device(torch.cuda.device_count() - 1))}
try:
    nccl_device(torch.cuda.device_count())
except ConfigError as e:
    out["beyond"] = "ConfigError"
try:
    nccl_device("cpu")
except ConfigError:
    out["cpu"] = "ConfigError"
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("visible", [None, "0"])
def test_device_selection_under_visible_device_settings(visible):
    import json

    env = dict(os.environ)
    if visible is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["count"] >= 1
    if visible == "0":
        assert out["count"] == 1 and out["last"] == "cuda:0"
    assert out["default"] == "cuda:0" and out["beyond"] == "ConfigError" and out["cpu"] == "ConfigError"


@pytest.mark.timeout(60)
def test_zmq_gpu_wait_is_an_event_on_the_current_stream_and_abortable():
    from policyworker.errors import RefitAborted
    from policyworker.transports.zmq.program import _sync

    dev = torch.device("cuda", 0)
    a = torch.randn(2048, 2048, device=dev)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):  # a long kernel on another stream: not ours to wait for
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
    x = torch.ones(4, device=dev) * 3
    _sync(dev)  # returns once the current stream's work is done
    assert torch.equal(x.cpu(), torch.full((4,), 3.0))

    class Chan:
        def _check_abort(self, what):
            raise RefitAborted(what)

    y = torch.randn(4096, 4096, device=dev)
    for _ in range(10):
        y = y @ y
    with pytest.raises(RefitAborted):
        _sync(dev, Chan())  # an abort reaches a GPU wait that has not finished
    torch.cuda.synchronize(dev)
