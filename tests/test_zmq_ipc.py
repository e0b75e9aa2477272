"""zmq colocated transport on CPU: shared-memory handles, real spawned processes, bit-exact."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import torch

from policyworker.runtime.device import device_facts
from policyworker.errors import PlanMismatch, ProtocolError, RefitTimeout
from policyworker.layout import build_plan
from policyworker.models import get_preset, seeded_state_dict
from policyworker.runtime.procs import run_world
from policyworker.transports.zmq import wire as w
from policyworker.transports.base import TransportContext
from policyworker.transports.ipc_handles import share_cpu
from policyworker.transports.zmq import export as zx
from policyworker.transports.zmq.transport import ZmqIpcTransport
from policyworker.layout.local import flat_local_tensors

from .zmq_world import ZmqSpec, ZTrainer, zmq_rank

pytestmark = pytest.mark.multiprocess


def _run(spec: ZmqSpec) -> list[dict]:
    results = run_world(zmq_rank, 2 * spec.pairs, (spec,), timeout_s=60)
    assert len({r["hash"] for r in results}) == 1
    for r in results[: spec.pairs]:
        assert [o["ok"] for o in r["outcomes"]] == [True] * spec.refits, r["outcomes"]
    for r in results[spec.pairs:]:
        outs = r["outcomes"]
        assert [o.get("exact") for o in outs] == [True] * spec.refits, outs
        assert [o["weight_version"] for o in outs] == list(range(1, spec.refits + 1))
        assert all(o["bytes"] == r["expected_bytes"] for o in outs)
        assert [o["kv_scales"] for o in outs] == [{"k": 0.5 * v} for v in range(1, spec.refits + 1)]
        assert [o["report_kv_scales"] for o in outs] == [o["kv_scales"] for o in outs]  # the report carries them
    return results


def test_refits_bit_exact_and_a_moved_storage_is_re_exported():
    res = _run(ZmqSpec(refits=3, move_at=2))
    trainer, rollout = res
    assert trainer["reexports"] == 1
    assert "re-exported 1 moved storages" in trainer["outcomes"][1]["notes"]
    assert trainer["outcomes"][1]["notes"][-1] == "handles sent 1, released 1, exported 25"
    assert trainer["outcomes"][2]["notes"] == ["handles sent 0, released 0, exported 25"]  # nothing re-sent
    assert "opened 1 handles" in rollout["outcomes"][1]["notes"]


def test_the_source_fingerprint_sees_a_re_pointed_source_at_any_address():
    # The trainer's per-refit check is data pointers only. On CPU a freed shm storage's
    # address comes back as another file at once (the allocator reuses it): the source
    # table holds the storages it was built from, so a re-pointed source cannot land
    # at its old address while the table is current.
    def shared() -> torch.Tensor:
        t = torch.zeros(4096)
        share_cpu(t)
        return t

    params = {"a": shared(), "b": shared()}
    ctx = TransportContext(worker=None, role="send", rank=0, device=device_facts("cpu"), state={}, params=params)
    names = ["a", "b"]
    fp, holds = zx.fingerprint(params, names), zx.holds(ctx, names)
    assert fp == (params["a"].data_ptr(), params["b"].data_ptr()) and len(holds) == 2
    for _ in range(20):  # free and map again the same size (without the hold: the old address, often)
        params["a"].data = shared()
        assert zx.fingerprint(params, names) != fp
    assert [h.data_ptr() for h in holds] == list(fp)  # the old storages, still alive
    assert zx.fingerprint({"a": params["a"]}, names) is None  # missing: the slow path names it


def test_flattened_trainer_refits_in_one_copy():
    _, rollout = _run(ZmqSpec(refits=2, options={"flatten": True}))
    assert rollout["outcomes"][1]["notes"] == ["copies 1"]


def test_gen_tp2_from_full_trainers_two_colocated_pairs():
    _run(ZmqSpec(gen="tp=2", pairs=2, refits=2, options={"flatten": True}))


def test_staged_ring_keeps_several_buckets_in_flight():
    trainer, _ = _run(ZmqSpec(refits=2, options={"staged": True, "bucket_bytes": 8192, "staging": 3}))
    assert trainer["outcomes"][0]["buckets"] > 3
    assert trainer["outcomes"][0]["peak_extra"] == 3 * 8192


def test_trainer_times_out_when_the_rollout_never_asks():
    async def main():
        from policyworker.models.toy_model import build_model

        w_ = ZTrainer(build_model(get_preset("tiny"), seed=0, dtype=torch.float32), rank=0, world_size=1,
                      device="cpu")
        try:
            await w_.prepare_zmq_refit_info("tp=1", 1)
            t0 = time.monotonic()
            with pytest.raises(RefitTimeout):
                await w_.stream_weights_via_ipc_zmq(refit_timeout_s=1.0)
            return time.monotonic() - t0
        finally:
            await w_.shutdown()

    assert asyncio.run(main()) < 1.0 + 2.0


def test_wire_messages_round_trip_and_malformed_bytes_raise():
    offer = w.Offer(version=3, plan_hash="ab", handles=[w.ShmHandle(id=1, manager=b"m", filename=b"/f", size=8)],
                    release=[2], sources=[w.SourceRef(name="x", handle=1, offset=0, dtype="bfloat16", shape=(2,),
                                                      stride=(1,))], staged_buckets=0, ring=[], bucket_bytes=1024,
                    kv_scales={"k": 1.0}, epoch=4)
    for msg in (offer, w.Hello(rank=0, plan_hash="h", session="s"), w.Done(version=1, nbytes=5, ok=True),
                w.Commit(version=1), w.BucketReady(version=1, seq=0, slot=1)):
        assert w.decoder.decode(w.encode(msg)) == msg
    for bad in (b"", b"\xc1", w.encode(offer)[:-3], msgspec.msgpack.encode({"type": "Exec", "code": "x"}),
                msgspec.msgpack.encode({"type": "Done", "version": "1", "nbytes": 0, "ok": True})):
        with pytest.raises(ProtocolError):
            w.decoder.decode(bad)


def _pair(plan, endpoint, src, dst, **opts):
    facts = device_facts("cpu")
    s_ctx = TransportContext(worker=None, role="send", rank=0, device=facts, state={}, params=src, plan=plan)
    r_ctx = TransportContext(worker=None, role="receive", rank=0, device=facts, state={}, params=dst, plan=plan)
    return (ZmqIpcTransport(endpoint=endpoint, timeout_s=10, **opts), s_ctx,
            ZmqIpcTransport(endpoint=endpoint, timeout_s=10, **opts), r_ctx)


# The conformance suite for zmq runs through real workers in tests/test_conformance.py.


def test_plan_mismatch_fails_at_connect(tmp_path):
    config = get_preset("tiny")
    a = build_plan(config, "tp=1", "tp=1", 1, 1, dtype=torch.float32)
    b = build_plan(config, "tp=1", "tp=1", 1, 1, dtype=torch.bfloat16)
    src = seeded_state_dict(config, seed=0, dtype=torch.float32)
    s, sc, r, rc = _pair(a, f"ipc://{tmp_path}/mm.sock", src, flat_local_tensors(b, 0, torch.device("cpu")))
    rc.plan = b

    async def main():
        res = await asyncio.gather(s.connect(sc), r.connect(rc), return_exceptions=True)
        await s.aclose()
        await r.aclose()
        return res

    assert [type(e) for e in asyncio.run(main())] == [PlanMismatch, PlanMismatch]
