"""Probe: the bandwidth the fp8 refit's fused launch reaches on plain copies (copy tiles
over one contiguous 6 GiB buffer) and on quantize tiles of two row strides, per launch
variant (persistent: register prefetch or shared-memory pipelining; grid=0: one tile
per program), next to torch's flat copy, same run, CUDA events, median of 7.

``python3 benchmarks/probe_fused_bw.py`` (one GPU; prints JSON: TB/s of read + write,
copies checked bit for bit)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_fp8_kernel import _time  # noqa: E402  (this directory)
from policyworker.ops.fp8_persist import PersistProgram, PersistVariant  # noqa: E402

VARIANTS = {
    "prefetch_w8_g2": PersistVariant(graph=False),  # the library default
    "pipe3_w8_g2": PersistVariant(prefetch=False, stages=3, graph=False),
    "pipe3_w16_g2": PersistVariant(num_warps=16, prefetch=False, stages=3, maxnreg=0, graph=False),
    "prefetch_w8_g1_noreg": PersistVariant(grid=1, maxnreg=0, graph=False),
    "tile_w16": PersistVariant(num_warps=16, grid=0, maxnreg=0, graph=False),
    "tile_w8": PersistVariant(grid=0, maxnreg=0, graph=False),
    "tile_w32": PersistVariant(num_warps=32, grid=0, maxnreg=0, graph=False),
    "tile_w16_r48": PersistVariant(num_warps=16, grid=0, maxnreg=48, graph=False),
}
QUANT = ("prefetch_w8_g2", "tile_w16", "tile_w8", "tile_w32", "tile_w16_r48")


def timed(fn, reps: int = 7) -> float:
    """Median seconds of ``fn`` (CUDA events) after one warm-up call."""
    return _time(fn, reps)


def main() -> None:
    dev = torch.device("cuda:0")
    side = torch.cuda.Stream(dev)  # programs launch on a side stream, as the refit's do
    res: dict[str, float | bool] = {}
    nbytes = 6 << 30
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    res["torch_copy_tbps"] = 2 * nbytes / timed(lambda: dst.copy_(src)) / 1e12
    for name, v in VARIANTS.items():
        prog = PersistProgram([], variant=v, copies=[(src, dst)])
        dst.zero_()
        with torch.cuda.stream(side):
            sec = timed(prog.launch)
        torch.cuda.synchronize()
        res[f"copy_tiles_{name}_tbps"] = 2 * nbytes / sec / 1e12
        res[f"copy_tiles_{name}_exact"] = bool(torch.equal(dst.view(torch.int16), src.view(torch.int16)))
    del dst
    for k in (4096, 12288):  # qwen3-8b's two row lengths
        n = (nbytes // 2) // k // 128 * 128
        a = src[: n * k].view(n, k)
        q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=dev)
        s = torch.empty((n // 128, k // 128), dtype=torch.float32, device=dev)
        for name in QUANT:
            prog = PersistProgram([(a, q, s)], variant=VARIANTS[name])
            with torch.cuda.stream(side):
                sec = timed(prog.launch)
            torch.cuda.synchronize()
            res[f"quant_K{k}_{name}_tbps"] = (3 * n * k + 4 * s.numel()) / sec / 1e12
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}, indent=1))


if __name__ == "__main__":
    main()
