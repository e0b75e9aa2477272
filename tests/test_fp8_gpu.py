"""FP8 on CUDA (issue 16): the Triton kernel against the reference quantizer, bit for
bit (with plain copies in the same launch: copy tiles); a quantize-while-pack transfer
on the GPU; a colocated zmq fp8 refit over CUDA IPC (its bf16 copies in the launch)."""

from __future__ import annotations

import pytest
import torch

from .helpers import same_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B = 128


def _case(n, k, seed, dtype, dev):
    g = torch.Generator(device=dev).manual_seed(seed)
    spread = torch.exp(torch.randn(n + 3, 1, device=dev, generator=g) * 4)
    w = torch.randn(n + 3, k + 5, device=dev, generator=g) * spread
    w = w.to(dtype)[1:n + 1, 2:k + 2]  # a strided view
    if n >= B and k >= B:
        w[:B, :B] = 0  # one all-zero block
    if n >= 2 * B and k >= B:
        w[B:2 * B, :B] *= 1e-30  # a block of tiny (normal) values
    return w


@pytest.mark.parametrize("fast_div", [False, True], ids=["div_rn", "reciprocal+corrections"])
def test_triton_kernel_equals_the_oracle_in_one_launch(fast_div):
    from policyworker.layout.formats.block_fp8_pack import quantize_reference
    from policyworker.ops.fp8_triton import QuantProgram

    dev = torch.device("cuda:0")
    shapes = [(1, 1), (127, 129), (128, 128), (300, 200), (513, 1000), (2048, 384), (4096, 4096), (1024, 512)]
    jobs, refs = [], []
    for i, (n, k) in enumerate(shapes):
        for dtype in (torch.bfloat16, torch.float32):
            w = _case(n, k, 100 * i + (dtype == torch.float32), dtype, dev)
            q = torch.full((n, k), 0x7F, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)  # NaN poison
            s = torch.full((-(-n // B), -(-k // B)), float("nan"), device=dev)
            jobs.append((w, q, s))
            refs.append(quantize_reference(w.cpu()))
    # plain copies in the same launch (copy tiles with the default persistent kernel):
    # a long run with a short last row and a tail, a strided 2-D region, an unaligned run
    src = torch.randint(-(2**15), 2**15, (3 << 20,), dtype=torch.int16, device=dev)
    dst = torch.zeros_like(src)
    n = (1 << 20) + 3 * 128 + 13
    grid_s, grid_d = src[2 << 20:].view(1024, 1024), dst[2 << 20:].view(1024, 1024)
    copies = [(src[:n], dst[:n]), (grid_s[3:900, 16:1000], grid_d[3:900, 16:1000]),
              (src[n + 1:n + 5001], dst[n + 1:n + 5001])]
    prog = QuantProgram(jobs, copies=copies)
    prog.fast_div = fast_div
    for _ in range(3):  # a program runs again on new contents (2nd run: captured as a graph, 3rd: replayed)
        for w, _, _ in jobs:
            w.mul_(-1)
        src.bitwise_not_()
        refs = [(rq, rs) for rq, rs in (quantize_reference(w.cpu()) for w, _, _ in jobs)]
        prog.run()
        for a, b in prog.copies_left:
            b.copy_(a)
        torch.cuda.synchronize()
        for (w, q, s), (rq, rs) in zip(jobs, refs):
            assert same_bits(q.cpu(), rq), tuple(w.shape)
            assert same_bits(s.cpu(), rs), tuple(w.shape)
        assert all(torch.equal(a, b) for a, b in copies)
        assert prog.copy_bytes > 0 and len(prog.copies_left) < len(copies)
    assert prog.persist.graphed  # the default variant replays its launches as one CUDA graph


def test_quantize_while_pack_on_the_gpu_lands_oracle_bits():
    import dataclasses

    from policyworker.layout import bucket_copies, build_plan, copy_nbytes, dest_shards, empty_local_tensors
    from policyworker.layout import pack, source_shards, unpack
    from policyworker.models import get_preset, seeded_state_dict

    dev = torch.device("cuda:0")
    config = dataclasses.replace(get_preset("tiny"), hidden_size=200, intermediate_size=256, num_heads=2,
                                 num_kv_heads=1, head_dim=128)
    plan = build_plan(config, "tp=2", "tp=2,fp8=block128", 2, 2, dtype=torch.bfloat16)
    full = seeded_state_dict(config, seed=5, dtype=torch.bfloat16)
    srcs = {r: {n: t.to(dev) for n, t in source_shards(plan, r, full).items()} for r in range(2)}
    dsts = {r: empty_local_tensors(plan, "dst", r, dev, flat=True) for r in range(2)}
    for t in plan.transfers:
        for part in bucket_copies(plan, t.copies, 40_000):
            buf = torch.empty(sum(copy_nbytes(plan, c) for c in part), dtype=torch.uint8, device=dev)
            assert pack(plan, part, srcs[t.src], buf) == buf.numel()
            unpack(plan, part, buf, dsts[t.dst])
    torch.cuda.synchronize()
    for r in range(2):
        want = dest_shards(plan, r, full)
        assert set(want) == set(dsts[r]) and all(same_bits(dsts[r][n].cpu(), want[n]) for n in want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("options", [{"flatten": True}, {"staged": True, "bucket_bytes": 8192}])
def test_zmq_fp8_refit_over_cuda_ipc(options):
    from policyworker.runtime.procs import run_world

    from .zmq_world import ZmqSpec, zmq_rank

    # 3 refits: the launch runs, is captured as a CUDA graph, is replayed — each exact
    spec = ZmqSpec(device="cuda:0", gen="tp=1,fp8=block128", refits=3, options=options)
    results = run_world(zmq_rank, 2, (spec,), timeout_s=90)
    rollout = results[1]
    assert [o.get("exact") for o in rollout["outcomes"]] == [True, True, True], rollout["outcomes"]
    assert all(o["bytes"] == rollout["expected_bytes"] for o in rollout["outcomes"])
    if options.get("flatten"):  # mapped sources: the bf16 copies rode in the quantizing launch
        fused = [n for o in rollout["outcomes"] for n in o.get("notes", []) if n.startswith("fp8 launch copies")]
        assert fused and int(fused[0].split()[3]) > 0, rollout["outcomes"]


@pytest.mark.multiprocess
def test_zmq_fp8_refit_with_big_copies_through_torch_then_the_replayed_launch():
    # The small preset's embedding and lm_head (32 MB each here) are at least
    # torch_min_mib: torch copies them on the pull's stream, then the captured launch
    # (quantize tiles + the small copies) is replayed on that same stream; each refit exact.
    from policyworker.runtime.procs import run_world

    from .zmq_world import ZmqSpec, zmq_rank

    spec = ZmqSpec(preset="small", device="cuda:0", gen="tp=1,fp8=block128", refits=4, options={"flatten": True},
                   fp8_kernel="kernel=persist,torch_min_mib=16")
    results = run_world(zmq_rank, 2, (spec,), timeout_s=120)
    rollout = results[1]
    assert [o.get("exact") for o in rollout["outcomes"]] == [True] * 4, rollout["outcomes"]
    notes = [n for o in rollout["outcomes"] for n in o.get("notes", []) if n.startswith("fp8 launch copies")]
    assert notes and int(notes[0].split()[3]) > 0 and int(notes[0].split()[-1]) >= 2, notes  # both kinds


def test_every_kernel_variant_equals_the_oracle_on_the_gpu():
    """The interpreter check of test_fp8_kernels.py, here with the GPU's own fp8
    conversion, 128-blocks, NaN and inf blocks (NaN bytes compare as NaN)."""
    from policyworker.testing.fp8_check import check

    res = check("cuda:0", 128, specials=True)
    assert len(res) >= 6 and all(res.values()), res
