"""The delta path's device work on a GPU: the Triton kernels against the torch path and a flat copy.

A delta refit does, per stream of a bucket, on the trainer: a checksum per copy, the
encoding against the shadow, the shadow refresh; on the receiver: ``apply`` the blob,
then a checksum per copy. This measures, on one CUDA device, for a bf16 stream of
``--gib`` GiB and each changed fraction, interleaved within each repetition:

* ``copy``: one flat device copy of the whole stream (the ceiling of any full refit's
  local work, and the unit of the encode goal: at 3% changed, encode <= 2 copies);
* ``encode``: the torch path (compare, ``nonzero``, gather) and the kernels (one scan
  of both sides with the checksum of the current bytes, one gather), and each with
  the shadow refresh (torch: ``apply`` onto the shadow; kernels: in the gather);
* ``checksum``: of the whole stream and per copy (``--copies`` copies of random sizes,
  one launch with the kernels, one call each on the torch path);
* ``apply`` (torch; the receiver's step).

Before timing, at every fraction, the kernels' blob must be byte for byte the torch
path's (kind, count, bytes), their checksums the torch path's, the refreshed shadow
the current bytes, and apply(old, blob) the current bytes: any mismatch, or kernels
that cannot run on the device, exits 1. Each row also gives the kernels' encoding
step by step (CUDA events: the scan, the sums and the one host sync, the blob's glue,
the prefix sum, the gather). ``--sweep`` also times the kernels at
``--sweep-fractions`` changed (3%) under tile sizes, warp counts, refreshing passes and
the passes' forms (``words``/``units`` scan, ``bits``/``units`` gather; each variant
checked first, then timed with its steps; the library's defaults stay as they are) and
names the fastest.

Usage: python benchmarks/bench_delta_encode.py --json out.json [--gib 2] [--reps 5] [--sweep]
(``--device cpu`` with ``TRITON_INTERPRET=1`` and a small ``--gib`` runs the script's
logic in Triton's interpreter: a dry run, its times mean nothing.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from policyworker.layout import delta

#: (tile bytes, warps, refreshing pass, scan form, gather form) tried by --sweep; the first is the
#: library's default, the "units"/"units" rows are the first kernels
_SWEEP = [(16384, 4, "gather", "units", "bits"), (8192, 4, "gather", "words", "bits"), (8192, 4, "scan", "words", "bits"),
          (4096, 4, "gather", "words", "bits"), (16384, 4, "gather", "words", "bits"),
          (32768, 8, "gather", "words", "bits"), (4096, 2, "gather", "words", "bits"),
          (2048, 2, "gather", "words", "bits"), (2048, 1, "gather", "words", "bits"),
          (8192, 4, "gather", "units", "bits"), (8192, 2, "gather", "units", "bits"),
          (4096, 4, "gather", "units", "bits"), (4096, 2, "gather", "units", "bits"),
          (4096, 1, "gather", "units", "bits"), (2048, 2, "gather", "units", "bits"),
          (2048, 1, "gather", "units", "bits"), (16384, 2, "gather", "units", "bits"),
          (8192, 4, "gather", "words", "units"), (8192, 4, "gather", "units", "units")]
#: the encoding's steps, as layout.delta marks them: (name, from mark, to mark)
_STEPS = [("scan", "start", "scan"), ("sums_sync", "scan", "sync"), ("blob_glue", "sync", "glue"),
          ("prefix", "glue", "prefix"), ("gather", "prefix", "gather")]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, reps: int = 1) -> list[float]:
    out = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def _steps(ops, fn, reps: int, setup=None) -> dict:
    """Median device time (s) of each step of the kernels' encoding (CUDA events that
    ``layout.delta`` records when ``ops.PROFILE`` is a list), and of the whole on the host
    (``wall``); ``setup`` runs before each repetition, untimed."""
    if not torch.cuda.is_available():
        return {}
    got = {name: [] for name, _, _ in _STEPS}
    got["wall"] = []
    for _ in range(reps):
        if setup is not None:
            setup()
        ops.PROFILE = []
        try:
            got["wall"] += _timed(fn)
            at = dict(ops.PROFILE)
        finally:
            ops.PROFILE = None
        for name, a, b in _STEPS:
            if a in at and b in at:
                got[name].append(at[a].elapsed_time(at[b]) / 1e3)
    return {name: statistics.median(v) for name, v in got.items() if v}


def _segments(nbytes: int, copies: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """``copies`` back-to-back byte ranges of random (even) sizes covering the stream."""
    cuts = sorted({int(c) * 2 for c in torch.randint(1, nbytes // 2, (copies - 1,), generator=gen)})
    bounds = [0, *cuts, nbytes]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _torch_refresh(cur: torch.Tensor, shadow: torch.Tensor) -> None:
    """The torch path's encode then shadow refresh (``apply`` of the blob onto it)."""
    enc = delta._encode_torch(cur, shadow)
    delta.apply(shadow, enc.kind, enc.count, enc.blob)


