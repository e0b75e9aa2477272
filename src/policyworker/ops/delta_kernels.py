"""The delta encoding's Triton kernels (:mod:`policyworker.ops.delta_triton` launches them
and says what each pass does; its docstring has the checksum's formula).

* scans: ``_scan_kernel`` (unit by unit) and ``_scan_words_kernel`` (64-bit words): per tile
  the count of changed units, the packbits bitmap and the checksum's share;
* ``_plan_kernel``: one program over the tiles' counts and shares: each tile's start, the
  total and the checksum's word sum;
* gathers: ``_gather_bits_kernel`` / ``_gather_kernel`` write the changed units (and
  offsets) at their places, and with ``_glue`` the blob's header and padding
  (``_gather_bits_tile``: one tile's, also the tiles finish's for a tile over its scratch);
* the fused scan: ``_fused_kernel`` places a tile's changed units itself, its start from a
  decoupled look-back (``_lookback``) over tiles taken in start order; ``_assemble_kernel``
  copies its scratch into a sparse blob;
* ``_sum_kernel``: checksums of byte segments of one buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl

_SPINS = tl.constexpr(1 << 22)  # status reads a look-back may wait (seconds; never expected to be reached)


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
def _load_tile(cur_ptr, old_ptr, offs, t, n, T: tl.constexpr, REFRESH: tl.constexpr):
    # Tile t of both streams (and old := cur on the way: REFRESH 1 stores the whole tile,
    # 2 only its changed units, into lines the load just brought in). A whole tile takes
    # no mask, so its loads are vectorized whatever n is.
    if t * T + T <= n:
        a = tl.load(cur_ptr + offs)
        b = tl.load(old_ptr + offs)
        if REFRESH == 1:
            tl.store(old_ptr + offs, a)
        if REFRESH == 2:
            tl.store(old_ptr + offs, a, mask=a != b)
    else:
        a = tl.load(cur_ptr + offs, mask=offs < n, other=0)
        b = tl.load(old_ptr + offs, mask=offs < n, other=0)
        if REFRESH == 1:
            tl.store(old_ptr + offs, a, mask=offs < n)
        if REFRESH == 2:
            tl.store(old_ptr + offs, a, mask=(offs < n) & (a != b))
    return a, b


@triton.jit
def _scan_kernel(cur_ptr, old_ptr, n, counts_ptr, bits_ptr, part_ptr, T: tl.constexpr, PER: tl.constexpr,
                 UBITS: tl.constexpr, UDT: tl.constexpr, REFRESH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = t * T + tl.arange(0, T)
    a, b = _load_tile(cur_ptr, old_ptr, offs, t, n, T, REFRESH)
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
        if REFRESH == 1:
            tl.store(ow + w, a)
        if REFRESH == 2:  # the changed words
            tl.store(ow + w, a, mask=a != b)
        _scan_words(a, b, t, counts_ptr, bits_ptr, part_ptr, T, PER, UBITS, LOW, HIGH, PACK, ONES)
    else:  # the ragged last tile: words built from units, zero past the end
        j = tl.arange(0, PER)[None, None, None, :]
        u = t * T + w[:, :, :, None] * PER + j
        ok = u < n
        au = tl.load(cur_ptr + u, mask=ok, other=0)
        bu = tl.load(old_ptr + u, mask=ok, other=0)
        if REFRESH == 1:
            tl.store(old_ptr + u, au, mask=ok)
        if REFRESH == 2:
            tl.store(old_ptr + u, au, mask=ok & (au != bu))
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
        _gather_bits_tile(cur_ptr, old_ptr, bits_ptr, val_ptr, off_ptr, t, tl.load(starts_ptr + t), T, OFFSETS, UPDATE)


@triton.jit
def _gather_bits_tile(cur_ptr, old_ptr, bits_ptr, val_ptr, off_ptr, t, start, T: tl.constexpr, OFFSETS: tl.constexpr,
                      UPDATE: tl.constexpr):
    """Tile ``t``'s changed units (its bitmap says which) from ``cur`` to ``val[start:]`` in order,
    with their offsets in their blocks to ``off[start:]`` (OFFSETS) and into ``old`` (UPDATE)."""
    q = tl.arange(0, T // 32)
    v = tl.load(bits_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + t * (T // 32) + q)
    # packbits order to unit i at bit i of its 32-bit word: reverse the bits of each byte
    v = ((v >> 1) & 0x55555555) | ((v & 0x55555555) << 1)
    v = ((v >> 2) & 0x33333333) | ((v & 0x33333333) << 2)
    v = ((v >> 4) & 0x0F0F0F0F) | ((v & 0x0F0F0F0F) << 4)
    cnt = v - ((v >> 1) & 0x55555555)  # popcount
    cnt = (cnt & 0x33333333) + ((cnt >> 2) & 0x33333333)
    cnt = ((((cnt + (cnt >> 4)) & 0x0F0F0F0F) * 0x01010101) >> 24).to(tl.int32)
    at = start + (tl.cumsum(cnt, axis=0) - cnt).to(tl.int64)
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
    a, b = _load_tile(cur_ptr, old_ptr, offs, t, n, T, REFRESH)
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
