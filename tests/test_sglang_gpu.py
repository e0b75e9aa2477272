"""sglang_ipc on a CUDA GPU: CUDA IPC buffer handles, refits into an in-process engine, bit-exact."""

from __future__ import annotations

import pytest
import torch

from policyworker.runtime.procs import free_port, run_world
from policyworker.transports.sglang_ipc import format as fmt

from .sglang_world import SglangSpec, sglang_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_processs_own_cuda_handle_opens_as_its_buffer_and_is_freed():
    dev = torch.device("cuda:0")
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    buf, handle = fmt.export_buffer(3 << 20, dev)
    assert isinstance(handle, fmt.CudaIpcHandle) and handle.nbytes == 3 << 20
    opened = fmt.open_buffer(handle)  # the driver would refuse our own handle: we get the buffer back
    assert opened.data_ptr() == buf.data_ptr() and opened.numel() == buf.numel()
    buf.fill_(7)
    assert int(opened[-1]) == 7
    del buf, opened
    torch.cuda.synchronize(dev)
    # Not kept "in limbo" by torch's IPC bookkeeping: the block went back to the allocator.
    assert torch.cuda.memory_allocated(dev) == before


def _run(spec: SglangSpec) -> list[dict]:
    spec.port = free_port()
    return run_world(sglang_rank, spec.world, (spec,), timeout_s=120)


@pytest.mark.multiprocess
def test_one_trainer_refits_an_engine_on_its_own_gpu_bit_exact():
    # engine_gpu_counts=[1]: the adapter lives in the trainer's process and gets its own handle.
    (src,) = _run(SglangSpec(world=1, layouts=[{"engine_gpu_counts": [1]}], refits=3, device="cuda:0"))
    assert [o["ok"] for o in src["outcomes"]] == [True] * 3, src["outcomes"]
    assert [o["exact"] for o in src["outcomes"]] == [True] * 3
    assert [o["rollout_version"] for o in src["outcomes"]] == [1, 2, 3]
    assert src["outcomes"][0]["buckets"] > 1 and src["opened_buffers"] == 2  # two pipeline buffers, each opened once


@pytest.mark.multiprocess
def test_two_trainer_processes_refit_one_engine_on_one_gpu_bit_exact():
    # Rank 1's buffer is opened by rank 0's adapter through its CUDA IPC handle; rank 0's is its own.
    spec = SglangSpec(world=2, refits=3, device="cuda:0", update_backend="gloo")
    src, peer = _run(spec)
    for r in (src, peer):
        assert [o["ok"] for o in r["outcomes"]] == [True] * 3, r["outcomes"]
    assert [o["exact"] for o in src["outcomes"]] == [True] * 3
    assert [o["rollout_version"] for o in src["outcomes"]] == [1, 2, 3]
    assert src["opened_buffers"] == 4  # 2 ranks x 2 pipeline buffers, each opened once
