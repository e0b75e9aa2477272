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
* :func:`plan`, one program over the tiles' counts and checksum shares: each tile's
  start among the changed units, the total and the checksum's word sum, the two numbers
  the host reads back (the encoding's one device-to-host read).
* :func:`gather_into`, per tile with changes, reads its bitmap, loads only the changed
  units, and writes them (and, for the sparse encoding, their offsets inside their block)
  at their places in the blob; the same launch writes the blob's header (the sparse
  encoding's block counts, or the bitmap) and zeroes its padding, so no torch operation
  runs between the scan and the gather (``FINISH = "device"``). On an H200 that finish's
  one-program prefix sum over 131k tiles took 0.17 ms against torch's 0.03 ms cumsum
  (benchmarks/RESULTS.md, "Delta kernels: the device finish"), and ``"torch"`` (torch sums,
  a cumsum and copies) left the GPU idle while the host launched the header's sums and
  copies after its read (0.2 copies at 3%). The default, ``"mixed"``, takes each one's faster
  half: torch's cumsum for the starts (with the total), the gather's own header and padding.

``FINISH = "fused"`` (the benchmark sweeps it) places the changed units in the scan
itself: tiles are taken in start order (a ticket), each tile learns its start by a
decoupled look-back over the tiles before it, and writes its changed units, read again
from the cache rather than from memory, with their offsets into a scratch of at most
``cap`` units (the most a sparse blob can hold: 1/8 of a bf16 stream's bytes, plus its
offsets); a sparse blob is then a copy of the scratch, a bitmap blob the gather.

``FINISH = "tiles"`` keeps the stream's one read without any wait between tiles: the scan
writes each tile's changed units (and their offsets) compactly into the tile's own slot
of a scratch (``tile_cap`` units a tile, 1/``TILE_SHARE`` of them: 1/8 of a bf16 stream's
bytes more memory while it runs), places from an in-tile prefix sum, and refreshes
``old`` with masked stores of the changed units; torch's cumsum gives the tiles' starts
(as the torch finish); a compaction copies each tile's run to its start and writes the
blob's header and padding, and a tile over its slot takes the bits gather.
:mod:`policyworker.ops.delta_tiles` has those kernels and their memory traffic.

The old tensor can be refreshed (made equal to the current one) on the way: by the
gather, which writes the changed units only (``REFRESH = "gather"``), but into lines of
``old`` read long before (at a few percent changed most 32-byte sectors hold a change:
scattered partial writes); by the scan, which writes every tile it read whole
(``"scan"``: one more write of the stream, but in full 16-byte stores); or by the scan
with masked stores of the changed units (``"masked"``, the default: into the lines its
load just brought into the cache; only the sectors holding a change go back to memory).
``benchmarks/bench_delta_encode.py --sweep`` times all three; on an H100 the encode with
the refresh took 1.5–1.7 / 1.9–2.0 / 2.2–2.5 flat copies at 1 / 3 / 10% changed masked,
against 1.8–2.0 / 2.6–2.8 / 4.3–4.5 in the gather and 1.9–2.0 / 2.1–2.2 / 2.3–2.4 whole
(benchmarks/RESULTS.md, "Delta kernels: the shadow's refresh in the scan, masked").
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

from typing import Any, NamedTuple

import torch
import triton.language as tl

from policyworker.errors import ConfigError, ProtocolError
from policyworker.ops.delta_kernels import (_assemble_kernel, _fused_kernel, _gather_bits_kernel, _gather_kernel,
                                            _plan_kernel, _scan_kernel, _scan_words_kernel, _sum_kernel)
from policyworker.ops.delta_tiles import _compact_kernel, _scan_tiles_kernel

__all__ = ["FINISH", "GATHER", "LOOKBACK", "NUM_WARPS", "PLAN_CHUNK", "PLAN_WARPS", "PROFILE", "REFRESH", "SCAN",
           "SCAN_REFRESH", "Scanned", "TILE_AHEAD", "TILE_BYTES", "TILE_SHARE", "TILE_STEP",
           "checksums", "configure", "gather_into", "mark", "plan", "scan", "tile_cap", "tile_units"]

#: Bytes of one stream a program covers (a power of two, 1 KiB .. 64 KiB), and warps per program.
TILE_BYTES = 16384
NUM_WARPS = 4
#: Which pass refreshes the old tensor when asked: "gather" (changed units), "scan" (whole tiles)
#: or "masked" (the scan, changed units: the default, measured fastest at 1, 3 and 10% changed).
REFRESH = "masked"
#: The code :func:`scan` takes for each REFRESH (0: the scan leaves the old tensor alone).
SCAN_REFRESH = {"gather": 0, "scan": 1, "masked": 2}
#: The scan's form ("words" or "units") and the gather's ("bits" or "units").
SCAN = "units"
GATHER = "bits"
#: What happens between the scan and the gather: "device" (one kernel sums the tiles' counts and
#: checksum shares and lays out their starts; the gather writes the blob's header and padding),
#: "torch" (torch reductions, a cumsum and copies), "mixed" (the default: torch's cumsum for the
#: tiles' starts and the totals; the gather writes the header and padding, as with "device": no
#: torch operation between the host's read and the gather; measured fastest on an H200),
#: "fused" (the scan, in its units form whatever SCAN says, places the changed units itself) or
#: "tiles" (the scan, in its units form, keeps each tile's changed units in a slot of its own;
#: torch's cumsum, then a compaction of the slots into the blob).
FINISH = "mixed"
#: The tiles finish's slot: 1/TILE_SHARE of a tile's units (a power of two, 2 .. 64), the bytes
#: its scan takes a step (a power of two, 1 KiB .. 64 KiB; at most a tile), and whether the scan
#: loads the next step before working on this one (TILE_AHEAD).
TILE_SHARE = 16
TILE_STEP = 4096
TILE_AHEAD = False
#: Tile counts per step of the device finish's one-program prefix sum, and its warps.
PLAN_CHUNK = 4096
PLAN_WARPS = 8
#: Status words the fused kernel's look-back reads at once.
LOOKBACK = 32
#: When a list, :func:`mark` appends (step name, recorded CUDA event) to it.
PROFILE: list | None = None
_GROUP = 1 << 16  # units per block of the sparse encoding: a tile never straddles one
_UNSIGNED = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}


