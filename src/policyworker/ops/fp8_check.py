"""Exactness of every fp8 kernel variant against the oracle, on any device.

``python -m policyworker.ops.fp8_check`` (with ``TRITON_INTERPRET=1`` on a machine
without a GPU; it must be set before Triton is imported, hence a module of its own
run in a fresh process) prints one JSON object: per variant, whether every fp8 byte
and scale equals :func:`policyworker.layout.fp8_pack.quantize_reference`.

Cases: bf16 and float32 sources, strided views, shapes that are and are not
multiples of the block (partial tiles take the masked launch), an all-zero block,
``-0.0`` elements, a block of tiny values and, with ``--specials``, blocks holding
NaN and ±inf. NaN bytes compare as NaN whatever their sign bit: the sign of a NaN
made by ``inf / inf`` is the hardware's (x86 gives a negative one, CUDA a positive
one), not the oracle's to define.

In the interpreter the kernels store the float32 quotient (``Q_F32``) and torch
converts it to e4m3 here, because the interpreter's own fp8 conversion does not
round to nearest even; on CUDA the kernels write fp8 themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _cases(device: torch.device, block: int, specials: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = []
    shapes = [(2 * block, 3 * block), (block + block // 2 + 3, block + 2), (1, 1), (block, 2 * block)]
    for i, (n, k) in enumerate(shapes):
        dtype = torch.float32 if i == len(shapes) - 1 else torch.bfloat16
        w = torch.randn(n + 3, k + 8, generator=g) * torch.exp(torch.randn(n + 3, 1, generator=g) * 4)
        w = w.to(dtype)[1:n + 1, 8:k + 8]  # a strided view, rows 16-byte aligned
        if n >= block and k >= block:
            w[:block, :block] = 0
            w[0, 1] = -0.0
        if n >= 2 * block and k >= 2 * block:
            w[block:2 * block, block:2 * block] *= 1e-30
            w[block + 1, block + 2] = -0.0
        w[-1, -1] = -0.0
        if specials and n >= 2 * block and k >= 3 * block:
            w[3, block + 5] = float("nan")
            w[5, 2 * block + 1] = -float("nan")
            w[block + 2, 2 * block] = float("inf")
            w[block + 3, 2 * block + 9] = -float("inf")
        out.append(w.to(device))
    return out


def _variants():
    from policyworker.ops.fp8_persist import PersistVariant

    tile = [dict(kernel="tile", fast_div=f) for f in (False, True)]
    persist = [PersistVariant(prefetch=True, fast_div=True), PersistVariant(prefetch=True, fast_div=False),
               PersistVariant(prefetch=False, stages=3, fast_div=True), PersistVariant(prefetch=False, fast_div=False)]
    return tile, persist


def _same(q: torch.Tensor, rq: torch.Tensor) -> bool:
    a, b = q.float(), rq.float()
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b))) and torch.equal(q.view(torch.uint8)[~nan], rq.view(torch.uint8)[~nan])


def check(device: str = "cpu", block: int = 32, specials: bool = True) -> dict[str, bool]:
    """``{variant name: exact}`` over the cases, ``block``-sized tiles."""
    from policyworker.layout.fp8_pack import quantize_reference
    from policyworker.ops import fp8_triton

    dev = torch.device(device)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    ws = _cases(dev, block, specials)
    refs = [quantize_reference(w.cpu(), block) for w in ws]
    qdtype = torch.float32 if interp else torch.float8_e4m3fn
    tile, persist = _variants()
    res = {}
    for v in tile + persist:
        jobs = []
        for w in ws:
            q = torch.full(w.shape, float("nan"), device=dev).to(qdtype)  # poison: a tile left unwritten shows
            s = torch.full((-(-w.shape[0] // block), -(-w.shape[1] // block)), float("nan"), device=dev)
            jobs.append((w, q, s))
        if isinstance(v, dict):
            fp8_triton.configure(kernel="tile", fast_div=v["fast_div"])
            name = f"kernel=tile,fast_div={int(v['fast_div'])}"
        else:
            fp8_triton.configure(kernel="persist", persist=v)
            name = v.name()
        prog = fp8_triton.QuantProgram(jobs, block)
        prog.launch()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        res[name] = all(_same(q.cpu().to(torch.float8_e4m3fn), rq) and torch.equal(s.cpu(), rs)
                        for (_, q, s), (rq, rs) in zip(jobs, refs))
    fp8_triton.configure(kernel="tile", fast_div=False)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--no-specials", action="store_true")
    ns = p.parse_args(argv)
    res = check(ns.device, ns.block, not ns.no_specials)
    print(json.dumps(res))
    return 0 if all(res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
