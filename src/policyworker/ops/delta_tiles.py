"""The delta encoding's "tiles" finish: the scan keeps each tile's changed units, so the
stream is read once (:mod:`policyworker.ops.delta_triton` launches these kernels with
``FINISH = "tiles"``; the other finishes' kernels are in :mod:`policyworker.ops.delta_kernels`).

* ``_scan_tiles_kernel``, one program a tile: the units scan (count, packbits bitmap,
  checksum share) and, from the same registers, the tile's changed units (values, and
  their offsets inside their 65,536-unit block) written compactly to the tile's own
  scratch slot ``[t * CAP, t * CAP + CAP)``, their places an in-tile prefix sum (no
  other tile is waited on); with UPDATE the changed units go into ``old`` too (masked
  stores: the shadow refresh without a second read). It walks its tile in steps of S
  units: every unit of a step needs its place and two scattered addresses in registers,
  and a whole 16 KiB tile at once spills (ptxas for sm_90a: 255 registers and ~1.1 KB
  of spills at 4 warps, where the plain scan takes 126 registers; 4 KiB steps: 158, no
  spills). Steps cut the bytes a program has in flight, so AHEAD issues the next step's
  loads before this step's work (8 warps, 4 KiB steps: 128 registers, two steps in flight).
* between the two kernels the host runs torch's cumsum over the tiles' counts (each
  tile's start in the blob) and reads back the total and the checksum (as the torch finish).
* ``_compact_kernel``, one program a tile: copies its scratch run to its start in the
  blob's values (and offsets) section and writes its share of the blob's header and
  padding (``_glue``, as the device finish's gather). A tile with more than CAP changed
  units (its scratch kept the first CAP) takes the bits gather from ``cur``
  (``_gather_bits_tile``): correct whatever the data, only slower.

Memory traffic per encoding, for a stream of B bytes of u-byte units with a fraction f of
them changed (every tile under CAP; f * B / u changed units): the scan reads 2 B (both
sides), writes B / (8 u) of bitmap, a few bytes a tile, and f * B * (u + 2) / u of scratch
(bf16: 2 f B); the refresh, when asked, writes the changed units into ``old`` (masked
2-byte stores: at 3% random changes about 40% of the 32-byte sectors of ``old`` get one,
sectors still in L2 from the scan's read); the compaction reads the scratch runs and writes
them to the blob (bf16: 2 f B each way) plus the header (B / 8 u for a bitmap blob). bf16
at 3% changed: about 2.06 B read and 0.18 B written (0.06 B of it bitmap), ~1.1 flat copies
of the stream (a copy reads B and writes B), where the gather finishes read ``cur`` a second
time (at 3% random changes nearly every 128-byte line of ``cur`` holds a changed unit: the
gather measured 0.6 copies on an H200). The scratch is ``tiles * CAP * (u + 2)`` bytes, CAP
= the tile's units / ``TILE_SHARE`` (16: the most changed units a sparse blob can have,
n / 16, as the fused finish's scratch): 1/8 of a bf16 stream's bytes (3/16 for 1-byte
units, 3/32 for 4-byte, 5/64 for 8-byte) more GPU memory while an encoding runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from policyworker.ops.delta_kernels import _NO_SPEC, _gather_bits_tile, _glue, _load_tile, _tile_sum


@triton.jit
def _scan_tiles_kernel(cur_ptr, old_ptr, n, counts_ptr, bits_ptr, part_ptr, val_ptr, off_ptr, T: tl.constexpr,
                       S: tl.constexpr, CAP: tl.constexpr, PER: tl.constexpr, UBITS: tl.constexpr, UDT: tl.constexpr,
                       REFRESH: tl.constexpr, UPDATE: tl.constexpr, AHEAD: tl.constexpr):
    # The tile in steps of S units (S divides T; a step is whole checksum rows): a step's units,
    # places and addresses live in registers at once, so S, not T, bounds the registers. AHEAD:
    # the next step's loads are issued before this step's work (two steps' bytes in flight).
    t = tl.program_id(0).to(tl.int64)
    count = t.to(tl.int32) * 0
    part = t.to(tl.uint64) * 0
    if AHEAD:
        a, b = _load_tile(cur_ptr, old_ptr, t * T + tl.arange(0, S), t * (T // S), n, S, REFRESH)
    for j in range(0, T // S):
        g = t * (T // S) + j  # the step's index in the stream, in steps of S
        offs = g * S + tl.arange(0, S)
        if AHEAD:
            if j + 1 < T // S:
                a_next, b_next = _load_tile(cur_ptr, old_ptr, offs + S, g + 1, n, S, REFRESH)
            else:
                a_next, b_next = a, b
        else:
            a, b = _load_tile(cur_ptr, old_ptr, offs, g, n, S, REFRESH)
        hit = a != b  # integer units: bit patterns, never values; zero past the end on both sides
        changed = hit.to(tl.int32)
        weights = 7 - tl.arange(0, 8)  # the first unit of a byte is its top bit (packbits)
        packed = tl.sum(tl.reshape(changed, (S // 8, 8)) << weights[None, :], axis=1)
        tl.store(bits_ptr + g * (S // 8) + tl.arange(0, S // 8), packed.to(tl.uint8))
        part += _tile_sum(a, g * (S // PER // 128), S, PER, UBITS, UDT)
        c = tl.sum(changed, axis=0)
        if c > 0:
            at = count + tl.cumsum(changed, axis=0) - changed  # exclusive: its place among the tile's changed units
            keep = hit & (at < CAP)  # a tile over CAP keeps its first CAP; the compaction gathers it instead
            slot = t * CAP + at
            tl.store(val_ptr + slot, a, mask=keep)
            tl.store(off_ptr + slot, (offs & 65535).to(tl.int16), mask=keep)  # a tile never straddles a block
            if UPDATE:
                tl.store(old_ptr + offs, a, mask=hit)
        count += c
        if AHEAD:
            a, b = a_next, b_next
    tl.store(counts_ptr + t, count)
    tl.store(part_ptr + t, part.to(tl.int64, bitcast=True))


@triton.jit(do_not_specialize=_NO_SPEC)
def _compact_kernel(cur_ptr, counts_ptr, starts_ptr, bits_ptr, sval_ptr, soff_ptr, val_ptr, off_ptr, blob_ptr, tiles,
                    k, at_offs, at_vals, size, T: tl.constexpr, CAP: tl.constexpr, OFFSETS: tl.constexpr,
                    GLUE: tl.constexpr, TPB: tl.constexpr, UNIT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _glue(t, starts_ptr, bits_ptr, blob_ptr, tiles, k, at_offs, at_vals, size, T, GLUE, TPB, UNIT)
    count = tl.load(counts_ptr + t)
    start = tl.load(starts_ptr + t)
    if count > CAP:  # the scratch holds only the first CAP: gather the tile again (old refreshed by the scan)
        _gather_bits_tile(cur_ptr, cur_ptr, bits_ptr, val_ptr, off_ptr, t, start, T, OFFSETS, False)
    elif count > 0:
        i = tl.arange(0, CAP)
        m = i < count
        tl.store(val_ptr + start + i, tl.load(sval_ptr + t * CAP + i, mask=m), mask=m)
        if OFFSETS:
            tl.store(off_ptr + start + i, tl.load(soff_ptr + t * CAP + i, mask=m), mask=m)