def configure(*, tile_bytes: int | None = None, num_warps: int | None = None, refresh: str | None = None,
              scan: str | None = None, gather: str | None = None, finish: str | None = None,
              plan_chunk: int | None = None, tile_share: int | None = None, tile_step: int | None = None,
              tile_ahead: bool | None = None) -> None:
    """Set the tile size, warps, refreshing pass, the passes' forms and the finish (the benchmark's sweep)."""
    global TILE_BYTES, NUM_WARPS, REFRESH, SCAN, GATHER, FINISH, PLAN_CHUNK, TILE_SHARE, TILE_STEP, TILE_AHEAD
    if finish is not None:
        FINISH = _one_of("finish", finish, ("device", "torch", "mixed", "fused", "tiles"))
    if tile_share is not None:
        TILE_SHARE = _power_of_two("tile_share", tile_share, 2, 64)
    if tile_step is not None:
        TILE_STEP = _power_of_two("tile_step", tile_step, 1024, 65536)
    if tile_ahead is not None:
        TILE_AHEAD = _one_of("tile_ahead", tile_ahead, (False, True))
    if plan_chunk is not None:
        PLAN_CHUNK = _power_of_two("plan_chunk", plan_chunk, 16, 65536)
    if scan is not None:
        SCAN = _one_of("scan", scan, ("words", "units"))
    if gather is not None:
        GATHER = _one_of("gather", gather, ("bits", "units"))
    if refresh is not None:
        REFRESH = _one_of("refresh", refresh, tuple(SCAN_REFRESH))
    if tile_bytes is not None:
        TILE_BYTES = _power_of_two("tile_bytes", tile_bytes, 1024, 65536)
    if num_warps is not None:
        NUM_WARPS = _one_of("num_warps", num_warps, (1, 2, 4, 8, 16))


def _one_of(name: str, value: Any, allowed: tuple) -> Any:
    # Exact type too: True is not 1, and 1 is not True.
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ConfigError(f"delta kernels: {name} {value!r} is not one of {', '.join(map(repr, allowed))}")
    return value


