"""Exactness of the delta kernels against the torch and numpy paths, on any device.

``python -m policyworker.testing.delta_check --device cpu`` (with ``TRITON_INTERPRET=1``:
it must be set before Triton is imported, hence a module of its own run in a fresh
process) or ``--device cuda`` prints one JSON object, per case whether:

* encode: :mod:`policyworker.ops.delta_triton`'s encoding (through
  ``layout.delta``'s fused path) has the numpy path's kind and count and its blob is
  byte for byte the numpy path's and the torch path's; its checksum is the torch
  path's; the old tensor, refreshed on the way (by the gather or by the scan, case by
  case; the scan's and the gather's forms in turn, and the units scan where a stream is
  not 8-byte aligned), equals the new one; ``apply`` of the blob onto the old units gives
  the new ones. The finish is, case by case, the device's (one program for the tiles'
  starts and totals, the blob's header and padding written by the gather), the fused
  scan's (changed units placed by a look-back in the scan, a sparse blob copied from its
  scratch), torch's, the mixed one (torch's starts, the gather's header and padding), or
  the tiles scan's (each tile's changed units kept in a slot of its
  own, then compacted; a tile over its slot gathered again: its cases change whole tiles
  among sparse ones, so tiles over and under their slot meet in one blob, of each kind and
  unit width); every tensor the encoding allocates starts as 0xA5 bytes, so a byte left
  unwritten shows;
* checksums: the kernel's checksum of each byte segment equals the torch path's.

Cases: 1-, 2-, 4- and 8-byte units; lengths that end inside a tile and inside a
65,536-unit block; nothing, one unit (the first, the last, a block's last), a few,
many and all units changed; bf16 and float32 ``-0.0`` vs ``0.0`` and NaN payloads;
1 KiB tiles with a 16-tile step of the prefix sum (its carry over many steps); the tiles
finish with tiles over their slot, several scan steps a tile, with and without a step ahead;
segments at odd addresses, of odd lengths, empty. ``--scale`` multiplies the lengths
(the GPU test uses it for many tiles and blocks). Exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from unittest import mock

import torch

from policyworker.layout import delta as D

#: (unit bytes, units, changed fraction, where the changes are)
ENCODE_CASES = [
    (2, 200_003, 0.002, "random"),  # 4 blocks, a ragged last tile: sparse
    (2, 69_632, 0.0, "random"),  # nothing changed (whole tiles)
    (2, 70_001, 0.2, "random"),  # bitmap
    (2, 4_097, 1.0, "random"),  # raw
    (2, 70_001, 0.0, "last"),
    (2, 65_537, 0.0, "block_end"),
    (1, 100_003, 0.002, "random"),
    (1, 30_001, 0.3, "random"),
    (4, 40_003, 0.001, "random"),
    (4, 9_001, 0.15, "random"),
    (8, 12_289, 0.002, "random"),
    (8, 3_001, 0.0, "first"),
    (8, 1, 1.0, "random"),
]

#: ENCODE_CASES taken again with the scan's masked refresh (sparse with a ragged tile, bitmap,
#: raw; 1-, 4- and 8-byte units)
MASKED_CASES = [0, 2, 3, 7, 9, 10]

#: The tiles finish's cases: (unit bytes, units, changed fraction, where, tile bytes, scan step bytes);
#: "runs": random changes plus two runs of changed units, each more than a tile's slot holds
TILES_CASES = [
    (2, 200_003, 0.002, "random", 16384, 4096),  # sparse, a ragged last tile, 4 steps a tile
    (2, 30_001, 0.01, "runs", 1024, 1024),  # sparse, tiles over and under their slot
    (2, 20_001, 0.08, "random", 1024, 1024),  # bitmap, tiles over and under
    (2, 8_192, 0.0, "random", 1024, 1024),  # nothing changed
    (1, 60_001, 0.005, "runs", 4096, 1024),
    (1, 30_001, 0.07, "random", 1024, 1024),
    (4, 20_003, 0.001, "runs", 1024, 1024),
    (4, 9_001, 0.07, "random", 4096, 1024),
    (8, 16_003, 0.002, "runs", 2048, 1024),
    (8, 6_001, 0.08, "random", 1024, 1024),
    (8, 3_001, 1.0, "random", 16384, 4096),  # every unit changed: raw
    (2, 4_097, 1.0, "random", 1024, 1024),
]


def _case(n: int, unit: int, fraction: float, seed: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (n * unit,), dtype=torch.uint8, generator=g).view(D.unit_dtype(unit))
    new = old.clone()
    if where in ("random", "runs"):
        mask = torch.rand(n, generator=g) < fraction
        if where == "runs":  # the first covers a whole tile of 1 KiB of units of 2 bytes or more
            mask[1000:1600] = True
            mask[n // 2:n // 2 + 300] = True
    else:  # one unit: the first, the last (a ragged tile's end), the last of the first block
        mask = torch.zeros(n, dtype=torch.bool)
        mask[{"first": 0, "last": n - 1, "block_end": min(n, 1 << 16) - 1}[where]] = True
    new[mask] = new[mask] ^ 1
    return new, old


def _specials(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0, float("nan"), -0.0, 3.0] * 700, dtype=dtype)
    new = old.clone()
    unit = D.unit_dtype(old.element_size())
    new[0::7] = -0.0  # equal as values, other bits
    new.view(unit)[4::7] ^= 1  # other NaN payloads
    new[5::7] = 0.0
    return new.view(unit), old.view(unit)


#: (scan form, gather form) of the kernels, taken in turn by the encode cases
FORMS = [("words", "bits"), ("units", "units"), ("words", "units"), ("units", "bits")]


def _placed(t: torch.Tensor, device: torch.device, offset: int) -> torch.Tensor:
    """``t`` on ``device``, starting ``offset`` units into a larger allocation."""
    buf = torch.zeros(t.numel() + offset, dtype=t.dtype, device=device)
    buf[offset:] = t.to(device)
    return buf[offset:]


def _poisoned_empty(*args, **kwargs) -> torch.Tensor:
    """``torch.empty`` whose bytes are 0xA5: a kernel that leaves a byte of its output unwritten shows."""
    t = _EMPTY(*args, **kwargs)
    if t.numel():
        t.view(-1).view(torch.uint8).fill_(0xA5)
    return t


_EMPTY = torch.empty


def check_encode(ops, new: torch.Tensor, old: torch.Tensor, device: torch.device, refresh: str = "gather",
                 forms: tuple[str, str] = FORMS[0], offset: int = 0, finish: str = "device",
                 settings: dict | None = None) -> dict:
    """One case; ``refresh``: which kernel pass refreshes the old tensor (both must); ``forms``:
    the scan's and the gather's; ``offset``: units the tensors start into their allocations;
    ``finish``: the kernels' finish ("device", "fused", "torch", "mixed" or "tiles"); ``settings``: more
    ``configure`` keywords.
    Every tensor the encoding allocates starts as 0xA5 bytes."""
    n, unit = new.numel(), new.element_size()
    want = D._encode_np(new, old, n, unit)
    cur, base = _placed(new, device, offset), _placed(old, device, offset)
    by_torch = D._encode_torch(cur, base)
    shadow = _placed(old, device, offset)
    default = dict(refresh=ops.REFRESH, scan=ops.SCAN, gather=ops.GATHER, finish=ops.FINISH,
                   tile_bytes=ops.TILE_BYTES, plan_chunk=ops.PLAN_CHUNK, tile_share=ops.TILE_SHARE,
                   tile_step=ops.TILE_STEP, tile_ahead=ops.TILE_AHEAD)
    ops.configure(refresh=refresh, scan=forms[0], gather=forms[1], finish=finish, **(settings or {}))
    try:
        with mock.patch.object(torch, "empty", _poisoned_empty):
            got = D._encode_fused(ops, cur, shadow, True, True)
        tiles = _slots(ops, new, old) if finish == "tiles" else {}
    finally:
        ops.configure(**default)
    applied = base.clone()
    D.apply(applied, got.kind, got.count, got.blob)
    ok = ((got.kind, got.count) == (want.kind, want.count) and torch.equal(got.blob.cpu(), want.blob)
          and torch.equal(by_torch.blob.cpu(), want.blob)
          and got.checksum == D._checksum_torch(new.view(torch.uint8))
          and torch.equal(shadow, cur) and torch.equal(applied, cur))
    return {"ok": bool(ok), "kind": got.kind, "count": got.count, "refresh": refresh, "forms": list(forms),
            "offset": offset, "finish": finish, "unit": unit, **tiles}


def _slots(ops, new: torch.Tensor, old: torch.Tensor) -> dict:
    """How many tiles have more changed units than the tiles finish's slot holds, and how many fewer (not 0)."""
    t, cap = ops.tile_units(new.element_size()), ops.tile_cap(new.element_size())
    hit = torch.zeros(-(-new.numel() // t) * t, dtype=torch.int32)
    hit[:new.numel()] = (new != old).to(torch.int32)
    counts = hit.view(-1, t).sum(1)
    return {"over_cap": int((counts > cap).sum()), "under_cap": int(((counts > 0) & (counts <= cap)).sum())}


def check_checksums(ops, raw: torch.Tensor, segments: list[tuple[int, int]]) -> bool:
    want = [D._checksum_torch(raw.narrow(0, a, n).cpu()) for a, n in segments]
    return D._checksums_fused(ops, raw, segments) == want


def run(device: torch.device, scale: int = 1) -> dict:
    from policyworker.ops import delta_triton as ops

    out = {}
    for i, (unit, n, fraction, where) in enumerate(ENCODE_CASES):  # the refreshing passes and forms in turn
        new, old = _case(n * scale, unit, fraction, seed=n + unit, where=where)
        out[f"encode unit={unit} n={n * scale} changed={fraction} {where}"] = check_encode(
            ops, new, old, device, ("gather", "scan")[i % 2], FORMS[(i // 2) % len(FORMS)],
            finish=("device", "fused", "torch", "mixed")[i % 4])
    for i, (unit, n, fraction, where, tile, step) in enumerate(TILES_CASES):
        new, old = _case(n * scale, unit, fraction, seed=n + unit + 1, where=where)
        ahead = i % 4 < 2  # the scan's next step loaded before this one's work, or not
        out[f"encode tiles unit={unit} n={n * scale} changed={fraction} {where} tile={tile} B step={step} B"
            f"{' ahead' if ahead else ''}"] = check_encode(
            ops, new, old, device, ("gather", "scan", "masked")[i % 3], FORMS[i % len(FORMS)], finish="tiles",
            settings=dict(tile_bytes=tile, tile_step=step, tile_ahead=ahead))
    for i, c in enumerate(MASKED_CASES):  # the scan's masked refresh: each kind, unit, scan form and finish
        unit, n, fraction, where = ENCODE_CASES[c]
        new, old = _case(n * scale, unit, fraction, seed=n + unit + 2, where=where)
        out[f"encode masked unit={unit} n={n * scale} changed={fraction} {where}"] = check_encode(
            ops, new, old, device, "masked", FORMS[i % 2], finish=("mixed", "device", "torch", "fused")[i % 4])
    new, old = _case(70_001 * scale, 2, 0.01, seed=11, where="random")  # not 8-byte aligned: the units scan
    out["encode unit=2 at a 2-byte offset"] = check_encode(ops, new, old, device, "scan", FORMS[0], offset=1)
    out["encode unit=2 at a 2-byte offset, masked"] = check_encode(ops, new, old, device, "masked", FORMS[0], offset=1)
    for fraction, forms, finish in ((0.003, FORMS[0], "device"), (0.1, FORMS[1], "device"), (0.01, FORMS[0], "fused"),
                                    (0.003, FORMS[1], "mixed")):
        new, old = _case(17_003 * scale, 2, fraction, seed=12, where="random")  # 1 KiB tiles: many prefix steps
        out[f"encode unit=2 changed={fraction} 1 KiB tiles, 16 a plan step, {finish}"] = check_encode(
            ops, new, old, device, "gather", forms, finish=finish, settings=dict(tile_bytes=1024, plan_chunk=16))
    for i, dtype in enumerate((torch.bfloat16, torch.float32)):
        out[f"encode {dtype} signed zeros and NaN payloads"] = check_encode(ops, *_specials(dtype), device,
                                                                            ("gather", "scan")[i])
    out["encode bfloat16 signed zeros and NaN payloads, masked"] = check_encode(
        ops, *_specials(torch.bfloat16), device, "masked", FORMS[1])
    g = torch.Generator().manual_seed(5)
    size = 150_011 * scale
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).to(device)
    half = size // 2
    cases = {"whole": [(0, size)],
             "copies": [(0, 8192), (8192, 24), (8216, 0), (8216, half), (8216 + half, size - 8216 - half)],
             "odd starts": [(1, 9), (10, 30_001), (30_011, 1)], "2-byte starts": [(6, 65_538), (65_544, 2)],
             "empty": [(3, 0)], "one block": [(0, 65_536)], "odd address": [(5, size - 10)]}
    for name, segments in cases.items():
        out[f"checksums {name}"] = {"ok": check_checksums(ops, raw, segments)}
    words = torch.randint(-(2**62), 2**62, (17_000 * scale,), dtype=torch.int64, generator=g).to(device)
    out["checksums int64 words"] = {"ok": check_checksums(ops, words.view(torch.uint8), [(0, words.numel() * 8)])}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--scale", type=int, default=1)
    args = p.parse_args(argv)
    res = run(torch.device(args.device), args.scale)
    print(json.dumps(res))
    return 0 if all(r["ok"] for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
