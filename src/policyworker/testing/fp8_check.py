"""Exactness of every fp8 kernel variant against the oracle, on any device.

``python -m policyworker.testing.fp8_check`` (with ``TRITON_INTERPRET=1`` on a machine
without a GPU; it must be set before Triton is imported, hence a module of its own
run in a fresh process) prints one JSON object: per variant (``variants``), whether
every fp8 byte and scale equals :func:`policyworker.layout.formats.block_fp8_pack.quantize_reference`
and every plain copy of the same program landed bit for bit with nothing written
around it; per variant (``copies``), how many copy bytes its launch made and how
many copies it left to torch.

Cases: bf16 and float32 sources, strided views, shapes that are and are not
multiples of the block (partial tiles take the masked launch), a destination view
that is not 16-byte aligned (the masked launch too), an all-zero block,
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
    # the first: whole tiles whose fp8 view check() puts off 16-byte alignment
    shapes = [(block, 2 * block), (2 * block, 3 * block), (block + block // 2 + 3, block + 2), (1, 1),
              (block, 2 * block)]
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


def _copy_cases(device: torch.device, block: int):
    """``(pairs, buffers)``: plain copies of odd shapes for the fused launch's copy tiles,
    as views of poisoned destination buffers; ``buffers`` = ``[(dst buffer, expected)]``
    (expected: the poison with every region copied in by torch, so a byte written
    outside a region shows too). Sources hold random 16-bit patterns, NaN payloads
    included. Cases: contiguous runs of 1, 8, 13 words, one tile, tiles + partial rows
    + a short row + a tail under 16 bytes, a run at an address that is not 16-byte
    aligned (torch's), an odd-length uint8 run; 2-D strided bf16 and float32 regions
    with partial tiles; rows of 10 bytes (torch's); a 3-D view that folds into 2-D."""
    g = torch.Generator().manual_seed(11)

    def bits(*shape):
        return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g)

    b2 = block * block
    flat_s, flat_d = bits(4 * b2 + 4096), torch.full((4 * b2 + 4096,), 0x5A5A, dtype=torch.int16)
    regions = []  # (src buffer, dst buffer, view function)
    at = 0
    for n in (1, 8, 13, b2, 2 * b2 + 3 * block + 5):
        regions.append((flat_s, flat_d, lambda t, a=at, n=n: t.view(torch.bfloat16)[a:a + n]))
        at += -(-(n + 1) // 8) * 8  # next run 16-byte aligned, one word of gap left unwritten
    regions.append((flat_s, flat_d, lambda t, a=at + 1: t.view(torch.bfloat16)[a:a + 100]))  # unaligned
    at += 112
    regions.append((flat_s, flat_d, lambda t, a=2 * at: t.view(torch.uint8)[a:a + 37]))  # 32 bytes + a 5-byte tail
    r, c = block + 5, block + 24
    s2, d2 = bits(r + 3, c + 40), torch.full((r + 3, c + 40), 0x5A5A, dtype=torch.int16)
    regions.append((s2, d2, lambda t: t.view(torch.bfloat16)[1:r + 1, 8:c + 8]))
    regions.append((s2, d2, lambda t: t.view(torch.bfloat16)[r + 1:r + 3, c + 8:c + 13]))  # 10-byte rows
    s3, d3 = bits(25, 40), torch.full((25, 40), 0x5A5A, dtype=torch.int16)
    regions.append((s3, d3, lambda t: t.view(torch.float32)[2:22, 4:16]))
    s4, d4 = bits(4, 6, 16), torch.full((4, 6, 16), 0x5A5A, dtype=torch.int16)
    regions.append((s4, d4, lambda t: t.view(torch.bfloat16)[:, :, :8]))
    moved = {}
    for buf in {id(x): x for reg in regions for x in reg[:2]}.values():
        moved[id(buf)] = buf.to(device)
    pairs, expect = [], {}
    for src, dst, view in regions:
        exp = expect.setdefault(id(dst), dst.clone())
        view(exp).copy_(view(src))
        pairs.append((view(moved[id(src)]), view(moved[id(dst)])))
    buffers = [(moved[i], e) for i, e in expect.items()]
    return pairs, buffers


def _variants():
    from policyworker.ops.fp8_persist import PersistVariant

    tile = [dict(kernel="tile", fast_div=f) for f in (False, True)]
    persist = [PersistVariant(prefetch=True, fast_div=True), PersistVariant(prefetch=True, fast_div=False),
               PersistVariant(prefetch=False, stages=3, fast_div=True), PersistVariant(prefetch=False, fast_div=False),
               PersistVariant(prefetch=True, fast_div=False, fused=False), PersistVariant(grid=0, num_warps=16),
               PersistVariant(grid=0, fast_div=False)]
    return tile, persist


def _fma_rounds_once(device: torch.device) -> bool:
    """Whether ``tl.math.fma`` rounds once here: (1 + 2**-13)**2 - (1 + 2**-12) is
    2**-26 fused and 0 when the product is rounded first, as Triton 3.6's interpreter
    does (a multiply, then an add). The reciprocal path (``fast_div``) is exact only
    with a fused fma, which every GPU has; an interpreter without one cannot check it."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(a_ptr, c_ptr, out_ptr):
        a = tl.load(a_ptr)
        tl.store(out_ptr, tl.math.fma(a, a, tl.load(c_ptr)))

    a = torch.tensor([1 + 2.0**-13], device=device)
    c = torch.tensor([-(1 + 2.0**-12)], device=device)
    out = torch.zeros(1, device=device)
    _probe[(1,)](a, c, out)
    return float(out.item()) == 2.0**-26


def _same(q: torch.Tensor, rq: torch.Tensor) -> bool:
    a, b = q.float(), rq.float()
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b))) and torch.equal(q.view(torch.uint8)[~nan], rq.view(torch.uint8)[~nan])


def check(device: str = "cpu", block: int = 32, specials: bool = True,
          coverage: dict | None = None) -> dict[str, bool | None]:
    """``{variant name: exact}`` over the cases, ``block``-sized tiles, the plain copies
    of :func:`_copy_cases` in the same program (fused persistent variants make them
    copy tiles; what a program leaves is copied here with torch); ``None`` for the
    ``fast_div`` variants in an interpreter whose fma rounds twice (Triton 3.6's).
    ``coverage`` (if given) gets, per variant, the copy bytes its launch made and the
    number of copies it left."""
    from policyworker.layout.formats.block_fp8_pack import quantize_reference
    from policyworker.ops import fp8_triton

    dev = torch.device(device)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    ws = _cases(dev, block, specials)
    refs = [quantize_reference(w.cpu(), block) for w in ws]
    qdtype = torch.float32 if interp else torch.float8_e4m3fn
    tile, persist = _variants()
    fused = not interp or _fma_rounds_once(dev)
    res: dict[str, bool | None] = {}
    for v in tile + persist:
        if not fused and (v["fast_div"] if isinstance(v, dict) else v.fast_div):
            res["kernel=tile,fast_div=1" if isinstance(v, dict) else v.name()] = None
            continue
        jobs = []
        for i, w in enumerate(ws):
            q = torch.full(w.shape, float("nan"), device=dev).to(qdtype)  # poison: a tile left unwritten shows
            if i == 0:  # the first job's fp8 view off 16-byte alignment: the fused launch's base is not its
                q = torch.full((w.numel() + 1,), float("nan"), device=dev).to(qdtype)[1:].view(w.shape)
            s = torch.full((-(-w.shape[0] // block), -(-w.shape[1] // block)), float("nan"), device=dev)
            jobs.append((w, q, s))
        if isinstance(v, dict):
            fp8_triton.configure(kernel="tile", fast_div=v["fast_div"])
            name = f"kernel=tile,fast_div={int(v['fast_div'])}"
        else:
            fp8_triton.configure(kernel="persist", persist=v)
            name = v.name()
        pairs, buffers = _copy_cases(dev, block)
        prog = fp8_triton.QuantProgram(jobs, block, copies=pairs)
        prog.launch()
        for a, b in prog.copies_left:
            b.copy_(a)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if coverage is not None:
            coverage[name] = {"copy_bytes": prog.copy_bytes, "copies_left": len(prog.copies_left),
                              "copies": len(pairs)}
        res[name] = all(_same(q.cpu().to(torch.float8_e4m3fn), rq) and torch.equal(s.cpu(), rs)
                        for (_, q, s), (rq, rs) in zip(jobs, refs)) and all(
            torch.equal(buf.cpu(), exp) for buf, exp in buffers)
    fp8_triton.configure(kernel="tile", fast_div=False)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--no-specials", action="store_true")
    ns = p.parse_args(argv)
    cov: dict = {}
    res = check(ns.device, ns.block, not ns.no_specials, cov)
    print(json.dumps({"variants": res, "copies": cov}))
    if None in res.values():
        print("fp8_check: this Triton's interpreter rounds fma twice; fast_div variants not checked (null)",
              file=sys.stderr)
    return 0 if all(v is not False for v in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