def _power_of_two(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi or value & (value - 1):
        raise ConfigError(f"delta kernels: {name} {value!r} is not a power of two in {lo:,} .. {hi:,}")
    return value


def mark(step: str) -> None:
    """Record a CUDA event named ``step`` into :data:`PROFILE` (when it is a list)."""
    if PROFILE is not None and torch.cuda.is_available():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        PROFILE.append((step, ev))


def tile_units(unit: int) -> int:
    """Units per tile for ``unit``-byte units (divides 65,536; a multiple of 128 words)."""
    return min(TILE_BYTES // unit, _GROUP)


def tile_cap(unit: int) -> int:
    """Changed units a tile's scratch slot holds under the tiles finish (a power of two)."""
    return tile_units(unit) // TILE_SHARE


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
    offsets: torch.Tensor | None  # the fused (tiles) scan's: the first ``cap`` changed units' (of each tile)
    # offsets in their groups
    values: torch.Tensor | None  # ... and their values
    updated: bool  # the fused or tiles scan refreshed ``old``'s changed units
    state: torch.Tensor | None = None  # the fused scan's ticket, tile statuses and error word
    cap: int = 0  # the tiles scan's slot: ``offsets`` / ``values`` hold tile t's first ``cap`` from t * cap


def scan(cur: torch.Tensor, old: torch.Tensor, group: int, refresh: int = 0, update: bool = False,
         cap: int = 0) -> Scanned:
    """Counts, bitmap and partial sums of two contiguous 1-D unit tensors of one length; with
    ``refresh``, ``old`` is made equal to ``cur`` tile by tile as it is read (1: each tile
    stored whole, 2: its changed units stored). FINISH "fused":
    the same kernel also writes the first ``cap`` changed units' offsets and values (a sparse
    blob's, in order) to scratch tensors and, with ``update``, ``cur``'s changed units into ``old``.
    FINISH "tiles": each tile's first :func:`tile_cap` changed units' offsets and values to the
    tile's slot of scratch tensors and, with ``update``, ``cur``'s changed units into ``old``.
    """
    if refresh not in SCAN_REFRESH.values() or isinstance(refresh, bool):
        raise ConfigError(f"delta kernels: refresh {refresh!r} is not 0 (none), 1 (whole tiles) or 2 (changed units)")
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
    if FINISH == "tiles":
        c = tile_cap(cur.element_size())
        offsets = torch.empty(tiles * c, dtype=torch.int16, device=cur.device)
        values = torch.empty(tiles * c, dtype=cur.dtype, device=cur.device)
        step = min(t, TILE_STEP // cur.element_size())
        _scan_tiles_kernel[(tiles,)](cur, old, n, counts, bitmap, parts, values, offsets, T=t, S=step, CAP=c,
                                     REFRESH=refresh, UPDATE=update, AHEAD=TILE_AHEAD and step < t, num_warps=NUM_WARPS,
                                     **consts)
        return Scanned(counts, bitmap, parts, offsets, values, update, None, c)
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


def plan(scanned: Scanned, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, head) of ``scan``'s counts and partial sums over its ``tiles`` tiles:
    ``starts`` (int64, tiles + 1) each tile's first changed unit's place among all, then the
    total; ``head`` (int64, 2) the changed units (-1: the fused scan failed, see ``_lookback``)
    and the checksum's word sum (wrapping), the encoding's one read back to the host. One
    launch of one program (FINISH "torch": torch reductions and a cumsum, ``starts`` without
    the total; "tiles" and "mixed": a cumsum, with it)."""
    counts, parts = scanned.counts, scanned.parts
    if scanned.cap or FINISH == "mixed":
        starts = torch.empty(tiles + 1, dtype=torch.int64, device=counts.device)
        starts.narrow(0, 0, 1).zero_()
        torch.cumsum(counts.narrow(0, 0, tiles), 0, dtype=torch.int64, out=starts.narrow(0, 1, tiles))
        head = torch.stack([starts[tiles], parts.sum()])
        mark("prefix")
        return starts, head
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
    those, or the tiles scan's slots compacted (FINISH "torch": torch operations for the
    header and padding, then the gather)."""
    unit, n, size = cur.element_size(), cur.numel(), blob.numel()
    counts, bitmap = scanned.counts, scanned.bitmap
    values = blob.narrow(0, at_vals, k * unit).view(cur.dtype)
    offsets = blob.narrow(0, at_offs, 2 * k).view(torch.int16) if sparse else None
    update_old = update_old and not scanned.updated
    tpb = block // tile_units(unit)
    if scanned.cap:
        t = tile_units(unit)
        _compact_kernel[(-(-n // t),)](cur, counts, starts, bitmap, scanned.values, scanned.offsets, values,
                                       values if offsets is None else offsets, blob, -(-n // t), k, at_offs, at_vals,
                                       size, T=t, CAP=scanned.cap, OFFSETS=sparse, GLUE=1 if sparse else 2, TPB=tpb,
                                       UNIT=unit, num_warps=NUM_WARPS)
        return
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
