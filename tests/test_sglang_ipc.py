"""sglang_ipc: layouts, end-to-end refits into an in-process engine, HTTP client, wire conformance."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import pathlib
import pickle

import pytest
import torch

from policyworker import ConfigError, PeerLost, ProtocolError, RefitTimeout
from policyworker.runtime.procs import free_port, run_world
from policyworker.transports.sglang_ipc.client import SglangHttpEngine, UpdateWeightsFromTensorRequest
from policyworker.transports.sglang_ipc import format as fmt

from .sglang_world import FakeSglangServer, SglangSpec, SglangTrainer, http_rank, sglang_rank


# -- layout validation (no groups needed: validation comes first) ----------------------
@pytest.fixture
def trainer():
    from policyworker.models import get_preset
    from policyworker.models.toy_model import build_model

    w = SglangTrainer(build_model(get_preset("tiny"), seed=0), rank=0, world_size=4, device="cpu", timeout_s=5.0)
    yield w
    asyncio.run(w.shutdown())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"engine_gpu_counts": []}, "at least one engine"),
        ({"engine_gpu_counts": [2, 0]}, r"engine_gpu_counts\[1\]"),
        ({"engine_gpu_counts": [2, True]}, r"engine_gpu_counts\[1\]"),
        ({"engine_gpu_counts": "22"}, "sequence"),
        ({"engine_gpu_counts": [2, 2], "engine_gpu_offsets": [0]}, "1 entries"),
        ({"engine_gpu_counts": [2, 2], "engine_gpu_offsets": [0, 1]}, "overlap"),
        ({"engine_gpu_counts": [2], "engine_gpu_offsets": [3]}, "outside the trainer world"),
        ({"engine_gpu_counts": [2], "engine_gpu_offsets": [-1]}, r"engine_gpu_offsets\[0\]"),
        ({"engine_gpu_counts": [4, 2]}, "need 6 GPUs"),
    ],
)
def test_bad_layouts_raise_config_errors_and_change_nothing(trainer, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        asyncio.run(trainer.connect_sglang_rollout_engines(**kwargs))
    assert trainer._refit_transport_state("sglang_ipc") == {}


def test_connect_needs_the_update_group_and_refit_needs_connect(trainer):
    with pytest.raises(ConfigError, match="init_collective"):
        asyncio.run(trainer.connect_sglang_rollout_engines(engine_gpu_counts=[2, 2]))
    with pytest.raises(ConfigError, match="connect_sglang_rollout_engines"):
        asyncio.run(trainer.sglang_refit())
    assert trainer._refit_transport_state("sglang_ipc") == {}


# -- real processes ----------------------------------------------------------------
def _run(spec: SglangSpec, target=sglang_rank, extra=()) -> list[dict]:
    spec.port = free_port()
    return run_world(target, spec.world, (spec, *extra), timeout_s=90)


@pytest.mark.multiprocess
@pytest.mark.parametrize("buffers", [2, 1])
def test_two_trainers_refit_one_engine_of_two_gpus_bit_exact(buffers):
    results = _run(SglangSpec(refits=3, buffers=buffers))
    src, peer = results
    for r in results:
        assert [o["ok"] for o in r["outcomes"]] == [True] * 3, r["outcomes"]
        assert [o["version"] for o in r["outcomes"]] == [1, 2, 3]
        assert r["outcomes"][0]["buckets"] > 1  # 64 KiB buckets: the model takes several
    assert [o["exact"] for o in src["outcomes"]] == [True] * 3
    assert [o["rollout_version"] for o in src["outcomes"]] == [1, 2, 3]
    assert src["layouts"] == [{"same_group": False, "engine": 0, "group_rank": 0, "src": 0, "size": 2, "epoch": 1}]
    assert peer["layouts"][0]["group_rank"] == 1 and peer["layouts"][0]["src"] == 0


@pytest.mark.multiprocess
def test_same_layout_is_a_noop_and_a_changed_layout_rebuilds():
    layouts = [
        {"engine_gpu_counts": [2]},
        {"engine_gpu_counts": [2], "engine_gpu_offsets": [0]},  # same layout, spelled out
        {"engine_gpu_counts": [1, 1]},  # an engine per GPU now
        {"engine_gpu_counts": [1, 1]},
    ]
    results = _run(SglangSpec(layouts=layouts, refits=2))
    for rank, r in enumerate(results):
        same = [row["same_group"] for row in r["layouts"]]
        assert same == [False, True, False, True]
        assert [row["epoch"] for row in r["layouts"]] == [1, 1, 2, 2]
        last = r["layouts"][-1]
        assert (last["engine"], last["group_rank"], last["src"], last["size"]) == (rank, 0, rank, 1)
        # each rank is now its own engine's gather source and refits it alone
        assert [o["exact"] for o in r["outcomes"]] == [True, True]
        assert [o["rollout_version"] for o in r["outcomes"]] == [1, 2]


@pytest.mark.multiprocess
def test_an_engine_refusal_is_raised_on_every_trainer_rank():
    results = _run(SglangSpec(refits=3, fail={"version": 2, "bucket": 2}))
    for r in results:
        oks = [o["ok"] for o in r["outcomes"]]
        assert oks == [True, False, True], r["outcomes"]
        failed = r["outcomes"][1]
        assert failed["error"] == "TransportError" and "injected refusal" in failed["message"]
        assert [o.get("version") for o in r["outcomes"]] == [1, None, 2]  # the version did not advance
    src = results[0]["outcomes"]
    assert src[1]["rollout_version"] == 1 and src[1]["torn"] is True  # buckets 0-1 of v2 had landed
    assert src[2]["exact"] is True and src[2]["rollout_version"] == 2 and src[2]["torn"] is False


@pytest.mark.multiprocess
def test_http_engine_end_to_end_and_refusal_on_every_rank():
    spec = SglangSpec(refits=2, engine="http")
    spec.port = free_port()
    results = run_world(http_rank, 2, (spec, "refuse_after", 3), timeout_s=90)
    src = results[0]
    # 3 buckets accepted, then the server refuses: every rank raises the refusal
    for r in results:
        assert [o["ok"] for o in r["outcomes"]] == [False, False]
        assert r["outcomes"][0]["error"] == "TransportError" and "shape mismatch" in r["outcomes"][0]["message"]
    reqs = src["requests"]
    assert all(q["path"] == "/update_weights_from_tensor" and q["entries"] == 2 for q in reqs)
    assert all(q["load_format"] == "flattened_bucket" for q in reqs)
    assert all(size > 0 for sizes in src["blob_sizes"] for size in sizes)
    assert reqs[0]["abort_all_requests"] is False and reqs[0]["weight_version"] is None


# -- the HTTP client against a local fake server -----------------------------------------
def _request(**kw) -> UpdateWeightsFromTensorRequest:
    blob = base64.b64encode(b"\x80\x04not-a-real-pickle").decode()
    return UpdateWeightsFromTensorRequest(serialized_named_tensors=[blob, blob], weight_version="7", **kw)


def test_http_client_posts_sglangs_json_and_reads_success():
    with FakeSglangServer("ok") as server:
        engine = SglangHttpEngine(f"http://127.0.0.1:{server.port}", timeout_s=5)
        result = engine.update_weights_from_tensor(_request(flush_cache=False, torch_empty_cache=True), timeout_s=5)
    assert result.success and result.message == "Success"
    (req,) = server.requests
    assert req == {"load_format": "flattened_bucket", "flush_cache": False, "abort_all_requests": False,
                   "weight_version": "7", "torch_empty_cache": True, "path": "/update_weights_from_tensor",
                   "entries": 2}
    assert server.blob_sizes == [[19, 19]]


@pytest.mark.parametrize(
    "mode, error",
    [("error", "TransportError"), ("missing", "ConfigError"), ("garbage", "ProtocolError")],
)
def test_http_client_maps_statuses_to_our_errors(mode, error):
    with FakeSglangServer(mode) as server:
        engine = SglangHttpEngine(f"http://127.0.0.1:{server.port}", timeout_s=5)
        with pytest.raises(Exception) as info:
            engine.update_weights_from_tensor(_request(), timeout_s=5)
    assert type(info.value).__name__ == error


def test_http_client_refusal_is_a_result_not_an_exception():
    with FakeSglangServer("refuse") as server:
        result = SglangHttpEngine(f"http://127.0.0.1:{server.port}").update_weights_from_tensor(_request(), timeout_s=5)
    assert not result.success and result.message == "shape mismatch"


def test_http_client_times_out_and_refused_connections_are_peer_lost():
    with FakeSglangServer("slow", delay_s=2.0) as server:
        engine = SglangHttpEngine(f"http://127.0.0.1:{server.port}", timeout_s=10)
        with pytest.raises(RefitTimeout):
            engine.update_weights_from_tensor(_request(), timeout_s=0.3)  # the refit's remaining time wins
    with pytest.raises(PeerLost):
        SglangHttpEngine(f"http://127.0.0.1:{free_port()}", timeout_s=2).update_weights_from_tensor(_request())
    with pytest.raises(ConfigError):
        SglangHttpEngine("ftp://x")


# -- conformance: decode our payload the way SGLang does ----------------------------------
@dataclasses.dataclass
class _ReferenceMetadata:
    """SGLang's FlattenedTensorMetadata, as its documentation gives it."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class _ReferenceUnpickler(pickle.Unpickler):
    """SGLang's allow-list rule (module prefixes); the metadata class resolves to the reference."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "torch.", "multiprocessing.resource_sharer.",
               "multiprocessing.reduction.", "sglang.srt.weight_sync.tensor_bucket.")

    def find_class(self, module, name):
        if not any((module + ".").startswith(p) for p in self.ALLOWED):
            raise pickle.UnpicklingError(f"{module}.{name} is not allow-listed")
        if (module, name) == ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"):
            return _ReferenceMetadata
        return super().find_class(module, name)


def test_payload_decodes_with_sglangs_documented_format():
    gen = torch.Generator().manual_seed(0)
    named = {
        "model.embed_tokens.weight": torch.randn(33, 8, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 7, generator=gen),
        "model.norm.weight": torch.randn(3, generator=gen).to(torch.float16),
        "scales": torch.randint(-100, 100, (13,), generator=gen, dtype=torch.int8),
        "counts": torch.arange(6, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    buckets = fmt.plan_buckets(named, 1024)
    buf, _ = fmt.export_buffer(max(b.nbytes for b in buckets), torch.device("cpu"))
    seen = {}
    for bucket in buckets:
        fmt.pack_bucket(bucket, named, buf)
        text = fmt.to_base64(fmt.serialize_bucket(buf.narrow(0, 0, bucket.nbytes), bucket.metadata))
        payload = _ReferenceUnpickler(io.BytesIO(base64.b64decode(text, validate=True))).load()
        assert set(payload) == {"flattened_tensor", "metadata"}
        flat = payload["flattened_tensor"]
        assert flat.dtype == torch.uint8 and flat.dim() == 1
        for meta in payload["metadata"]:
            assert isinstance(meta, _ReferenceMetadata) and isinstance(meta.shape, torch.Size)
            assert meta.numel == meta.end_idx - meta.start_idx  # byte counts
            t = flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)  # SGLang's rule
            seen[meta.name] = t.clone()
    assert set(seen) == set(named)
    for name, want in named.items():
        assert seen[name].dtype == want.dtype and seen[name].shape == want.shape
        assert torch.equal(seen[name].view(torch.uint8) if want.numel() else seen[name], want.view(torch.uint8)
                           if want.numel() else want)


def test_buckets_respect_the_byte_budget_and_element_alignment():
    named = {f"t{i}": torch.zeros(n, dtype=d) for i, (n, d) in
             enumerate([(3, torch.int8), (5, torch.float32), (2, torch.bfloat16), (700, torch.float32)])}
    buckets = fmt.plan_buckets(named, 1024)
    assert [len(b.metadata) for b in buckets] == [3, 1]  # the 2800-byte tensor goes alone
    for b in buckets:
        for m in b.metadata:
            assert m.start_idx % m.dtype.itemsize == 0
        assert b.nbytes == b.metadata[-1].end_idx
    with pytest.raises(ConfigError):
        fmt.plan_buckets(named, 10)


def test_reconstruct_rejects_ranges_outside_the_buffer():
    meta = fmt.FlattenedTensorMetadata("x", torch.Size([4]), torch.float32, 0, 16, 16)
    with pytest.raises(ProtocolError):
        fmt.reconstruct(torch.zeros(8, dtype=torch.uint8), [meta])


def test_nothing_of_ours_unpickles():
    src = pathlib.Path(fmt.__file__).resolve().parents[1]
    for path in src.rglob("*.py"):
        text = path.read_text()
        for needle in ("pickle.load", "pickle.Unpickler", "Unpickler(", "ForkingPickler.loads"):
            assert needle not in text, f"{path} contains {needle}"


# -- the in-process adapter's load plans (one process, no groups) ---------------------
def _refit_in_process(engine, named, buffer, handle, version):
    buckets = fmt.plan_buckets(named, 1024)
    for b in buckets:
        fmt.pack_bucket(b, named, buffer)
        last = b.index == len(buckets) - 1
        result = engine.update_weights_from_tensor(UpdateWeightsFromTensorRequest(
            buffers=(handle,), metadata=b.metadata, bucket=b.index, num_buckets=len(buckets),
            weight_version=str(version) if last else None))
        assert result.success, result.message
    return buckets


@pytest.mark.parametrize("flat", [True, False])
def test_adapter_loads_bit_exact_through_cached_plans_flat_or_not(flat):
    from policyworker import RolloutWorker
    from policyworker.integrations.sglang.engine import InProcessSglangEngine

    gen = torch.Generator().manual_seed(1)
    shapes = {f"layers.{i:02d}.w": (17, 9) for i in range(12)} | {"norm": (9,), "tiny": (1,)}
    want = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    r = RolloutWorker(rank=0, gen_world_size=1, device="cpu")
    if flat:  # one arena in bucket order (bf16 only: no padding), so each bucket loads as one copy
        arena = torch.zeros(sum(t.numel() for t in want.values()), dtype=torch.bfloat16)
        params, at = {}, 0
        for n in sorted(want):
            params[n] = arena[at:at + want[n].numel()].view(want[n].shape)
            at += want[n].numel()
        r.params = params
    else:
        r.params = {n: torch.zeros_like(t) for n, t in want.items()}
    engine = InProcessSglangEngine([r])
    buffer, handle = fmt.export_buffer(1024, torch.device("cpu"))
    for version in (1, 2, 3):
        named = {n: t + version for n, t in want.items()}
        if version == 3:  # a destination replaced between refits: its plan is rebuilt, not reused
            r.params["norm"] = torch.zeros_like(want["norm"])
        buckets = _refit_in_process(engine, named, buffer, handle, version)
        assert r.weight_version == version and not r.torn
        assert all(torch.equal(r.weights()[n], named[n]) for n in named)
    plans = [p for k, p in engine._plans.items() if k[2] < len(buckets)]
    assert len(plans) == len(buckets) > 2
    copies = sum(len(p.runs[0]) for p in plans)
    if flat:
        # one copy per bucket, except the last: "norm" left the arena, so [..., layers.11], [norm], [tiny]
        assert copies == len(buckets) + 2
    else:
        assert copies == len(shapes)
    engine.close()


@pytest.mark.parametrize("change", ["reshaped", "bigger"])
def test_one_rank_refit_repacks_when_the_model_changed_under_it(change):
    # One rank: bucket 0 is queued before the start checks. A model whose tensor changed
    # shape (the early copy still succeeds: (256,) broadcasts into the old (1, 256) view) or
    # size (the early copy fails) must reconnect, repack and land bit exact.
    from policyworker import RolloutWorker, TorchPolicyWorker
    from policyworker.integrations.sglang.engine import InProcessSglangEngine

    gen = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(1, 256, generator=gen).to(torch.bfloat16)}
    params |= {f"w{i}": torch.randn(256, generator=gen).to(torch.bfloat16) for i in range(3)}

    class Trainer(TorchPolicyWorker):
        def _named_tensors(self):
            return params

    async def main():
        w = Trainer(torch.nn.Linear(1, 1), rank=0, world_size=1, device="cpu", timeout_s=30.0)
        await w.init_collective("127.0.0.1", free_port(), 1, train_world_size=1)
        await w.attach_transport("sglang_ipc", engine_gpu_counts=(1,), bucket_bytes=1024, buffers=2)
        r = RolloutWorker(rank=0, gen_world_size=1, device="cpu")
        r.params = {n: torch.zeros_like(t) for n, t in params.items()}
        engine = InProcessSglangEngine([r])
        try:
            rep = await w.sglang_refit(engine=engine, refit_timeout_s=30.0)
            assert rep.buckets == 2 and all(torch.equal(r.weights()[n], t) for n, t in params.items())
            new = torch.randn(256 if change == "reshaped" else 1024, generator=gen).to(torch.bfloat16)
            params["a"] = new
            r.params["a"] = torch.zeros_like(new)
            rep = await w.sglang_refit(engine=engine, refit_timeout_s=30.0)
            assert rep.buckets == (2 if change == "reshaped" else 3)
            assert r.weight_version == 2 and not r.torn
            assert all(torch.equal(r.weights()[n], t) for n, t in params.items())
        finally:
            engine.close()
            await r.shutdown()
            await w.shutdown()

    asyncio.run(main())