def _check(ops, cur, old, raw, segments) -> list[str]:
    """Mismatches of the kernels against the torch path (empty: bit for bit equal)."""
    bad = []
    want = delta._encode_torch(cur, old)
    shadow = old.clone()
    got = delta._encode_fused(ops, cur, shadow, True, True)
    if (got.kind, got.count) != (want.kind, want.count) or not torch.equal(got.blob, want.blob):
        bad.append(f"blob: kernels {got.kind}/{got.count}/{got.blob.numel()} B, torch {want.kind}/{want.count}/"
                   f"{want.blob.numel()} B")
    ref = delta._checksum_torch(raw)
    if got.checksum != ref or delta._checksums_fused(ops, raw, [(0, raw.numel())])[0] != ref:
        bad.append("stream checksum")
    if not torch.equal(shadow, cur):
        bad.append("shadow refresh")
    base = old.clone()
    delta.apply(base, got.kind, got.count, got.blob)
    if not torch.equal(base, cur):
        bad.append("apply(old, blob) != cur")
    if delta._checksums_fused(ops, raw, segments) != [delta._checksum_torch(raw.narrow(0, a, n)) for a, n in segments]:
        bad.append("per-copy checksums")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--link-gbs", type=float, default=50.0, help="link speed for the modelled wire time (GB/s)")
    ap.add_argument("--fractions", default="0.001,0.01,0.03,0.1")
    ap.add_argument("--copies", type=int, default=400, help="copies per stream for the per-copy checksums")
    ap.add_argument("--sweep", action="store_true",
                    help="also time a few tile sizes / warp counts / kernel forms (at --sweep-fractions)")
    ap.add_argument("--sweep-fractions", default="0.03")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a dry run in Triton's interpreter)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_delta_encode: needs a CUDA device (the comparison it promises is on GPU memory)", file=sys.stderr)
        return 1
    try:
        from policyworker.ops import delta_triton as ops
    except ImportError as exc:
        print(f"bench_delta_encode: the Triton kernels do not import ({exc}); nothing to compare", file=sys.stderr)
        return 1
    dev = torch.device(args.device)
    if dev.type == "cpu":
        delta._fused = lambda *ts: ops  # the dry run: CPU tensors through the interpreted kernels
    n = int(args.gib * (1 << 30)) // 2
    gen = torch.Generator(device=dev).manual_seed(0)
    old = torch.randn(n, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)
    segments = _segments(2 * n, args.copies, torch.Generator().manual_seed(1))
    if delta._fused(old, old) is not ops:
        print("bench_delta_encode: layout.delta does not pick the kernels for CUDA tensors", file=sys.stderr)
        return 1
    rows, failures = [], {}
    for frac in (float(f) for f in args.fractions.split(",")):
        cur = old.clone()
        k = max(1, int(n * frac))
        idx = torch.randperm(n, generator=gen, device=dev)[:k]
        cur[idx] = cur[idx] ^ 1  # flip the lowest mantissa bit: a real, small change
        del idx
        raw = cur.view(torch.uint8)
        try:
            bad = _check(ops, cur, old, raw, segments)  # compiles the kernels too
        except Exception as exc:  # a kernel that does not compile or run here: reported, the sweep still runs
            bad = [f"{type(exc).__name__}: {exc}"[:2000]]
        if bad:
            failures[f"{frac}"] = bad
            print(f"{frac:>6.3%}: KERNELS DIFFER FROM THE TORCH PATH: {bad}", flush=True)
            continue
        dst = torch.empty_like(old)
        shadow = torch.empty_like(old)
        s = {name: [] for name in ("copy", "encode_torch", "encode_kernels", "encode_torch_refresh",
                                   "encode_kernels_refresh", "apply", "checksum_torch", "checksum_kernels",
                                   "copies_torch", "copies_kernels")}
        box = {}
        for _ in range(args.reps):  # interleaved: the ceiling, then each step, per repetition
            s["copy"] += _timed(lambda: dst.copy_(cur))
            s["encode_torch"] += _timed(lambda: box.__setitem__("t", delta._encode_torch(cur, old)))
            s["encode_kernels"] += _timed(lambda: box.__setitem__("k", delta._encode_fused(ops, cur, old, False, True)))
            shadow.copy_(old)
            s["encode_torch_refresh"] += _timed(lambda: _torch_refresh(cur, shadow))
            shadow.copy_(old)
            s["encode_kernels_refresh"] += _timed(lambda: delta._encode_fused(ops, cur, shadow, True, True))
            enc = box["k"]
            dst.copy_(old)
            s["apply"] += _timed(lambda: delta.apply(dst, enc.kind, enc.count, enc.blob))
            s["checksum_torch"] += _timed(lambda: delta._checksum_torch(raw))
            s["checksum_kernels"] += _timed(lambda: delta.checksum(raw))
            s["copies_torch"] += _timed(lambda: [delta._checksum_torch(raw.narrow(0, a, b)) for a, b in segments])
            s["copies_kernels"] += _timed(lambda: delta.checksums(raw, segments))
        exact = bool(torch.equal(dst, cur)) and torch.equal(shadow, cur)
        med = {name: statistics.median(v) for name, v in s.items()}
        steps = _steps(ops, lambda: delta._encode_fused(ops, cur, old, False, True), args.reps)
        steps_refresh = _steps(ops, lambda: delta._encode_fused(ops, cur, shadow, True, True), args.reps,
                               setup=lambda: shadow.copy_(old))
        full_bytes = 2 * n
        blob = int(box["k"].blob.numel())
        wire_full = full_bytes / (args.link_gbs * 1e9)
        wire_delta = blob / (args.link_gbs * 1e9)
        # the device work of one delta, both sides: trainer checksums + encode (+ refresh), receiver apply + checksums
        work_torch = med["copies_torch"] + med["encode_torch_refresh"] + med["apply"] + med["copies_torch"]
        work_kernels = med["copies_kernels"] + med["encode_kernels_refresh"] + med["apply"] + med["copies_kernels"]
        row = {
            "changed_fraction": frac, "changed_units": box["k"].count, "kind": box["k"].kind, "exact": exact,
            "stream_bytes": full_bytes, "blob_bytes": blob, "blob_over_full": blob / full_bytes,
            "copies": len(segments),
            **{f"{name}_s": v for name, v in med.items()},
            "copy_gbs": full_bytes / med["copy"] / 1e9,
            "encode_kernels_over_copy": med["encode_kernels"] / med["copy"],
            "encode_kernels_refresh_over_copy": med["encode_kernels_refresh"] / med["copy"],
            "encode_torch_over_copy": med["encode_torch"] / med["copy"],
            "checksum_kernels_gbs": full_bytes / med["checksum_kernels"] / 1e9,
            "device_work_torch_s": work_torch, "device_work_kernels_s": work_kernels,
            "modelled_full_s": wire_full + med["copy"],
            "modelled_delta_torch_over_full": (wire_delta + work_torch) / (wire_full + med["copy"]),
            "modelled_delta_kernels_over_full": (wire_delta + work_kernels) / (wire_full + med["copy"]),
            "steps_s": steps, "steps_refresh_s": steps_refresh,
            "steps_over_copy": {k: v / med["copy"] for k, v in steps.items()},
            "samples": s,
        }
        rows.append(row)
        print(f"{frac:>6.3%}: blob {blob / full_bytes:.4f} x | copy {med['copy'] * 1e3:.2f} ms "
              f"({row['copy_gbs']:.0f} GB/s) | encode torch {med['encode_torch'] * 1e3:.2f} ms, kernels "
              f"{med['encode_kernels'] * 1e3:.2f} ms ({row['encode_kernels_over_copy']:.2f} copies; with the shadow "
              f"refresh {med['encode_kernels_refresh'] * 1e3:.2f} ms, torch {med['encode_torch_refresh'] * 1e3:.2f}) "
              f"| checksum torch {med['checksum_torch'] * 1e3:.2f} ms, kernels {med['checksum_kernels'] * 1e3:.2f} ms; "
              f"{len(segments)} copies torch {med['copies_torch'] * 1e3:.2f} ms, kernels "
              f"{med['copies_kernels'] * 1e3:.2f} ms | apply {med['apply'] * 1e3:.2f} ms | on {args.link_gbs:.0f} GB/s "
              f"delta {row['modelled_delta_kernels_over_full']:.3f} x full (torch path "
              f"{row['modelled_delta_torch_over_full']:.3f}) | exact={exact}", flush=True)
        if steps:
            print("        steps (ms, in copies): " + ", ".join(f"{k} {v * 1e3:.3f} ({v / med['copy']:.2f})"
                                                         for k, v in steps.items())
                  + " | with the refresh: " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in steps_refresh.items()),
                  flush=True)
    sweep = []
    if args.sweep:  # every variant is checked before it is timed
        for frac in (float(f) for f in args.sweep_fractions.split(",")):
            sweep += _sweep(ops, old, n, gen, args.reps, frac)
    goal = [r for r in rows if abs(r["changed_fraction"] - 0.03) < 1e-9]
    if goal:
        ratio = goal[0]["encode_kernels_over_copy"]
        print(f"goal (encode at 3% changed <= 2 flat copies): {ratio:.2f} copies -> "
              f"{'met' if ratio <= 2 else 'NOT met'}", flush=True)
    failures.update({f"sweep {r['changed_fraction']} {r['tile_bytes']} B {r['num_warps']} warps {r['refresh']} "
                     f"{r['scan']}/{r['gather']}": [r.get("error", "blob, checksum or refresh")]
                     for r in sweep if not r["exact"]})
    best = min((r for r in sweep if r["exact"]), key=lambda r: r["encode_over_copy"], default=None)
    if best is not None:
        print(f"best of the sweep: tile {best['tile_bytes']} B, {best['num_warps']} warps, scan {best['scan']}, "
              f"gather {best['gather']}: {best['encode_over_copy']:.2f} copies", flush=True)
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)",
           "torch": torch.__version__, "triton": __import__("triton").__version__, "gib": args.gib, "reps": args.reps,
           "link_gbs": args.link_gbs, "tile_bytes": ops.TILE_BYTES, "num_warps": ops.NUM_WARPS,
           "refresh": ops.REFRESH, "scan": ops.SCAN, "gather": ops.GATHER, "rows": rows, "sweep": sweep,
           "sweep_best": best, "failures": failures}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    if failures:
        print(f"bench_delta_encode: the kernels differ from the torch path at {sorted(failures)}", file=sys.stderr)
        return 1
    return 0 if all(r["exact"] for r in rows) else 1


