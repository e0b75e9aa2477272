"""Delta encoding and its checksum on CUDA: Triton kernels that read each input once.

:mod:`policyworker.layout.delta` decides the encodings and lays out the blobs; these
kernels only scan, compact and sum, so the blob a receiver gets is byte for byte the one
the torch/numpy paths build. A stream is a contiguous 1-D tensor of integer *units*
(1, 2, 4 or 8 bytes), cut into tiles of ``tile_bytes`` (a tile's units divide 65,536,
so whole tiles make up each block of the sparse encoding).

* :func:`scan`, one read of the current and the old units, per tile: the count of
  changed units, the tile's changed-unit bitmap (numpy ``packbits`` order: the
  encoding's bitmap section as it is) and the tile's share of the checksum of the
  current bytes.
* :func:`gather`, after a prefix sum of the counts: per tile with changes, reads its
  bitmap, loads only the changed units, and writes them (and, for the sparse encoding,
  their offsets inside their block) at their places in the blob.

The old tensor can be refreshed (made equal to the current one) on the way: by the
gather, which writes the changed units only (``REFRESH = "gather"``, the default), or
by the scan, which writes every tile it read whole (``"scan"``: one more write of the
stream, but in full 16-byte stores rather than scattered 2-byte ones; it can win when
many units change). ``benchmarks/bench_delta_encode.py --sweep`` times both.
* :func:`checksums`, one read: the checksum's word sums of byte segments of one
  buffer (every copy of a transfer in one launch).

Each pass has two forms (``configure``; the benchmark sweeps them). The scan's
``"words"`` form (the default where both tensors are 8-byte aligned) works on 64-bit
words: a word's XOR gives its changed lanes, their count and its bitmap bits with a
few integer operations and two multiplies (no per-unit tensors, no reshapes), and the
checksum weights words directly; ``"units"`` works unit by unit. The gather's
``"bits"`` form (the default) gives each thread 32 units' bitmap word and loops only
as many times as the most changed units any thread of the tile has, writing one
changed unit per thread per round; ``"units"`` takes a prefix sum over every unit.

:func:`mark` records a CUDA event per step of an encoding when :data:`PROFILE` is a
list (the benchmark's per-step timings); otherwise it does nothing.

The checksum is layout.delta's: the bytes as little-endian 64-bit words ``x_j``, the
tail zero-padded, ``sum(rw(j mod 128) * W2(j // 128) * x_j) + nbytes`` mod 2**64, where
``rw = _hash(., 1)`` and ``W2 = _hash(., 2)`` are the same odd weights as layout.delta's
numpy formula. Every product and sum is unsigned 64-bit, which wraps, so the value is
bit for bit the CPU path's (tests check it in Triton's interpreter and on the GPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from policyworker.errors import ConfigError, ProtocolError

__all__ = ["FINISH", "GATHER", "LOOKBACK", "NUM_WARPS", "PLAN_CHUNK", "PLAN_WARPS", "PROFILE", "REFRESH", "SCAN",
           "Scanned", "TILE_BYTES",
           "checksums", "configure", "gather", "gather_into", "mark", "plan", "scan", "tile_units"]

#: Bytes of one stream a program covers (a power of two, 1 KiB .. 64 KiB), and warps per program.
TILE_BYTES = 16384
NUM_WARPS = 4
#: Which pass refreshes the old tensor when asked: "gather" (changed units) or "scan" (whole tiles).
REFRESH = "gather"
#: The scan's form ("words" or "units") and the gather's ("bits" or "units").
SCAN = "units"
GATHER = "bits"
#: What happens between the scan and the gather: "device" (one kernel sums the tiles' counts and
#: checksum shares and lays out their starts; the gather writes the blob's header and padding) or
#: "torch" (torch reductions, a cumsum and copies: the first form, kept to compare).
FINISH = "device"
#: Tile counts per step of the device finish's one-program prefix sum, and its warps.
PLAN_CHUNK = 4096
PLAN_WARPS = 8
#: Status words the fused kernel's look-back reads at once.
LOOKBACK = 32
#: When a list, :func:`mark` appends (step name, recorded CUDA event) to it.
PROFILE: list | None = None
_GROUP = 1 << 16  # units per block of the sparse encoding: a tile never straddles one
_SPINS = tl.constexpr(1 << 22)  # status reads a look-back may wait (seconds; never expected to be reached)
_UNSIGNED = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}


def configure(*, tile_bytes: int | None = None, num_warps: int | None = None, refresh: str | None = None,
              scan: str | None = None, gather: str | None = None, finish: str | None = None,
              plan_chunk: int | None = None) -> None:
    """Set the tile size, warps, refreshing pass, the passes' forms and the finish (the benchmark's sweep)."""
    global TILE_BYTES, NUM_WARPS, REFRESH, SCAN, GATHER, FINISH, PLAN_CHUNK
    if finish is not None:
        if finish not in ("device", "torch", "fused"):
            raise ConfigError(f"delta kernels: finish {finish!r} is not 'device', 'torch' or 'fused'")
        FINISH = finish
    if plan_chunk is not None:
        if plan_chunk < 16 or plan_chunk > 65536 or plan_chunk & (plan_chunk - 1):
            raise ConfigError(f"delta kernels: plan_chunk {plan_chunk} is not a power of two in 16 .. 65,536")
        PLAN_CHUNK = plan_chunk
    if scan is not None:
        if scan not in ("words", "units"):
            raise ConfigError(f"delta kernels: scan {scan!r} is not 'words' or 'units'")
        SCAN = scan
    if gather is not None:
        if gather not in ("bits", "units"):
            raise ConfigError(f"delta kernels: gather {gather!r} is not 'bits' or 'units'")
        GATHER = gather
    if refresh is not None:
        if refresh not in ("gather", "scan"):
            raise ConfigError(f"delta kernels: refresh {refresh!r} is not 'gather' or 'scan'")
        REFRESH = refresh
    if tile_bytes is not None:
        if tile_bytes < 1024 or tile_bytes > 65536 or tile_bytes & (tile_bytes - 1):
            raise ConfigError(f"delta kernels: tile_bytes {tile_bytes} is not a power of two in 1 KiB .. 64 KiB")
        TILE_BYTES = tile_bytes
    if num_warps is not None:
        if num_warps not in (1, 2, 4, 8, 16):
            raise ConfigError(f"delta kernels: num_warps {num_warps} is not 1, 2, 4, 8 or 16")
        NUM_WARPS = num_warps


def mark(step: str) -> None:
    """Record a CUDA event named ``step`` into :data:`PROFILE` (when it is a list)."""
    if PROFILE is not None and torch.cuda.is_available():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        PROFILE.append((step, ev))


def tile_units(unit: int) -> int:
    """Units per tile for ``unit``-byte units (divides 65,536; a multiple of 128 words)."""
    return min(TILE_BYTES // unit, _GROUP)


@triton.jit
def _hash(i, salt: tl.constexpr):
    # layout.delta._weights: odd pseudo-random weights by position, uint64 wrapping.
    w = ((i + salt) * 0x9E3779B97F4A7C15) ^ (i >> 3)
    return (w * 0xBF58476D1CE4E5B9) | 1


@triton.jit
def _tile_sum(x, first_row, T: tl.constexpr, PER: tl.constexpr, UBITS: tl.constexpr, UDT: tl.constexpr):
    """A tile's share of the checksum: ``x`` is T units (zero past the end), words from
    row ``first_row`` (128 words a row) on."""
    ROWS: tl.constexpr = T // PER // 128
    u = x.to(UDT, bitcast=True).to(tl.uint64)
    lanes = (tl.arange(0, PER) * UBITS).to(tl.uint64)
    words = tl.sum(tl.reshape(u, (T // PER, PER)) << lanes[None, :], axis=1)  # disjoint bits: sum == or
    col = _hash(tl.arange(0, 128).to(tl.uint64), 1)
    per_row = tl.sum(tl.reshape(words, (ROWS, 128)) * col[None, :], axis=1)
    rows = (first_row + tl.arange(0, ROWS)).to(tl.uint64)
    return tl.sum(per_row * _hash(rows, 2), axis=0)


@triton.jit
def _scan_kernel(cur_ptr, old_ptr, n, counts_ptr, bits_ptr, part_ptr, T: tl.constexpr, PER: tl.constexpr,
                 UBITS: tl.constexpr, UDT: tl.constexpr, REFRESH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = t * T + tl.arange(0, T)
    if t * T + T <= n:  # a whole tile: no mask, so the loads are vectorized whatever n is
        a = tl.load(cur_ptr + offs)
        b = tl.load(old_ptr + offs)
        if REFRESH:
            tl.store(old_ptr + offs, a)
    else:
        a = tl.load(cur_ptr + offs, mask=offs < n, other=0)
        b = tl.load(old_ptr + offs, mask=offs < n, other=0)
        if REFRESH:
            tl.store(old_ptr + offs, a, mask=offs < n)
    changed = (a != b).to(tl.int32)  # integer units: bit patterns, never values
    tl.store(counts_ptr + t, tl.sum(changed, axis=0))
    weights = 7 - tl.arange(0, 8)  # the first unit of a byte is its top bit (packbits)
    packed = tl.sum(tl.reshape(changed, (T // 8, 8)) << weights[None, :], axis=1)
    tl.store(bits_ptr + t * (T // 8) + tl.arange(0, T // 8), packed.to(tl.uint8))
    part = _tile_sum(a, t * (T // PER // 128), T, PER, UBITS, UDT)
    tl.store(part_ptr + t, part.to(tl.int64, bitcast=True))


_NO_SPEC = ["tiles", "k", "at_offs", "at_vals", "size"]  # per-encoding values: one compiled kernel for all


@triton.jit
def _glue(t, starts_ptr, bits_ptr, blob_ptr, tiles, k, at_offs, at_vals, size, T: tl.constexpr, GLUE: tl.constexpr,
          TPB: tl.constexpr, UNIT: tl.constexpr):
    """Gather program ``t``'s share of the blob's header and padding (GLUE 1: sparse, 2: bitmap, 0: none;
    3: a sparse blob's padding only)."""
    zero64 = t * 0  # every size as int64: a 2 GiB stream's byte offsets pass 2**31
    if GLUE == 1:
        if t % TPB == 0:  # a block's first tile writes the block's count
            end = tl.minimum(t + TPB, zero64 + tiles)
            c = tl.load(starts_ptr + end) - tl.load(starts_ptr + t)
            tl.store(blob_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + t // TPB, c.to(tl.int32))
    if GLUE == 2:  # the tile's bitmap bytes, up to the values (the scan's bitmap is zero past the stream)
        q = t * (T // 32) + tl.arange(0, T // 32)
        w = tl.load(bits_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + q)
        dst = blob_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
        if (t + 1) * (T // 8) <= at_vals:  # a whole tile: no mask, so the stores are vectorized
            tl.store(dst + q, w)
        else:
            tl.store(dst + q, w, mask=q * 4 < zero64 + at_vals)
    if GLUE != 0:
        if t == 0:  # the padding after each section (at most 7 bytes each)
            j = tl.arange(0, 8).to(tl.int64)
            nul = tl.zeros([8], dtype=tl.uint8)
            a = zero64 + at_vals + (zero64 + k) * UNIT
            tl.store(blob_ptr + a + j, nul, mask=a + j < zero64 + size)
            if GLUE % 2 == 1:
                a = 4 * ((zero64 + tiles + TPB - 1) // TPB)
                tl.store(blob_ptr + a + j, nul, mask=a + j < zero64 + at_offs)
                a = zero64 + at_offs + 2 * (zero64 + k)
                tl.store(blob_ptr + a + j, nul, mask=a + j < zero64 + at_vals)


@triton.jit(do_not_specialize=_NO_SPEC)
def _gather_kernel(cur_ptr, old_ptr, counts_ptr, starts_ptr, bits_ptr, val_ptr, off_ptr, blob_ptr, tiles, k, at_offs,
                   at_vals, size, T: tl.constexpr, OFFSETS: tl.constexpr, UPDATE: tl.constexpr, GLUE: tl.constexpr,
                   TPB: tl.constexpr, UNIT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _glue(t, starts_ptr, bits_ptr, blob_ptr, tiles, k, at_offs, at_vals, size, T, GLUE, TPB, UNIT)
    if tl.load(counts_ptr + t) > 0:
        start = tl.load(starts_ptr + t)
        packed = tl.load(bits_ptr + t * (T // 8) + tl.arange(0, T // 8)).to(tl.int32)
        shifts = 7 - tl.arange(0, 8)
        bit = tl.reshape((packed[:, None] >> shifts[None, :]) & 1, (T,))
        at = start + (tl.cumsum(bit, axis=0) - bit).to(tl.int64)  # exclusive: this unit's place
        offs = t * T + tl.arange(0, T)
        hit = bit != 0
        v = tl.load(cur_ptr + offs, mask=hit)  # only the changed units are read
        tl.store(val_ptr + at, v, mask=hit)
        if OFFSETS:
            tl.store(off_ptr + at, (offs & 65535).to(tl.int16), mask=hit)  # low 16 bits: the offset in its block
        if UPDATE:
            tl.store(old_ptr + offs, v, mask=hit)


@triton.jit
def _plan_kernel(counts_ptr, parts_ptr, tiles, out_ptr, err_ptr, CHUNK: tl.constexpr, ERR: tl.constexpr):
    """One program: each tile's start among the changed units (exclusive prefix sum of the
    counts) into ``out[:tiles]``, then the total (-1 when ``ERR`` and ``*err_ptr``: the fused
    scan's look-back gave up), then the checksum's word sum (wrapping)."""
    total = tl.program_id(0).to(tl.int64) * 0
    words = total.to(tl.uint64)
    for c in range(0, tiles, CHUNK):
        i = c + tl.arange(0, CHUNK)
        m = i < tiles
        x = tl.load(counts_ptr + i, mask=m, other=0).to(tl.int64)
        tl.store(out_ptr + i, total + tl.cumsum(x, axis=0) - x, mask=m)
        total += tl.sum(x, axis=0)
        words += tl.sum(tl.load(parts_ptr + i, mask=m, other=0).to(tl.uint64, bitcast=True), axis=0)
    tl.store(out_ptr + tiles, total)
    if ERR:
        total = tl.where(tl.load(err_ptr) != 0, -1, total)
    tl.store(out_ptr + tiles + 1, total)
    tl.store(out_ptr + tiles + 2, words.to(tl.int64, bitcast=True))


@triton.jit
def _scan_words(a, b, t, counts_ptr, bits_ptr, part_ptr, T: tl.constexpr, PER: tl.constexpr, UBITS: tl.constexpr,
                LOW: tl.constexpr, HIGH: tl.constexpr, PACK: tl.constexpr, ONES: tl.constexpr):
    """A tile's count, bitmap bytes and checksum share from its [R, C, WPR] current / old words
    (called in each branch of the scan: one layout each, no conversion between them)."""
    WPR: tl.constexpr = 8 // PER
    C: tl.constexpr = 128 // WPR
    R: tl.constexpr = T // PER // 128
    r = tl.arange(0, R)[:, None, None]
    k = tl.arange(0, WPR)[None, None, :]
    d = a ^ b
    top = ((((d & LOW) + LOW) | d) & HIGH) >> (UBITS - 1)  # bit 0 of each lane: the lane changed
    tl.store(counts_ptr + t, tl.sum(((top * ONES) >> (64 - UBITS)).to(tl.int32)))  # lanes' sum in the top lane
    bits = (top * PACK) >> (64 - PER)  # the lanes' bits gathered, lane 0 highest (packbits order)
    byte = tl.sum(bits << ((WPR - 1 - k) * PER).to(tl.uint64), axis=2)
    rr = tl.arange(0, R)[:, None]
    cc = tl.arange(0, C)[None, :]
    tl.store(bits_ptr + t * (T // 8) + rr * C + cc, byte.to(tl.uint8))
    # checksum: word (row t*R + r, column c*WPR + k) weighs rw(column) * W2(row)
    rows = _hash((t * R + r).to(tl.uint64), 2)
    cols = _hash((tl.arange(0, C)[:, None] * WPR + tl.arange(0, WPR)[None, :]).to(tl.uint64), 1)
    part = tl.sum(tl.sum(a * rows, axis=0) * cols)
    tl.store(part_ptr + t, part.to(tl.int64, bitcast=True))


@triton.jit
def _scan_words_kernel(cur_ptr, old_ptr, n, counts_ptr, bits_ptr, part_ptr, T: tl.constexpr, PER: tl.constexpr,
                       UBITS: tl.constexpr, UDT: tl.constexpr, REFRESH: tl.constexpr, LOW: tl.constexpr,
                       HIGH: tl.constexpr, PACK: tl.constexpr, ONES: tl.constexpr):
    # A tile as [R checksum rows, C bitmap bytes a row, WPR words a byte]: a word's lanes, its
    # bitmap bits and its checksum weight all follow from its place, without reshapes.
    WPR: tl.constexpr = 8 // PER
    C: tl.constexpr = 128 // WPR
    R: tl.constexpr = T // PER // 128
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, R)[:, None, None]
    c = tl.arange(0, C)[None, :, None]
    k = tl.arange(0, WPR)[None, None, :]
    w = r * 128 + c * WPR + k  # the word in the tile
    if t * T + T <= n:  # whole words, 8-byte aligned (the caller checks): 16-byte loads
        cw = cur_ptr.to(tl.pointer_type(tl.uint64), bitcast=True) + t * (T // PER)
        ow = old_ptr.to(tl.pointer_type(tl.uint64), bitcast=True) + t * (T // PER)
        a = tl.load(cw + w)
        b = tl.load(ow + w)
        if REFRESH:
            tl.store(ow + w, a)
        _scan_words(a, b, t, counts_ptr, bits_ptr, part_ptr, T, PER, UBITS, LOW, HIGH, PACK, ONES)
    else:  # the ragged last tile: words built from units, zero past the end
        j = tl.arange(0, PER)[None, None, None, :]
        u = t * T + w[:, :, :, None] * PER + j
        ok = u < n
        au = tl.load(cur_ptr + u, mask=ok, other=0)
        bu = tl.load(old_ptr + u, mask=ok, other=0)
        if REFRESH:
            tl.store(old_ptr + u, au, mask=ok)
        lanes = (j * UBITS).to(tl.uint64)
        a = tl.sum(au.to(UDT, bitcast=True).to(tl.uint64) << lanes, axis=3)  # disjoint bits: sum == or
        b = tl.sum(bu.to(UDT, bitcast=True).to(tl.uint64) << lanes, axis=3)
        _scan_words(a, b, t, counts_ptr, bits_ptr, part_ptr, T, PER, UBITS, LOW, HIGH, PACK, ONES)


@triton.jit(do_not_specialize=_NO_SPEC)
def _gather_bits_kernel(cur_ptr, old_ptr, counts_ptr, starts_ptr, bits_ptr, val_ptr, off_ptr, blob_ptr, tiles, k,
                        at_offs, at_vals, size, T: tl.constexpr, OFFSETS: tl.constexpr, UPDATE: tl.constexpr,
                        GLUE: tl.constexpr, TPB: tl.constexpr, UNIT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _glue(t, starts_ptr, bits_ptr, blob_ptr, tiles, k, at_offs, at_vals, size, T, GLUE, TPB, UNIT)
    if tl.load(counts_ptr + t) > 0:
        q = tl.arange(0, T // 32)
        v = tl.load(bits_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + t * (T // 32) + q)
        # packbits order to unit i at bit i of its 32-bit word: reverse the bits of each byte
        v = ((v >> 1) & 0x55555555) | ((v & 0x55555555) << 1)
        v = ((v >> 2) & 0x33333333) | ((v & 0x33333333) << 2)
        v = ((v >> 4) & 0x0F0F0F0F) | ((v & 0x0F0F0F0F) << 4)
        cnt = v - ((v >> 1) & 0x55555555)  # popcount
        cnt = (cnt & 0x33333333) + ((cnt >> 2) & 0x33333333)
        cnt = ((((cnt + (cnt >> 4)) & 0x0F0F0F0F) * 0x01010101) >> 24).to(tl.int32)
        at = tl.load(starts_ptr + t) + (tl.cumsum(cnt, axis=0) - cnt).to(tl.int64)
        first = t * T + q * 32
        for _ in range(0, tl.max(cnt, axis=0)):  # one changed unit per word per round, lowest first
            hit = v != 0
            low = v & (0 - v)
            offs = first + ((low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127)  # log2 of a power of 2
            x = tl.load(cur_ptr + offs, mask=hit)
            tl.store(val_ptr + at, x, mask=hit)
            if OFFSETS:
                tl.store(off_ptr + at, (offs & 65535).to(tl.int16), mask=hit)
            if UPDATE:
                tl.store(old_ptr + offs, x, mask=hit)
            at += 1
            v = v & (v - 1)


@triton.jit
def _lookback(status_ptr, err_ptr, t, count, W: tl.constexpr):
    """Tile ``t``'s start among the changed units (decoupled look-back): publish its count,
    add the counts of the tiles before it, W at a time, back to the nearest whose inclusive
    prefix is published, then publish its own. A status word is ``value << 2 | flag``
    (flag 1: the tile's count, 2: the inclusive prefix through the tile, 0: not yet). A wait
    past ``_SPINS`` reads (never expected: every earlier tile is running) sets ``*err_ptr``."""
    tl.atomic_xchg(status_ptr + t, (count.to(tl.int64) << 2) | 1)
    prefix = t * 0
    j = t
    done = (t == 0).to(tl.int32)
    spins = t * 0
    w = tl.arange(0, W)
    while done == 0:
        idx = j - W + w
        st = tl.load(status_ptr + idx, mask=idx >= 0, other=2, volatile=True)  # before tile 0: a prefix of 0
        flag = st & 3
        ready = tl.min(flag, axis=0) > 0
        last = tl.max(tl.where(flag == 2, w, -1), axis=0)
        prefix = tl.where(ready, prefix + tl.sum(tl.where(w >= last, st >> 2, 0), axis=0), prefix)
        j = tl.where(ready, j - W, j)
        spins += 1
        done = ((ready & (last >= 0)) | (spins > _SPINS)).to(tl.int32)
    if spins > _SPINS:
        tl.atomic_or(err_ptr, 1)
    tl.atomic_xchg(status_ptr + t, ((prefix + count) << 2) | 2)
    return prefix


@triton.jit(do_not_specialize=["cap"])
def _fused_kernel(cur_ptr, old_ptr, n, counts_ptr, bits_ptr, part_ptr, state_ptr, off_ptr, val_ptr, cap,
                  T: tl.constexpr, PER: tl.constexpr, UBITS: tl.constexpr, UDT: tl.constexpr, REFRESH: tl.constexpr,
                  UPDATE: tl.constexpr, W: tl.constexpr):
    # The scan (count, bitmap, checksum share), then the tile's changed units and their offsets
    # straight to their places in the scratch (first ``cap`` only), read again from the cache.
    t = tl.atomic_add(state_ptr, 1).to(tl.int64)  # tiles in start order: every earlier tile is running or done
    offs = t * T + tl.arange(0, T)
    if t * T + T <= n:
        a = tl.load(cur_ptr + offs)
        b = tl.load(old_ptr + offs)
        if REFRESH:
            tl.store(old_ptr + offs, a)
    else:
        a = tl.load(cur_ptr + offs, mask=offs < n, other=0)
        b = tl.load(old_ptr + offs, mask=offs < n, other=0)
        if REFRESH:
            tl.store(old_ptr + offs, a, mask=offs < n)
    changed = (a != b).to(tl.int32)
    count = tl.sum(changed, axis=0)
    tl.store(counts_ptr + t, count)
    weights = 7 - tl.arange(0, 8)
    packed = tl.sum(tl.reshape(changed, (T // 8, 8)) << weights[None, :], axis=1)
    tl.store(bits_ptr + t * (T // 8) + tl.arange(0, T // 8), packed.to(tl.uint8))
    tl.store(part_ptr + t, _tile_sum(a, t * (T // PER // 128), T, PER, UBITS, UDT).to(tl.int64, bitcast=True))
    start = _lookback(state_ptr + 1, state_ptr + 1 + (n + T - 1) // T, t, count, W)
    if count > 0:
        lane = tl.arange(0, 32).to(tl.uint32)
        v = tl.sum(tl.reshape(changed, (T // 32, 32)).to(tl.uint32) << lane[None, :], axis=1)  # unit i at bit i
        cnt = v - ((v >> 1) & 0x55555555)  # popcount
        cnt = (cnt & 0x33333333) + ((cnt >> 2) & 0x33333333)
        cnt = ((((cnt + (cnt >> 4)) & 0x0F0F0F0F) * 0x01010101) >> 24).to(tl.int32)
        at = start + (tl.cumsum(cnt, axis=0) - cnt).to(tl.int64)
        first = t * T + tl.arange(0, T // 32) * 32
        for _ in range(0, tl.max(cnt, axis=0)):  # one changed unit per word per round, lowest first
            hit = v != 0
            low = v & (0 - v)
            u = first + ((low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127)
            x = tl.load(cur_ptr + u, mask=hit)
            keep = hit & (at < cap)
            tl.store(val_ptr + at, x, mask=keep)
            tl.store(off_ptr + at, (u & 65535).to(tl.int16), mask=keep)
            if UPDATE:
                tl.store(old_ptr + u, x, mask=hit)
            at += 1
            v = v & (v - 1)


@triton.jit(do_not_specialize=_NO_SPEC)
def _assemble_kernel(off_ptr, val_ptr, counts_ptr, odst_ptr, vdst_ptr, blob_ptr, tiles, k, at_offs, at_vals, size,
                     CH: tl.constexpr, BPP: tl.constexpr, TPB: tl.constexpr, UNIT: tl.constexpr):
    # A sparse blob from the fused kernel's scratch: CH offsets and values, BPP blocks' counts a program.
    p = tl.program_id(0).to(tl.int64)
    i = p * CH + tl.arange(0, CH)
    m = i < k
    tl.store(odst_ptr + i, tl.load(off_ptr + i, mask=m), mask=m)
    tl.store(vdst_ptr + i, tl.load(val_ptr + i, mask=m), mask=m)
    blk = p * BPP + tl.arange(0, BPP)
    live = blk < (p * 0 + tiles + TPB - 1) // TPB
    c = tl.load(counts_ptr + blk[:, None] * TPB + tl.arange(0, TPB)[None, :], mask=live[:, None], other=0)
    tl.store(blob_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + blk, tl.sum(c, axis=1), mask=live)
    _glue(p, counts_ptr, counts_ptr, blob_ptr, tiles, k, at_offs, at_vals, size, 32, 3, TPB, UNIT)


@triton.jit
def _sum_kernel(x_ptr, seg_ptr, nseg, part_ptr, T: tl.constexpr, PER: tl.constexpr, UBITS: tl.constexpr,
                UDT: tl.constexpr, LOG: tl.constexpr, ALIGN: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    lo = p * 0
    hi = lo + nseg - 1
    for _ in tl.static_range(LOG):  # the last segment whose first tile is <= p
        mid = (lo + hi + 1) // 2
        ok = tl.load(seg_ptr + 3 * mid + 2) <= p
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    start = tl.multiple_of(tl.load(seg_ptr + 3 * lo), ALIGN)
    length = tl.load(seg_ptr + 3 * lo + 1)
    i = p - tl.load(seg_ptr + 3 * lo + 2)
    offs = i * T + tl.arange(0, T)
    if i * T + T <= length:
        x = tl.load(x_ptr + start + offs)
    else:
        x = tl.load(x_ptr + start + offs, mask=offs < length, other=0)
    tl.store(part_ptr + p, _tile_sum(x, i * (T // PER // 128), T, PER, UBITS, UDT).to(tl.int64, bitcast=True))


def _consts(units: torch.Tensor) -> dict:
    unit = units.element_size()
    if unit not in _UNSIGNED:
        raise ProtocolError(f"delta kernels: no {unit}-byte unit")
    return dict(PER=8 // unit, UBITS=8 * unit, UDT=_UNSIGNED[unit])


class Scanned(NamedTuple):
    """What :func:`scan` leaves for the rest of an encoding."""

    counts: torch.Tensor  # int32, one per tile, zero-padded to whole groups of units
    bitmap: torch.Tensor  # uint8, 1 bit per unit, packbits order, zero past the end; whole tiles
    parts: torch.Tensor  # int64, one per tile: their wrapping sum is the checksum's word sum
    offsets: torch.Tensor | None  # the fused scan's: the first ``cap`` changed units' offsets in their groups
    values: torch.Tensor | None  # ... and their values
    updated: bool  # the fused scan refreshed ``old``'s changed units
    state: torch.Tensor | None = None  # the fused scan's ticket, tile statuses and error word


def scan(cur: torch.Tensor, old: torch.Tensor, group: int, refresh: bool = False, update: bool = False,
         cap: int = 0) -> Scanned:
    """Counts, bitmap and partial sums of two contiguous 1-D unit tensors of one length; with
    ``refresh``, ``old`` is overwritten with ``cur`` tile by tile as it is read. FINISH "fused":
    the same kernel also writes the first ``cap`` changed units' offsets and values (a sparse
    blob's, in order) to scratch tensors and, with ``update``, ``cur``'s changed units into ``old``.
    """
    n, t = cur.numel(), tile_units(cur.element_size())
    tiles = -(-n // t)
    padded = -(-n // group) * (group // t)
    counts = torch.empty(padded, dtype=torch.int32, device=cur.device)
    if padded > tiles:
        counts.narrow(0, tiles, padded - tiles).zero_()
    bitmap = torch.empty(tiles * t // 8, dtype=torch.uint8, device=cur.device)
    parts = torch.empty(tiles, dtype=torch.int64, device=cur.device)
    if not tiles:
        return Scanned(counts, bitmap, parts, None, None, False)
    consts = _consts(cur)
    if FINISH == "fused":
        state = torch.zeros(tiles + 2, dtype=torch.int64, device=cur.device)  # ticket, each tile's status, error
        offsets = torch.empty(max(cap, 1), dtype=torch.int16, device=cur.device)
        values = torch.empty(max(cap, 1), dtype=cur.dtype, device=cur.device)
        _fused_kernel[(tiles,)](cur, old, n, counts, bitmap, parts, state, offsets, values, cap, T=t, REFRESH=refresh,
                                UPDATE=update, W=LOOKBACK, num_warps=NUM_WARPS, **consts)
        return Scanned(counts, bitmap, parts, offsets, values, update, state)
    if SCAN == "words" and cur.data_ptr() % 8 == 0 and old.data_ptr() % 8 == 0:
        _scan_words_kernel[(tiles,)](cur, old, n, counts, bitmap, parts, T=t, REFRESH=refresh, num_warps=NUM_WARPS,
                                     **consts, **_lane_masks(cur.element_size()))
    else:
        _scan_kernel[(tiles,)](cur, old, n, counts, bitmap, parts, T=t, REFRESH=refresh, num_warps=NUM_WARPS,
                               **consts)
    return Scanned(counts, bitmap, parts, None, None, False)


def _lane_masks(unit: int) -> dict:
    """The scan's word constants for ``unit``-byte lanes: LOW / HIGH (each lane's low bits / top
    bit), ONES (bit 0 of each lane: multiplying sums the lanes into the top one) and PACK (moves
    bit 0 of lane l to bit 63 - l, lane 0 highest; the products' bits never collide or carry)."""
    bits, per = 8 * unit, 8 // unit
    lanes = range(per)
    return dict(LOW=sum(((1 << (bits - 1)) - 1) << (bits * i) for i in lanes),
                HIGH=sum(1 << (bits * i + bits - 1) for i in lanes), ONES=sum(1 << (bits * i) for i in lanes),
                PACK=sum(1 << (63 - (bits + 1) * i) for i in lanes))


def gather(cur: torch.Tensor, old: torch.Tensor, counts: torch.Tensor, bitmap: torch.Tensor,
           values: torch.Tensor, offsets: torch.Tensor | None, update_old: bool) -> None:
    """Write the changed units of ``cur`` (marked in ``scan``'s ``bitmap``) into ``values``
    in order, their low 16 index bits into ``offsets`` (int16) when given, and into
    ``old`` when ``update_old``."""
    starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    _gather(cur, old, counts, starts, bitmap, values, offsets, update_old, values, 0, 0, 0, 0, 0, 1)


def plan(scanned: Scanned, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, head) of ``scan``'s counts and partial sums over its ``tiles`` tiles:
    ``starts`` (int64, tiles + 1) each tile's first changed unit's place among all, then the
    total; ``head`` (int64, 2) the changed units (-1: the fused scan failed, see ``_lookback``)
    and the checksum's word sum (wrapping), the encoding's one read back to the host. One launch of one program (FINISH "device")."""
    counts, parts = scanned.counts, scanned.parts
    if FINISH == "torch":
        head = torch.stack([counts.sum(dtype=torch.int64), parts.sum()])
        mark("prefix")
        return torch.cumsum(counts.narrow(0, 0, tiles), 0, dtype=torch.int64) - counts.narrow(0, 0, tiles), head
    out = torch.empty(tiles + 3, dtype=torch.int64, device=counts.device)
    err = scanned.state.narrow(0, tiles + 1, 1) if scanned.state is not None else out
    _plan_kernel[(1,)](counts, parts, tiles, out, err, CHUNK=PLAN_CHUNK, ERR=scanned.state is not None,
                       num_warps=PLAN_WARPS)
    mark("prefix")
    return out.narrow(0, 0, tiles + 1), out.narrow(0, tiles + 1, 2)


def gather_into(cur: torch.Tensor, old: torch.Tensor, scanned: Scanned, starts: torch.Tensor, blob: torch.Tensor,
                sparse: bool, k: int, at_offs: int, at_vals: int, update_old: bool, block: int) -> None:
    """Fill all of ``blob`` (uint8): the ``k`` changed units' values from byte ``at_vals`` on,
    and either (``sparse``) the count of changed units of each ``block`` units from byte 0 and
    their offsets in their blocks from byte ``at_offs``, or the bitmap from byte 0; the padding
    between sections zeroed. ``starts``: :func:`plan`'s. ``old`` refreshed when ``update_old``.
    One launch: the gather, or for a sparse blob whose units the fused scan kept, a copy of
    those (FINISH "torch": torch operations for the header and padding, then the gather)."""
    unit, n, size = cur.element_size(), cur.numel(), blob.numel()
    counts, bitmap = scanned.counts, scanned.bitmap
    values = blob.narrow(0, at_vals, k * unit).view(cur.dtype)
    offsets = blob.narrow(0, at_offs, 2 * k).view(torch.int16) if sparse else None
    update_old = update_old and not scanned.updated
    tpb = block // tile_units(unit)
    if sparse and scanned.values is not None and k <= scanned.values.numel():
        tiles = bitmap.numel() * 8 // tile_units(unit)
        grid = max(-(-k // _ASSEMBLE_CH), -(-counts.numel() // tpb // _ASSEMBLE_BPP), 1)
        _assemble_kernel[(grid,)](scanned.offsets, scanned.values, counts, offsets, values, blob, tiles, k, at_offs,
                                  at_vals, size, CH=_ASSEMBLE_CH, BPP=_ASSEMBLE_BPP, TPB=tpb, UNIT=unit,
                                  num_warps=NUM_WARPS)
        return
    if FINISH == "torch":
        if sparse:
            nblocks = -(-n // block)
            torch.sum(counts.view(nblocks, -1), 1, dtype=torch.int32,
                      out=blob.narrow(0, 0, 4 * nblocks).view(torch.int32))
            pads = [(4 * nblocks, at_offs), (at_offs + 2 * k, at_vals)]
        else:
            blob.narrow(0, 0, -(-n // 8)).copy_(bitmap.narrow(0, 0, -(-n // 8)))
            pads = [(-(-n // 8), at_vals)]
        for a, b in [*pads, (at_vals + k * unit, size)]:
            if b > a:
                blob.narrow(0, a, b - a).zero_()
        mark("glue")
        _gather(cur, old, counts, starts, bitmap, values, offsets, update_old, values, 0, 0, 0, 0, 0, 1)
        return
    _gather(cur, old, counts, starts, bitmap, values, offsets, update_old, blob, k, at_offs, at_vals, size,
            1 if sparse else 2, tpb)


_ASSEMBLE_CH, _ASSEMBLE_BPP = 4096, 64  # a copy program's units and blocks


def _gather(cur, old, counts, starts, bitmap, values, offsets, update_old, blob, k, at_offs, at_vals, size, glue,
            tpb) -> None:
    t = tile_units(cur.element_size())
    tiles = -(-cur.numel() // t)
    kernel = _gather_bits_kernel if GATHER == "bits" else _gather_kernel
    kernel[(tiles,)](cur, old, counts, starts, bitmap, values, values if offsets is None else offsets, blob, tiles, k,
                     at_offs, at_vals, size, T=t, OFFSETS=offsets is not None, UPDATE=update_old, GLUE=glue,
                     TPB=tpb, UNIT=cur.element_size(), num_warps=NUM_WARPS)


def checksums(units: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """Word sums (int64, one per segment, wrapping) of ``(start, length)`` unit segments
    of a contiguous 1-D unit tensor; add the byte count for the checksum."""
    t = tile_units(units.element_size())
    nseg = len(segments)
    table, first = [], 0
    align = 16 // units.element_size()
    for start, length in segments:
        table += [start, length, first]
        first += -(-length // t)
        while start % align:
            align //= 2
    dev = units.device
    out = torch.zeros(nseg, dtype=torch.int64, device=dev)
    if first == 0:
        return out
    seg = torch.tensor(table, dtype=torch.int64).to(dev)
    parts = torch.empty(first, dtype=torch.int64, device=dev)
    _sum_kernel[(first,)](units, seg, nseg, parts, T=t, LOG=-(-nseg.bit_length() // 4) * 4, ALIGN=align,
                          num_warps=NUM_WARPS, **_consts(units))
    # Per segment: a difference of the running sum at its last and before its first tile.
    tiles = seg.view(nseg, 3)[:, 2]
    ends = torch.cat([tiles[1:], torch.tensor([first], dtype=torch.int64, device=dev)])
    run = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(parts, 0)])
    return run[ends] - run[tiles]
