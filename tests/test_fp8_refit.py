"""FP8 refits end to end (issue 16): real processes; the trainers quantize while
packing (nccl_reshard over gloo; zmq staged), or the colocated rollout quantizes as
it pulls (zmq mapped); every landed fp8 byte and scale equals the reference
quantizer's, bit for bit (``dest_shards`` quantizes the expected shards with it)."""

from __future__ import annotations

import pytest

from .test_fp8 import ALIGNED
from .test_nccl_reshard import _run_ok
from .test_zmq_ipc import _run
from .zmq_world import ZmqSpec

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    "train, gen, options",
    [
        ("tp=2", "tp=2,fp8=block128", {}),
        # tiny buckets: quantized copies are cut into single blocks (bigger than a bucket)
        ("tp=2,pp=2", "tp=1,fp8=block128", {"bucket_bytes": 4096}),
    ],
)
def test_nccl_reshard_fp8_refits_land_oracle_bits(train, gen, options):
    results = _run_ok("tiny", train, gen, dtype="bfloat16", overrides=dict(ALIGNED), options=options)
    bf16 = _plan(train, gen.split(",")[0]).recv_bytes_per_dst_rank()
    fp8 = _plan(train, gen).recv_bytes_per_dst_rank()
    rollouts = results[-len(fp8):]
    assert [r["recv_expected"] for r in rollouts] == list(fp8.values())  # fp8 + scales moved
    assert all(fp8[g] < 0.6 * bf16[g] for g in fp8)


def _plan(train: str, gen: str):
    import dataclasses

    from policyworker.layout import Parallelism, build_plan
    from policyworker.models import get_preset

    t, g = Parallelism.parse(train), Parallelism.parse(gen.split(",")[0])
    return build_plan(dataclasses.replace(get_preset("tiny"), **ALIGNED), train, gen, t.world_size, g.world_size)


@pytest.mark.parametrize("options", [{"flatten": True}, {"staged": True, "bucket_bytes": 8192}])
def test_zmq_fp8_refits_land_oracle_bits(options):
    res = _run(ZmqSpec(gen="tp=1,fp8=block128", refits=2, options=options))
    rollout = res[1]
    assert all(o["exact"] for o in rollout["outcomes"])
