"""The delta path's device work on a GPU: the Triton kernels against the torch path and a flat copy.

A delta refit does, per stream of a bucket, on the trainer: a checksum per copy, the
encoding against the shadow, the shadow refresh; on the receiver: ``apply`` the blob,
then a checksum per copy. This measures, on one CUDA device, for a bf16 stream of
``--gib`` GiB and each changed fraction, interleaved within each repetition:

* ``copy``: one flat device copy of the whole stream (the ceiling of any full refit's
  local work, and the unit of the encode goal: at 3% changed, encode <= 2 copies);
* ``encode``: the torch path (compare, ``nonzero``, gather) and the kernels (one scan
  of both sides with the checksum of the current bytes, one gather), and each with
  the shadow refresh (torch: ``apply`` onto the shadow; kernels: the library's pass, the scan's
  masked stores, or ``--refresh gather|scan|masked``);
* ``checksum``: of the whole stream and per copy (``--copies`` copies of random sizes,
  one launch with the kernels, one call each on the torch path);
* ``apply`` (torch; the receiver's step).

Before timing, at every fraction, the kernels' blob must be byte for byte the torch
path's (kind, count, bytes), their checksums the torch path's, the refreshed shadow
the current bytes, and apply(old, blob) the current bytes: any mismatch, or kernels
that cannot run on the device, exits 1. Each row also gives the kernels' encoding
step by step (CUDA events, each step named by its end: the scan; the prefix, i.e. the
tiles' starts and the totals; the sync, the one read of the totals to the host; the glue,
torch's blob header and padding, only with the torch finish; the gather) and, interleaved,
the kernels with the torch finish (torch sums, cumsum and copies
between the scan and the gather) and with the tiles finish (the scan keeps each tile's
changed units, a compaction replaces the gather's second read of the stream). ``--sweep`` also times the kernels at
``--sweep-fractions`` changed (3%) under tile sizes, warp counts, refreshing passes,
the passes' forms (``words``/``units`` scan, ``bits``/``units`` gather), the finish and
the prefix's chunk (each variant checked first, then timed with its steps; the library's
defaults stay as they are) and names the fastest at each fraction.

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

#: (tile bytes, warps, refreshing pass, scan form, gather form, finish, plan chunk[, the tiles scan's step in
#: bytes, whether it loads a step ahead]) tried by --sweep; the first is
#: the library's default, the second the kernels with the torch finish (refreshing in the gather), the
#: "units"/"units" rows the first kernels
_SWEEP = [(16384, 4, "masked", "units", "bits", "mixed", 4096), (16384, 4, "gather", "units", "bits", "torch", 4096),
          (16384, 4, "gather", "units", "bits", "device", 4096), (32768, 8, "gather", "units", "bits", "mixed", 4096),
          (32768, 8, "gather", "words", "bits", "mixed", 4096), (16384, 4, "gather", "words", "bits", "mixed", 4096),
          (8192, 4, "gather", "words", "bits", "mixed", 4096), (8192, 4, "gather", "units", "bits", "mixed", 4096),
          (16384, 4, "scan", "units", "bits", "mixed", 4096), (32768, 8, "scan", "units", "bits", "mixed", 4096),
          (16384, 4, "scan", "units", "bits", "torch", 4096),
          (16384, 4, "gather", "units", "bits", "mixed", 4096), (16384, 4, "masked", "words", "bits", "mixed", 4096),
          (32768, 8, "masked", "units", "bits", "mixed", 4096), (8192, 4, "masked", "units", "bits", "mixed", 4096),
          (16384, 4, "masked", "units", "bits", "torch", 4096),
          (8192, 4, "gather", "words", "bits", "device", 4096), (8192, 4, "scan", "words", "bits", "device", 4096),
          (4096, 4, "gather", "words", "bits", "device", 4096), (16384, 4, "gather", "words", "bits", "device", 4096),
          (32768, 8, "gather", "words", "bits", "device", 4096), (4096, 2, "gather", "words", "bits", "device", 4096),
          (2048, 2, "gather", "words", "bits", "device", 4096), (8192, 4, "gather", "units", "bits", "device", 4096),
          (8192, 2, "gather", "units", "bits", "device", 4096), (4096, 4, "gather", "units", "bits", "device", 4096),
          (4096, 2, "gather", "units", "bits", "device", 4096), (2048, 2, "gather", "units", "bits", "device", 4096),
          (16384, 2, "gather", "units", "bits", "device", 4096), (32768, 8, "gather", "units", "bits", "device", 4096),
          (16384, 4, "gather", "units", "bits", "device", 1024), (16384, 4, "gather", "units", "bits", "device", 16384),
          (8192, 4, "gather", "units", "bits", "torch", 4096), (8192, 4, "gather", "words", "bits", "torch", 4096),
          (8192, 4, "gather", "words", "units", "device", 4096), (8192, 4, "gather", "units", "units", "device", 4096),
          (16384, 4, "gather", "units", "bits", "fused", 4096), (8192, 4, "gather", "units", "bits", "fused", 4096),
          (4096, 4, "gather", "units", "bits", "fused", 4096), (4096, 2, "gather", "units", "bits", "fused", 4096),
          (2048, 2, "gather", "units", "bits", "fused", 4096), (8192, 8, "gather", "units", "bits", "fused", 4096),
          (16384, 8, "gather", "units", "bits", "fused", 4096), (8192, 4, "scan", "units", "bits", "fused", 4096),
          *[(tile, warps, refresh, "units", "bits", "tiles", 4096, step, ahead)
            for tile, warps, refresh, step, ahead in (
                (16384, 4, "gather", 4096, False), (16384, 4, "gather", 2048, False), (16384, 4, "gather", 8192, False),
                (16384, 8, "gather", 4096, False), (16384, 8, "gather", 8192, False), (8192, 4, "gather", 4096, False),
                (8192, 4, "gather", 2048, False), (4096, 2, "gather", 2048, False), (16384, 8, "gather", 4096, True),
                (32768, 8, "gather", 4096, True), (16384, 4, "gather", 2048, True), (8192, 8, "gather", 2048, True),
                (16384, 4, "scan", 4096, False))]]


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
    """Median device time (s) of each step of the kernels' encoding: from one CUDA event that
    ``layout.delta`` / the kernels record when ``ops.PROFILE`` is a list to the next, named
    by the later (scan, prefix, sync, [glue,] gather); and of the whole on the host (``wall``);
    ``setup`` runs before each repetition, untimed."""
    if not torch.cuda.is_available():
        return {}
    got = {"wall": []}
    for _ in range(reps):
        if setup is not None:
            setup()
        ops.PROFILE = []
        try:
            got["wall"] += _timed(fn)
            marks = list(ops.PROFILE)
        finally:
            ops.PROFILE = None
        for (_, a), (name, b) in zip(marks, marks[1:]):
            got.setdefault(name, []).append(a.elapsed_time(b) / 1e3)
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
    ap.add_argument("--sweep-finishes", default="device,torch,fused,tiles",
                    help="the sweep's rows of these finishes only (the fused scan in a process of its own: a kernel "
                         "that hangs there cannot take the other rows with it)")
    ap.add_argument("--refresh", choices=("gather", "scan", "masked"), default=None,
                    help="the pass that refreshes the shadow in the measured encodes (default: the library's)")
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
    if args.refresh:
        ops.configure(refresh=args.refresh)
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
            bad += [f"tiles finish: {b}" for b in _finished(ops, "tiles", _check, cur, old, raw, segments)]
        except Exception as exc:  # a kernel that does not compile or run here: reported, the sweep still runs
            bad = [f"{type(exc).__name__}: {exc}"[:2000]]
        if bad:
            failures[f"{frac}"] = bad
            print(f"{frac:>6.3%}: KERNELS DIFFER FROM THE TORCH PATH: {bad}", flush=True)
            continue
        dst = torch.empty_like(old)
        shadow = torch.empty_like(old)
        s = {name: [] for name in ("copy", "encode_torch", "encode_kernels", "encode_kernels_torch_finish",
                                   "encode_kernels_tiles_finish",
                                   "encode_torch_refresh", "encode_kernels_refresh", "apply", "checksum_torch",
                                   "checksum_kernels", "copies_torch", "copies_kernels")}
        box = {}
        for _ in range(args.reps):  # interleaved: the ceiling, then each step, per repetition
            s["copy"] += _timed(lambda: dst.copy_(cur))
            s["encode_torch"] += _timed(lambda: box.__setitem__("t", delta._encode_torch(cur, old)))
            s["encode_kernels"] += _timed(lambda: box.__setitem__("k", delta._encode_fused(ops, cur, old, False, True)))
            s["encode_kernels_torch_finish"] += _timed(lambda: _finished(ops, "torch", _encode, cur, old))
            s["encode_kernels_tiles_finish"] += _timed(lambda: _finished(ops, "tiles", _encode, cur, old))
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
            "encode_kernels_over_copy_per_rep": [e / c for e, c in zip(s["encode_kernels"], s["copy"])],
            "encode_kernels_torch_finish_over_copy": med["encode_kernels_torch_finish"] / med["copy"],
            "encode_kernels_tiles_finish_over_copy": med["encode_kernels_tiles_finish"] / med["copy"],
            "encode_kernels_tiles_finish_over_copy_per_rep": [e / c for e, c in zip(s["encode_kernels_tiles_finish"],
                                                                                     s["copy"])],
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
              f"{med['encode_kernels'] * 1e3:.2f} ms ({row['encode_kernels_over_copy']:.2f} copies; torch finish "
              f"{row['encode_kernels_torch_finish_over_copy']:.2f}; tiles finish "
              f"{row['encode_kernels_tiles_finish_over_copy']:.2f}; with the shadow "
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
            sweep += _sweep(ops, old, n, gen, args.reps, frac, set(args.sweep_finishes.split(",")))
    goal = [r for r in rows if abs(r["changed_fraction"] - 0.03) < 1e-9]
    if goal:
        ratio, worst = goal[0]["encode_kernels_over_copy"], max(goal[0]["encode_kernels_over_copy_per_rep"])
        print(f"goal (encode at 3% changed < 2 flat copies, defaults): median {ratio:.2f} copies, worst repetition "
              f"{worst:.2f} -> {'met' if worst < 2 else 'met at the median only' if ratio < 2 else 'NOT met'} "
              f"(torch finish, same run: {goal[0]['encode_kernels_torch_finish_over_copy']:.2f}; tiles finish "
              f"{goal[0]['encode_kernels_tiles_finish_over_copy']:.2f}, worst repetition "
              f"{max(goal[0]['encode_kernels_tiles_finish_over_copy_per_rep']):.2f})", flush=True)
    failures.update({f"sweep {r['changed_fraction']} {_name(r)}": [r.get("error", "blob, checksum or refresh")]
                     for r in sweep if not r["exact"]})
    best = {}
    for r in sweep:
        if r["exact"] and r["encode_over_copy"] < best.get(r["changed_fraction"], {"encode_over_copy": 1e9})[
                "encode_over_copy"]:
            best[r["changed_fraction"]] = r
    for frac, r in best.items():
        print(f"best of the sweep at {frac:.1%}: {_name(r)}: {r['encode_over_copy']:.2f} copies "
              f"(with the refresh {r['encode_refresh_over_copy']:.2f})", flush=True)
    best = best.get(0.03, next(iter(best.values()), None))
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)",
           "torch": torch.__version__, "triton": __import__("triton").__version__, "gib": args.gib, "reps": args.reps,
           "link_gbs": args.link_gbs, "tile_bytes": ops.TILE_BYTES, "num_warps": ops.NUM_WARPS,
           "refresh": ops.REFRESH, "scan": ops.SCAN, "gather": ops.GATHER, "finish": ops.FINISH,
           "plan_chunk": ops.PLAN_CHUNK, "tile_share": ops.TILE_SHARE, "tile_step": ops.TILE_STEP,
           "tile_ahead": ops.TILE_AHEAD, "rows": rows, "sweep": sweep,
           "sweep_best": best, "failures": failures}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    if failures:
        print(f"bench_delta_encode: the kernels differ from the torch path at {sorted(failures)}", file=sys.stderr)
        return 1
    return 0 if all(r["exact"] for r in rows) else 1


def _sweep(ops, old: torch.Tensor, n: int, gen: torch.Generator, reps: int, fraction: float,
           finishes: set[str]) -> list[dict]:
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
    default = dict(tile_bytes=ops.TILE_BYTES, num_warps=ops.NUM_WARPS, refresh=ops.REFRESH, scan=ops.SCAN,
                   gather=ops.GATHER, finish=ops.FINISH, plan_chunk=ops.PLAN_CHUNK, tile_step=ops.TILE_STEP,
                   tile_ahead=ops.TILE_AHEAD)
    try:
        for tile, warps, refresh, scan, gather, finish, chunk, *step in (r for r in _SWEEP if r[5] in finishes):
            setting = {"changed_fraction": fraction, "tile_bytes": tile, "num_warps": warps, "refresh": refresh,
                       "scan": scan, "gather": gather, "finish": finish, "plan_chunk": chunk,
                       **({"tile_step": step[0], "tile_ahead": step[1]} if step else {})}
            ops.configure(tile_bytes=tile, num_warps=warps, refresh=refresh, scan=scan, gather=gather, finish=finish,
                          plan_chunk=chunk, tile_step=step[0] if step else default["tile_step"],
                          tile_ahead=step[1] if step else default["tile_ahead"])
            shadow.copy_(old)
            try:
                got = delta._encode_fused(ops, cur, shadow, True, True)
            except Exception as exc:  # this variant does not compile or run here: a failure row, the rest go on
                out.append({**setting, "exact": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
                print(f"  sweep {fraction:.1%}: {_name(setting)}: FAILED {out[-1]['error'][:300]}", flush=True)
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
            row = {**setting, "exact": bool(ok),
                   "copy_s": statistics.median(copy), "encode_s": statistics.median(enc),
                   "encode_refresh_s": statistics.median(ref_s), "checksum_s": statistics.median(ck),
                   "steps_s": steps}
            row["encode_over_copy"] = row["encode_s"] / row["copy_s"]
            row["steps_over_copy"] = {k: v / row["copy_s"] for k, v in steps.items()}
            row["encode_refresh_over_copy"] = row["encode_refresh_s"] / row["copy_s"]
            out.append(row)
            print(f"  sweep {fraction:.1%}: {_name(setting)}: encode {row['encode_s'] * 1e3:.2f} ms "
                  f"({row['encode_over_copy']:.2f} copies), with the refresh {row['encode_refresh_s'] * 1e3:.2f} ms "
                  f"({row['encode_refresh_over_copy']:.2f}), checksum {row['checksum_s'] * 1e3:.2f} ms, exact={ok}"
                  + ("; steps (ms) " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in steps.items()) if steps else ""),
                  flush=True)
    finally:
        ops.configure(**default)
    return out


def _name(r: dict) -> str:
    if r["finish"] == "tiles":
        how = "changed units" if r["refresh"] == "gather" else "whole tiles"
        ahead = ", a step ahead" if r["tile_ahead"] else ""
        return (f"tile {r['tile_bytes']} B, {r['num_warps']} warps, finish tiles (scan step {r['tile_step']} B"
                f"{ahead}, refresh: {how})")
    where = {"gather": "in the gather", "scan": "in the scan (whole tiles)", "masked": "in the scan (changed units)"}
    return (f"tile {r['tile_bytes']} B, {r['num_warps']} warps, refresh {where[r['refresh']]}, scan {r['scan']}, "
            f"gather {r['gather']}, finish {r['finish']} (plan chunk {r['plan_chunk']})")


def _encode(ops, cur: torch.Tensor, old: torch.Tensor):
    return delta._encode_fused(ops, cur, old, False, True)


def _finished(ops, finish: str, fn, *args):
    """``fn(ops, *args)`` (an encoding, or its check) under another finish (the library's setting restored after)."""
    before = ops.FINISH
    ops.configure(finish=finish)
    try:
        return fn(ops, *args)
    finally:
        ops.configure(finish=before)


if __name__ == "__main__":
    sys.exit(main())
