"""The delta path's device work on a GPU, against a flat copy of the same bytes.

A delta refit does, per stream of a bucket, on the trainer: compare with the shadow
(``encode``), then update the shadow; on the receiver: ``apply`` the blob, then
``checksum`` the result. On CPU loopback these cost more than moving every byte (see
RESULTS.md, "Delta refits"); the question for a real link is what they cost at GPU
memory speed. This measures, on one CUDA device, for a bf16 stream of ``--gib`` GiB and
each changed fraction: encode, apply and checksum times, the blob's bytes, and in the
same run (interleaved) the flat device copy of the whole stream (the ceiling of any
full refit's local work). From them it reports the wire time a delta saves on a link of
``--link-gbs`` GB/s against the device time it adds. The encoding is checked exact
(apply(old, blob) == cur, bit for bit) at every fraction; a mismatch exits 1.

Usage: python benchmarks/bench_delta_encode.py --json out.json [--gib 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from policyworker.layout import delta


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--link-gbs", type=float, default=50.0, help="link speed for the modelled wire time (GB/s)")
    ap.add_argument("--fractions", default="0.001,0.01,0.05,0.1")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_delta_encode: needs a CUDA device (the comparison it promises is on GPU memory)", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    n = int(args.gib * (1 << 30)) // 2
    gen = torch.Generator(device=dev).manual_seed(0)
    old = torch.randn(n, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)
    rows = []
    for frac in (float(f) for f in args.fractions.split(",")):
        cur = old.clone()
        k = max(1, int(n * frac))
        idx = torch.randperm(n, generator=gen, device=dev)[:k]
        cur[idx] = cur[idx] ^ 1  # flip the lowest mantissa bit: a real, small change
        dst = torch.empty_like(old)
        copy_s, enc_s, apply_s, sum_s = [], [], [], []
        encoded = None
        for _ in range(args.reps):  # interleaved: ceiling, then each phase, per repetition
            copy_s += _timed(lambda: dst.copy_(cur), 1)
            box = {}
            enc_s += _timed(lambda: box.setdefault("e", delta.encode(cur, old)), 1)
            encoded = box["e"]
            dst.copy_(old)
            apply_s += _timed(lambda: delta.apply(dst, encoded.kind, encoded.count, encoded.blob), 1)
            sum_s += _timed(lambda: delta.checksum(dst), 1)
        exact = bool(torch.equal(dst, cur)) and delta.checksum(dst) == delta.checksum(cur)
        full_bytes = n * 2
        blob = int(encoded.blob.numel())
        med = {k2: statistics.median(v) for k2, v in
               (("copy", copy_s), ("encode", enc_s), ("apply", apply_s), ("checksum", sum_s))}
        wire_full = full_bytes / (args.link_gbs * 1e9)
        wire_delta = blob / (args.link_gbs * 1e9)
        delta_total = wire_delta + med["encode"] + med["apply"] + med["checksum"]
        rows.append({
            "changed_fraction": frac, "changed_units": encoded.count, "kind": encoded.kind, "exact": exact,
            "stream_bytes": full_bytes, "blob_bytes": blob, "blob_over_full": blob / full_bytes,
            "copy_s": med["copy"], "copy_gbs": full_bytes / med["copy"] / 1e9,
            "encode_s": med["encode"], "apply_s": med["apply"], "checksum_s": med["checksum"],
            "encode_over_copy": med["encode"] / med["copy"],
            "modelled_full_s": wire_full + med["copy"], "modelled_delta_s": delta_total,
            "modelled_delta_over_full": delta_total / (wire_full + med["copy"]),
            "samples": {"copy": copy_s, "encode": enc_s, "apply": apply_s, "checksum": sum_s},
        })
        print(f"{frac:>6.3%}: blob {blob / full_bytes:.4f} x, encode {med['encode'] * 1e3:.2f} ms, "
              f"apply {med['apply'] * 1e3:.2f} ms, checksum {med['checksum'] * 1e3:.2f} ms, "
              f"copy {med['copy'] * 1e3:.2f} ms ({full_bytes / med['copy'] / 1e9:.0f} GB/s); "
              f"on {args.link_gbs:.0f} GB/s: delta {delta_total / (wire_full + med['copy']):.3f} x full; "
              f"exact={exact}", flush=True)
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "gib": args.gib,
           "reps": args.reps, "link_gbs": args.link_gbs, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
