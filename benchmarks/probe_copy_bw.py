"""Probe: plain Triton copy kernels (one block per program, and grid-stride persistent
loops) against torch's flat copy of the same 6 GiB, same run, CUDA events, median of 7.

``python3 benchmarks/probe_copy_bw.py`` (one GPU; prints JSON: TB/s of read + write)

Why it exists: the fp8 refit's persistent kernel tops out ~10% below torch's copy even on
plain copies; this shows the same gap for a persistent copy loop with nothing else in it
(benchmarks/RESULTS.md, "FP8 refit", session 5)."""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from probe_fused_bw import timed


@triton.jit
def _copy(src, dst, BLOCK: tl.constexpr, HINT: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HINT:  # read once, write once: keep neither in L2
        tl.store(dst + off, tl.load(src + off, eviction_policy="evict_first"), cache_modifier=".cs")
    else:
        tl.store(dst + off, tl.load(src + off))


@triton.jit
def _copy_persist(src, dst, nblocks, BLOCK: tl.constexpr):
    for b in range(tl.program_id(0), nblocks, tl.num_programs(0)):
        off = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + off, tl.load(src + off))


def main() -> None:
    dev = torch.device("cuda:0")
    nbytes = 6 << 30
    src = torch.empty(nbytes // 4, dtype=torch.int32, device=dev).random_()
    dst = torch.empty_like(src)
    n = src.numel()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res: dict[str, float | bool] = {"torch_copy": 2 * nbytes / timed(lambda: dst.copy_(src)) / 1e12}
    for block, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)):
        for hint in (0, 1):
            sec = timed(lambda: _copy[(n // block,)](src, dst, BLOCK=block, HINT=hint, num_warps=warps))
            res[f"triton_b{block}_w{warps}_h{hint}"] = 2 * nbytes / sec / 1e12
    for block, warps, per in ((8192, 8, 2), (8192, 8, 4), (4096, 4, 8), (4096, 8, 4)):
        sec = timed(lambda: _copy_persist[(per * sms,)](src, dst, n // block, BLOCK=block, num_warps=warps))
        res[f"persist_b{block}_w{warps}_x{per}"] = 2 * nbytes / sec / 1e12
    res["exact"] = bool(torch.equal(src, dst))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}, indent=1))


if __name__ == "__main__":
    main()
