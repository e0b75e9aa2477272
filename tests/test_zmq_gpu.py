"""zmq over CUDA IPC: trainer and rollout as two processes on one GPU, bit-exact."""

from __future__ import annotations

import pytest
import torch

from policyworker.runtime.procs import run_world

from .zmq_world import ZmqSpec, zmq_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(spec: ZmqSpec) -> list[dict]:
    results = run_world(zmq_rank, 2 * spec.pairs, (spec,), timeout_s=90)
    for r in results[spec.pairs:]:
        assert [o.get("exact") for o in r["outcomes"]] == [True] * spec.refits, r["outcomes"]
        assert all(o["bytes"] == r["expected_bytes"] for o in r["outcomes"])
    return results


@pytest.mark.parametrize("options", [{}, {"flatten": True}], ids=["per-storage", "flatten"])
def test_cuda_ipc_refits_bit_exact_with_a_moved_storage(options):
    res = _run(ZmqSpec(device="cuda:0", refits=3, move_at=2, options=options))
    assert res[0]["reexports"] >= 1
    assert any("re-exported" in n for n in res[0]["outcomes"][1]["notes"])
    assert res[0]["outcomes"][2]["notes"] == ["handles sent 0, released 0, exported %d" % (1 if options else 25)]


def test_cuda_ipc_staged_ring_and_gen_tp2_pairs():
    _run(ZmqSpec(device="cuda:0", refits=2, options={"staged": True, "bucket_bytes": 8192}))
    _run(ZmqSpec(device="cuda:0", gen="tp=2", pairs=2, refits=2, options={"flatten": True}))


@pytest.mark.timeout(60)
def test_gpu_wait_gives_up_at_its_deadline_while_it_polls_fast():
    import time

    from policyworker.errors import RefitTimeout
    from policyworker.transports.zmq.program import _FAST_POLL_S, _sync

    dev = torch.device("cuda", 0)
    torch.cuda._sleep(int(4e9))  # a kernel of ~2 s on the current stream
    with pytest.raises(RefitTimeout):
        _sync(dev, None, deadline=time.monotonic() + _FAST_POLL_S / 4)  # inside the fast polls
    torch.cuda.synchronize(dev)
