"""The fused FP8 kernels alone on one GPU: qwen3-8b's linear weights (13.9 GB bf16) ->
fp8 + scales, every launch variant, against a flat device copy of the same bf16 bytes,
same run.

``PYTHONPATH=src python benchmarks/bench_fp8_kernel.py [--short] --json out.json``

Variants: the one-tile-per-program kernel (``kernel=tile``: warps per tile, IEEE
division per element or reciprocal + corrections, streaming cache hints) and the
persistent one (``kernel=persist``: warps, register prefetch or ``tl.range``
pipelining depth, programs per SM, division, hints, ``fused``: one launch with
per-tile strides that also takes copy tiles, or one launch per stride pair, and the
fused launch's register cap). ``--short``: the default and a few neighbours. With
the preset's bf16 copies (``with_bf16_copies``): copies alone, kernel alone, copies
first then the kernel, kernel first, and *kernel with copy tiles (copies + quantize
in one launch)* per fused variant, whose copies are checked bit for bit too;
``best_with_copies`` names the fastest way for a refit. Times with CUDA events, median
of ``--reps`` after a warm-up; GB/s count bytes read plus bytes written. Every
variant's output (poisoned first) is checked bit for bit against the plain-torch band
quantizer on *all* the model's bytes. ``best`` names the fastest exact variant
(``bench_fp8_zmq.py --kernel`` and ``fp8_triton.configure_from_string`` take it).
Variants not started within ``--budget-s`` (compiles dominate) are listed as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from policyworker.cli.output import write_json  # noqa: E402
from policyworker.layout.formats.block_fp8_pack import quantize_bands  # noqa: E402
from policyworker.models import get_preset, param_specs  # noqa: E402
from policyworker.ops import fp8_triton  # noqa: E402
from policyworker.ops.fp8_persist import PersistVariant  # noqa: E402


def _time(fn, reps: int) -> float:
    if not torch.cuda.is_available():  # a smoke run in Triton's interpreter (TRITON_INTERPRET=1)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def _error_text(exc: BaseException, lines: int = 20) -> str:
    """The last ``lines`` lines of ``exc`` and its causes: a CompilationError's message
    starts with the kernel source around the failing line and ends with what failed
    (MLIR's own diagnostics go to stderr, i.e. the sweep's log)."""
    parts, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    text = "\n-- caused by --\n".join(parts)  # the innermost cause last: it survives the cut
    return "\n".join(text.rstrip().splitlines()[-lines:])


@contextlib.contextmanager
def _stderr_tail(lines: int = 12):
    """Tee file descriptor 2 (where MLIR and ptxas print their diagnostics, below
    Python) through a temporary file; yields a one-item list that holds its last
    ``lines`` lines once the block ends, and copies everything on to the real stderr."""
    out = [""]
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            text = f.read().decode(errors="replace")
            sys.stderr.write(text)
            out[0] = "\n".join(text.rstrip().splitlines()[-lines:])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _tile(warps: int, fast: bool, stream: bool = False) -> tuple[str, dict]:
    name = f"warps={warps},narrow_amax=1,stream={int(stream)},fast_div={int(fast)}"
    return name, dict(kernel="tile", num_warps=warps, fast_div=fast, stream=stream)


def _persist_group(warps: int, stages: int, prefetch: bool, fast: bool = True, stream: bool = False,
                   grids: tuple[int, ...] = (1, 2, 4), fused: bool = True) -> list[PersistVariant]:
    """Variants sharing one compile (the grid is a launch setting only). The register
    cap (two 8-warp programs per SM) only for 8 warps: 4 warps need more, 16 fewer."""
    return [PersistVariant(num_warps=warps, stages=stages, prefetch=prefetch, grid=g, fast_div=fast, stream=stream,
                           fused=fused, maxnreg=128 if warps == 8 else 0) for g in grids]


def short() -> list[list]:
    """``--short``: the library default and its nearest neighbours, for a device call
    that also runs the zmq bench: the fused launch (per-tile strides, copy tiles) with
    and without its register cap, pipelined instead of prefetched, at 16 warps, and the
    grouped launch (constant strides; copies through torch) that was the default before.
    The two defaults first: the budget cuts from the end."""
    return [[PersistVariant(), PersistVariant(torch_min_mib=0)],
            [PersistVariant(fused=False), PersistVariant(fused=False, grid=2)],
            [PersistVariant(maxnreg=0)], [PersistVariant(prefetch=False, stages=3, maxnreg=0)],
            [PersistVariant(num_warps=16, maxnreg=0, grid=2)]]


def _named(spec: str) -> list[list]:
    """``--variants``: one group per name (each compiles on its own)."""
    groups: list[list] = []
    saved = fp8_triton.KERNEL, fp8_triton.PERSIST
    for name in (n.strip() for n in spec.split(";")):
        if not name:
            continue
        fp8_triton.configure_from_string(name)
        if fp8_triton.KERNEL == "persist":
            groups.append([fp8_triton.PERSIST])
        else:
            groups.append([_tile(fp8_triton.NUM_WARPS, fp8_triton.FAST_DIV, fp8_triton.STREAM)])
    fp8_triton.configure(kernel=saved[0], persist=saved[1])
    return groups


def sweep() -> list[list]:
    """Compile groups, most promising first (the budget cuts from the end)."""
    # Static facts (sm_90a, ptxas): prefetch keeps two tiles in registers (8 warps: 128
    # registers, 2 programs per SM; 16 warps: ~100, 1 per SM); tl.range(num_stages=S)
    # stages S-1 tiles in shared memory through cp.async (32 KB each; 16 warps: 63
    # registers, so 2 programs per SM with 2-3 tiles each in flight).
    groups: list[list] = [
        [_tile(16, False)], [_tile(8, True)],
        _persist_group(16, 3, False, grids=(1, 2, 3)), _persist_group(8, 1, True, grids=(1, 2, 3, 4, 6)), _persist_group(16, 4, False, grids=(1, 2)),
        _persist_group(8, 3, False, grids=(1, 2, 3)), _persist_group(16, 1, True, grids=(1, 2)),
        _persist_group(16, 2, False, grids=(2, 3, 4)), _persist_group(8, 4, False, grids=(1, 2)),
        _persist_group(8, 2, False), _persist_group(4, 1, True, grids=(2, 4, 6, 8)), _persist_group(4, 3, False, grids=(2, 4)),
        _persist_group(16, 3, False, stream=True, grids=(1, 2)), _persist_group(8, 1, True, stream=True, grids=(2, 4)),
        _persist_group(16, 3, False, fast=False, grids=(2,)), _persist_group(8, 1, True, fast=False, grids=(2,)),
        [_tile(16, True)], [_tile(32, False)], [_tile(16, False, stream=True)],
        _persist_group(8, 1, True, grids=(2, 6), fused=False), _persist_group(4, 1, True, grids=(8,), fused=False),
    ]
    return groups


def _configure(prog, name: str) -> None:
    """Point ``prog`` at variant ``name`` (its tables stay; a fused layout is built on first use)."""
    fp8_triton.configure_from_string(name)
    prog.kernel = fp8_triton.KERNEL
    if prog.kernel == "persist":
        prog.persist.variant = fp8_triton.PERSIST
    else:
        prog.num_warps, prog.fast_div, prog.stream = fp8_triton.NUM_WARPS, fp8_triton.FAST_DIV, fp8_triton.STREAM


def _overlap(prog, best: str, fused: list[str], jobs, ns, dev: torch.device) -> dict:
    """The refit's unquantized bf16 copies (the preset's embeddings, lm_head and norms,
    random 16-bit patterns) next to the kernel, as the zmq pull issued them before copy
    tiles (variant ``best``): copies alone, kernel alone, copies issued first then the
    kernel on its side stream (the fence), kernel first. Then, per fused variant, one
    program with those copies as copy tiles (copies + quantize in one launch; what it
    leaves to torch is in the timed call too), its copies checked bit for bit."""
    from policyworker.layout.formats import Fp8Target
    from policyworker.models import param_specs as specs

    _configure(prog, best)
    rest = [s for n, (s, _) in specs(get_preset(ns.preset), torch.bfloat16).items() if not Fp8Target().targets(n)]
    pairs = [(torch.randint(-(2**15), 2**15, s, dtype=torch.int16, device=dev).view(torch.bfloat16),
              torch.empty(s, dtype=torch.bfloat16, device=dev)) for s in rest]

    def copies():
        for a, b in pairs:
            b.copy_(a, non_blocking=True)

    def fenced():
        prog.fence()
        copies()
        prog.run(fenced=True)

    def kernel_first():
        prog.run(join=False)
        copies()
        torch.cuda.current_stream(dev).wait_stream(fp8_triton._side_stream(dev))

    out = {"variant": best, "copies": len(pairs), "bytes": sum(2 * a.numel() for a, _ in pairs),
           "copies_s": _time(copies, ns.reps), "kernel_s": _time(prog.run, ns.reps),
           "copies_first_s": _time(fenced, ns.reps), "kernel_first_s": _time(kernel_first, ns.reps)}
    with_tiles: dict[str, float] = {}
    exact: dict[str, bool] = {}
    for name in fused:
        fp8_triton.configure_from_string(name)
        one = fp8_triton.QuantProgram(jobs, copies=pairs)
        left = one.copies_left

        def both(one=one, left=left):  # bound now: nothing here outlives the loop
            one.fence()
            for a, b in left:
                b.copy_(a, non_blocking=True)
            one.run(fenced=True)

        for _, b in pairs:
            b.view(torch.int16).fill_(0x7FC1)  # poison: a tile left uncopied shows
        with_tiles[name] = _time(both, ns.reps)
        _sync()
        exact[name] = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in pairs)
        out.setdefault("copy_tiles", {})[name] = {"copy_bytes": one.copy_bytes, "copies_left": len(left),
                                                  "launches": one.persist.launches}
        del one, left, both
    if with_tiles:
        out["with_copy_tiles_s"] = with_tiles
        out["copy_tiles_exact"] = exact
        ok = [n for n in with_tiles if exact[n]]
        if ok:
            pick = min(ok, key=with_tiles.get)
            out["best_with_copy_tiles"], out["best_with_copy_tiles_s"] = pick, with_tiles[pick]
    pairs.clear()  # the buffers go; the closures above are done with them
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--budget-s", type=float, default=75.0, help="start no new compile group after this many seconds")
    p.add_argument("--short", action="store_true", help="only the default and its neighbours (short())")
    p.add_argument("--variants", default="", help="';'-separated variant names (as printed) instead of a sweep, "
                   "in that order, e.g. 'kernel=persist,warps=16,stages=3,prefetch=0,grid=2,maxnreg=0'")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    from policyworker.layout.formats import Fp8Target

    target = Fp8Target()
    shapes = [s for n, (s, _) in param_specs(get_preset(ns.preset), torch.bfloat16).items() if target.targets(n)]
    numel = sum(a * b for a, b in shapes)
    src = torch.empty(numel, dtype=torch.bfloat16, device=dev).normal_()
    src[:7].copy_(torch.tensor([-0.0, 0.0, -0.0, 1e-38, -1e-38, -0.0, 3.0]))  # signed zeros in the data
    k0 = shapes[0][1]
    src[k0 * 128:k0 * 256].view(128, k0)[:, :128] = 0  # an all-zero block in the first job
    src[k0 * 129 + 5] = -0.0
    dst = torch.empty(numel, dtype=torch.uint8, device=dev)
    nscale = sum(-(-a // 128) * -(-b // 128) for a, b in shapes)
    scales = torch.empty(nscale, dtype=torch.float32, device=dev)
    jobs, off, soff = [], 0, 0
    for a, b in shapes:
        br, bc = -(-a // 128), -(-b // 128)
        jobs.append((src[off:off + a * b].view(a, b), dst[off:off + a * b].view(a, b).view(torch.float8_e4m3fn),
                     scales[soff:soff + br * bc].view(br, bc)))
        off, soff = off + a * b, soff + br * bc
    flat = [torch.empty_like(src)]
    res: dict = {"preset": ns.preset, "tensors": len(jobs), "bf16_bytes": 2 * numel}
    res["flat_copy_s"] = _time(lambda: flat[0].copy_(src), ns.reps)
    flat.clear()  # its 13.9 GB go before the oracle's buffers come
    # The oracle's bytes for the whole model (plain torch, one band of blocks at a time).
    want_q = torch.empty_like(dst)
    want_s = torch.empty_like(scales)
    off, soff = 0, 0
    for a, b in shapes:
        br, bc = -(-a // 128), -(-b // 128)
        quantize_bands(src[off:off + a * b].view(a, b), want_q[off:off + a * b].view(a, b).view(torch.float8_e4m3fn),
                       want_s[soff:soff + br * bc].view(br, bc))
        off, soff = off + a * b, soff + br * bc
    _sync()
    res["oracle_s"] = round(time.perf_counter() - t_start, 2)
    fp8_triton.configure(kernel="tile")
    prog = fp8_triton.QuantProgram(jobs)
    res["fp8_plus_scale_bytes"] = prog.nbytes
    res["launches"] = {"tile": len(prog._launches), "persist": prog.persist.launches}
    variants: dict[str, float] = {}
    exact_of: dict[str, bool] = {}
    errors: dict[str, str] = {}
    skipped: list[str] = []
    for group in (_named(ns.variants) if ns.variants else short() if ns.short else sweep()):
        names = [g[0] if isinstance(g, tuple) else g.name() for g in group]
        if time.perf_counter() - t_start > ns.budget_s:
            skipped += names
            continue
        for item, name in zip(group, names):
            if isinstance(item, tuple):
                kw = item[1]
                prog.kernel, prog.num_warps, prog.fast_div, prog.stream = "tile", kw["num_warps"], kw["fast_div"], \
                    kw["stream"]
            else:
                prog.kernel, prog.persist.variant = "persist", item
            dst.fill_(0x7F)  # poisoned (NaN), so a tile left unwritten shows
            scales.fill_(float("nan"))
            try:
                with _stderr_tail() as diag:
                    variants[name] = _time(prog.run if dev.type == "cuda" else prog.launch, ns.reps)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result row
                errors[name] = _error_text(exc) + ("\n-- stderr --\n" + diag[0] if diag[0] else "")
                _sync()
                break  # the rest of the group shares the compile
            _sync()
            exact_of[name] = bool(torch.equal(dst, want_q) and torch.equal(scales, want_s))
    rw = 2 * numel + prog.nbytes
    res["quantize_ms"] = {n: round(v * 1e3, 3) for n, v in variants.items()}
    res["bit_exact"] = exact_of
    res["all_exact"] = all(exact_of.values())
    res["errors"] = errors
    res["skipped"] = skipped
    res["quantize_s"] = variants
    exact = [n for n in variants if exact_of[n]]
    if exact:
        best = min(exact, key=variants.get)
        res["best"] = best
        res["best_quantize_s"] = variants[best]
        res["best_quantize_gbps"] = rw / variants[best] / 1e9
        res["best_quantize_over_flat_copy"] = variants[best] / res["flat_copy_s"]
        old = [n for n in exact if not n.startswith("kernel=persist")]
        if old:
            res["best_tile"] = min(old, key=variants.get)
            res["best_tile_s"] = variants[res["best_tile"]]
    if exact and dev.type == "cuda":
        fused = sorted((n for n in exact if "fused=1" in n), key=variants.get)[:4]
        for v in (PersistVariant(), PersistVariant(torch_min_mib=0)):  # the default, and all copies in its launch
            if v.name() in exact and v.name() not in fused:
                fused.append(v.name())
        res["with_bf16_copies"] = ov = _overlap(prog, best, fused, jobs, ns, dev)
        # what a refit would run: copy tiles in the launch, or the copies first then the kernel
        res["best_with_copies"] = min([(ov.get("best_with_copy_tiles_s", float("inf")),
                                        ov.get("best_with_copy_tiles", "")), (ov["copies_first_s"], best)])[1]
    res["flat_copy_gbps"] = 2 * 2 * numel / res["flat_copy_s"] / 1e9
    res["kernel_at_flat_copy_rate_s"] = rw / (res["flat_copy_gbps"] * 1e9)
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_json(ns.json, res, echo=True, indent=1)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