def _sweep(ops, old: torch.Tensor, n: int, gen: torch.Generator, reps: int, fraction: float) -> list[dict]:
    """The kernels at ``fraction`` changed under other tile sizes / warps / refreshing passes /
    forms (each checked against the torch path, then timed, step by step too)."""
    cur = old.clone()
    idx = torch.randperm(n, generator=gen, device=old.device)[:max(1, int(n * fraction))]
    cur[idx] = cur[idx] ^ 1
    del idx
    raw = cur.view(torch.uint8)
    want = delta._encode_torch(cur, old)
    ref = delta._checksum_torch(raw)
    dst = torch.empty_like(old)
    shadow = torch.empty_like(old)
    out = []
    default = (ops.TILE_BYTES, ops.NUM_WARPS, ops.REFRESH, ops.SCAN, ops.GATHER)
    try:
        for tile, warps, refresh, scan, gather in _SWEEP:
            ops.configure(tile_bytes=tile, num_warps=warps, refresh=refresh, scan=scan, gather=gather)
            shadow.copy_(old)
            try:
                got = delta._encode_fused(ops, cur, shadow, True, True)
            except Exception as exc:  # this variant does not compile or run here: a failure row, the rest go on
                out.append({"changed_fraction": fraction, "tile_bytes": tile, "num_warps": warps, "refresh": refresh,
                            "scan": scan, "gather": gather, "exact": False,
                            "error": f"{type(exc).__name__}: {exc}"[:2000]})
                print(f"  sweep {fraction:.1%}: tile {tile} B, {warps} warps, {refresh}, {scan}/{gather}: "
                      f"FAILED {out[-1]['error'][:300]}", flush=True)
                continue
            ok = (torch.equal(got.blob, want.blob) and got.checksum == ref and delta.checksum(raw) == ref
                  and torch.equal(shadow, cur))
            copy, enc, ref_s, ck = [], [], [], []
            for _ in range(reps):
                copy += _timed(lambda: dst.copy_(cur))
                enc += _timed(lambda: delta._encode_fused(ops, cur, old, False, True))
                shadow.copy_(old)
                ref_s += _timed(lambda: delta._encode_fused(ops, cur, shadow, True, True))
                ck += _timed(lambda: delta.checksum(raw))
            steps = _steps(ops, lambda: delta._encode_fused(ops, cur, old, False, True), reps)
            row = {"changed_fraction": fraction, "tile_bytes": tile, "num_warps": warps, "refresh": refresh,
                   "scan": scan, "gather": gather, "exact": bool(ok),
                   "copy_s": statistics.median(copy), "encode_s": statistics.median(enc),
                   "encode_refresh_s": statistics.median(ref_s), "checksum_s": statistics.median(ck),
                   "steps_s": steps}
            row["encode_over_copy"] = row["encode_s"] / row["copy_s"]
            row["steps_over_copy"] = {k: v / row["copy_s"] for k, v in steps.items()}
            row["encode_refresh_over_copy"] = row["encode_refresh_s"] / row["copy_s"]
            out.append(row)
            print(f"  sweep {fraction:.1%}: tile {tile} B, {warps} warps, refresh in the {refresh}, scan {scan}, "
                  f"gather {gather}: encode {row['encode_s'] * 1e3:.2f} ms "
                  f"({row['encode_over_copy']:.2f} copies), with the refresh {row['encode_refresh_s'] * 1e3:.2f} ms "
                  f"({row['encode_refresh_over_copy']:.2f}), checksum {row['checksum_s'] * 1e3:.2f} ms, exact={ok}"
                  + ("; steps (ms) " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in steps.items()) if steps else ""),
                  flush=True)
    finally:
        ops.configure(tile_bytes=default[0], num_warps=default[1], refresh=default[2], scan=default[3],
                      gather=default[4])
    return out


if __name__ == "__main__":
    sys.exit(main())
