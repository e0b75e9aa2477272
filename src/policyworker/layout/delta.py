"""Delta encoding of a byte stream against its previous version, and an exact checksum.

A *stream* is the bytes one transfer carries (its copies back to back, as ``pack``
lays them out), seen as *units* of the smallest element size among its copies (2
bytes for bf16 / fp16 / fp32 mixes). Comparisons are of unit bit patterns, never of
values: ``-0.0`` vs ``0.0`` is a change, ``NaN`` equal to the same ``NaN`` bits is not.

Encodings of the changed units (``encode`` picks the smallest; every section of a
blob is padded to 8 bytes so the receiver can view it in place):

* ``SPARSE``: per block of 65,536 units the count of changed units (int32), then each
  changed unit's offset inside its block (uint16), then the values. 2 + u bytes per
  changed unit (u = unit size) and 4 bytes per 128 KiB block of bf16: 2% of the bytes
  at 1% changed, where a bitmap alone would be 6.25%.
* ``BITMAP``: one bit per unit (numpy ``packbits`` order), then the values: smaller
  past ~6% changed.
* ``RAW``: the whole stream (past ~94% changed, or a tiny stream).
* ``NONE``: nothing changed.

:func:`checksum` is a 64-bit linear hash of bytes: little-endian 64-bit words ``x_j``
(the tail zero-padded), ``sum(w_j * x_j) mod 2**64`` with odd weights ``w_j`` that
depend on the word's position. A change of any one word always changes it (an odd
weight times a non-zero difference is non-zero mod 2**64), swaps and shifts change it
unless weights collide; it is a matrix-vector product, ~5 GB/s on one CPU core
(crc32 is ~2 GB/s). It proves a receiver's bytes equal the sender's after a delta.

On CUDA tensors, when Triton imports, :func:`encode` and :func:`checksum` /
:func:`checksums` run :mod:`policyworker.ops.delta_triton`'s kernels (one read of
both sides for the encoding, its checksum and the shadow refresh included; one read
for a checksum); the blobs and checksums are bit for bit the other paths'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from policyworker.errors import ProtocolError

__all__ = ["BITMAP", "NONE", "RAW", "SPARSE", "Encoded", "apply", "changed_fraction", "checksum", "checksums",
           "encode", "unit_dtype"]

NONE, SPARSE, BITMAP, RAW = 0, 1, 2, 3
_BLOCK_BITS = 16
_BLOCK = 1 << _BLOCK_BITS
_UNIT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_M64 = (1 << 64) - 1


def _numpy_ok(t: torch.Tensor) -> bool:
    """CPU tensors take numpy's paths (faster on one core); others torch's (same results)."""
    return t.device.type == "cpu"


@functools.cache
def _triton_ops():
    try:
        from policyworker.ops import delta_triton
    except ImportError:  # no Triton: the torch path
        return None
    return delta_triton


def _fused(*ts: torch.Tensor):
    """The Triton kernels' module when every tensor is a contiguous CUDA tensor, else None."""
    if not all(t.is_cuda and t.is_contiguous() for t in ts):
        return None
    return _triton_ops()


def unit_dtype(size: int) -> torch.dtype:
    """The integer dtype of ``size``-byte units."""
    try:
        return _UNIT[size]
    except KeyError:
        raise ProtocolError(f"no {size}-byte unit") from None


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


@dataclass(frozen=True, slots=True)
class Encoded:
    """The changed units of one stream: ``kind``, ``count`` changed units, ``blob`` (uint8);
    ``checksum``: :func:`checksum` of the stream when asked for, else None."""

    kind: int
    count: int
    blob: torch.Tensor
    checksum: int | None = None


def blob_bytes(kind: int, n: int, k: int, unit: int) -> int:
    """Length of a blob of ``kind`` for ``k`` of ``n`` units changed (both sides compute it)."""
    if kind == NONE:
        return 0
    if kind == RAW:
        return _pad8(n * unit)
    vals = _pad8(k * unit)
    if kind == SPARSE:
        return _pad8(4 * -(-n // _BLOCK)) + _pad8(2 * k) + vals
    if kind == BITMAP:
        return _pad8(-(-n // 8)) + vals
    raise ProtocolError(f"unknown delta encoding {kind}")


def _changed_index(cur: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat indices (int64, ascending) where two 1-D unit tensors differ."""
    if _numpy_ok(cur):  # numpy's compare + flatnonzero: ~3x torch's on one core
        return torch.from_numpy(np.flatnonzero(cur.numpy() != old.numpy()))
    return (cur != old).nonzero().squeeze(1)


def encode(cur: torch.Tensor, old: torch.Tensor, *, update_old: bool = False,
           with_checksum: bool = False) -> Encoded:
    """The units of ``cur`` that differ from ``old`` (1-D unit tensors of one length).

    ``update_old``: ``old`` then holds ``cur``'s units (a sender's shadow refresh; on
    CUDA in the pass that writes the blob). ``with_checksum``: ``Encoded.checksum`` is
    ``checksum(cur)`` (on CUDA from the encoding's own read of ``cur``).
    """
    n, unit = cur.numel(), cur.element_size()
    ops = _fused(cur, old) if n and cur.dtype == old.dtype and old.numel() == n else None
    if ops is not None:
        return _encode_fused(ops, cur, old, update_old, with_checksum)
    enc = _encode_np(cur, old, n, unit) if _numpy_ok(cur) else _encode_torch(cur, old)
    if with_checksum:
        enc = Encoded(enc.kind, enc.count, enc.blob, checksum(cur))
    if update_old:
        apply(old, enc.kind, enc.count, enc.blob)
    return enc


def _encode_fused(ops, cur: torch.Tensor, old: torch.Tensor, update_old: bool, with_checksum: bool) -> Encoded:
    """The Triton path: one scan of both sides (counts, bitmap, checksum shares), the tiles'
    starts and the totals, one read of the totals to the host, one gather that fills the blob."""
    n, unit = cur.numel(), cur.element_size()
    refresh = ops.SCAN_REFRESH[ops.REFRESH] if update_old else 0
    in_scan = refresh > 0  # else the gather refreshes (changed units only), when asked
    ops.mark("start")
    scanned = ops.scan(cur, old, _BLOCK, refresh=refresh, update=update_old and not in_scan,
                       cap=_sparse_cap(n, unit) if ops.FINISH == "fused" else 0)
    ops.mark("scan")
    starts, head = ops.plan(scanned, scanned.bitmap.numel() * 8 // ops.tile_units(unit))
    k, words = head.tolist()  # the encoding's one read back to the host
    ops.mark("sync")
    if k < 0:
        raise ProtocolError("delta kernels: the fused scan's look-back gave up waiting (a kernel fault)")
    total = (words + n * unit) & _M64 if with_checksum else None
    if k == 0:
        return Encoded(NONE, 0, torch.empty(0, dtype=torch.uint8, device=cur.device), total)
    kind = _smallest(n, k, unit)
    size = blob_bytes(kind, n, k, unit)
    blob = torch.empty(size, dtype=torch.uint8, device=cur.device)  # every byte is written below
    if kind == RAW:
        blob.narrow(0, 0, n * unit).copy_(cur.view(torch.uint8))
        _zero_pads(blob, [(n * unit, size)])
        if update_old and not in_scan and not scanned.updated:
            old.copy_(cur)
        return Encoded(RAW, k, blob, total)
    at_offs = _pad8(4 * -(-n // _BLOCK)) if kind == SPARSE else 0
    at_vals = at_offs + _pad8(2 * k) if kind == SPARSE else _pad8(-(-n // 8))
    ops.gather_into(cur, old, scanned, starts, blob, kind == SPARSE, k, at_offs, at_vals, update_old and not in_scan,
                    _BLOCK)
    ops.mark("gather")
    return Encoded(kind, k, blob, total)


@functools.lru_cache(maxsize=64)
def _sparse_cap(n: int, unit: int) -> int:
    """The most changed units of ``n`` for which the sparse encoding is the smallest (0: never)."""
    cap = max(0, min(n, (_pad8(-(-n // 8)) - _pad8(4 * -(-n // _BLOCK))) // 2))
    while cap > 0 and _smallest(n, cap, unit) != SPARSE:
        cap -= 1
    while cap < n and _smallest(n, cap + 1, unit) == SPARSE:
        cap += 1
    return cap


def _zero_pads(blob: torch.Tensor, spans: list[tuple[int, int]]) -> None:
    """Zero the padding bytes ``[a, b)`` between a blob's sections (at most 7 each)."""
    for a, b in spans:
        if b > a:
            blob.narrow(0, a, b - a).zero_()


def _encode_torch(cur: torch.Tensor, old: torch.Tensor) -> Encoded:
    """The torch path (any device): compare, ``nonzero``, gather."""
    n, unit = cur.numel(), cur.element_size()
    idx = _changed_index(cur, old)
    k = idx.numel()
    if k == 0:
        return Encoded(NONE, 0, torch.empty(0, dtype=torch.uint8, device=cur.device))
    kind = _smallest(n, k, unit)
    blob = torch.zeros(blob_bytes(kind, n, k, unit), dtype=torch.uint8, device=cur.device)
    if kind == RAW:
        blob.narrow(0, 0, n * unit).copy_(cur.view(torch.uint8))
        return Encoded(RAW, k, blob)
    at = 0
    if kind == SPARSE:
        nblocks = -(-n // _BLOCK)
        counts = torch.bincount(idx >> _BLOCK_BITS, minlength=nblocks).to(torch.int32)
        blob.narrow(0, 0, 4 * nblocks).view(torch.int32).copy_(counts)
        at = _pad8(4 * nblocks)
        blob.narrow(0, at, 2 * k).view(torch.int16).copy_((idx & (_BLOCK - 1)).to(torch.int32).to(torch.int16))
        at += _pad8(2 * k)
    else:
        mask = torch.zeros(n, dtype=torch.bool, device=cur.device)
        mask[idx] = True
        nbits = -(-n // 8)
        blob.narrow(0, 0, nbits).copy_(_packbits(mask))
        at = _pad8(nbits)
    blob.narrow(0, at, k * unit).view(cur.dtype).copy_(cur[idx])
    return Encoded(kind, k, blob)


def _smallest(n: int, k: int, unit: int) -> int:
    return min((SPARSE, BITMAP, RAW), key=lambda c: (blob_bytes(c, n, k, unit), c))


def _dense(a: np.ndarray, b: np.ndarray) -> bool:
    """True when so many 8-byte words differ that a sparse encoding cannot be the smallest."""
    per = 8 // a.itemsize
    words = a.size // per
    if per == 1 or not words or a.ctypes.data % 8 or b.ctypes.data % 8:
        return False
    end = words * per
    changed_words = int(np.count_nonzero(a[:end].view(np.uint64) != b[:end].view(np.uint64)))
    return changed_words * 16 >= a.size  # at least n/16 changed units: a bitmap is no larger


def _changed_np(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ascending indices, values of ``a``) where two 1-D unit arrays differ.

    Compares 8-byte words first and gathers only the words that differ: numpy's
    flatnonzero costs per element (so it runs on 8 / unit times fewer), and the lanes
    and values come out of the gathered words (no second random read of the arrays).
    """
    per = 8 // a.itemsize
    words = a.size // per if per > 1 and a.ctypes.data % 8 == 0 and b.ctypes.data % 8 == 0 else 0
    if not words:
        idx = np.flatnonzero(a != b)
        return idx, a[idx]
    end = words * per
    aw = a[:end].view(np.uint64)
    hit = np.flatnonzero(aw != b[:end].view(np.uint64))
    new = aw[hit]
    lanes = ((new ^ b[:end].view(np.uint64)[hit]).view(a.dtype).reshape(-1, per) != 0)
    idx = (hit[:, None] * per + np.arange(per))[lanes]
    vals = new.view(a.dtype).reshape(-1, per)[lanes]
    if end < a.size:
        tail = np.flatnonzero(a[end:] != b[end:]) + end
        idx, vals = np.concatenate([idx, tail]), np.concatenate([vals, a[tail]])
    return idx, vals


def _encode_np(cur: torch.Tensor, old: torch.Tensor, n: int, unit: int) -> Encoded:
    # numpy on CPU: its compare, flatnonzero and boolean indexing are ~3-10x torch's on one core.
    a, b = cur.numpy(), old.numpy()
    mask = None
    if _dense(a, b):
        # Many changes: a unit mask, no index arrays (a bitmap or the raw bytes win here).
        mask = a != b
        k = int(np.count_nonzero(mask))
        kind = _smallest(n, k, unit)
        if kind == SPARSE:
            mask = None
    if mask is None:
        idx, vals = _changed_np(a, b)
        k = idx.size
        kind = _smallest(n, k, unit) if k else NONE
    if k == 0:
        return Encoded(NONE, 0, torch.empty(0, dtype=torch.uint8))
    out = np.zeros(blob_bytes(kind, n, k, unit), dtype=np.uint8)
    if kind == RAW:
        out[:n * unit] = a.view(np.uint8)
        return Encoded(RAW, k, torch.from_numpy(out))
    if kind == BITMAP and mask is not None:
        nbits = -(-n // 8)
        out[:nbits] = np.packbits(mask)
        at = _pad8(nbits)
        out[at:at + k * unit].view(a.dtype)[:] = a[mask]
        return Encoded(BITMAP, k, torch.from_numpy(out))
    return Encoded(kind, k, torch.from_numpy(_fill_np(out, kind, n, unit, idx, vals)))


def _fill_np(out: np.ndarray, kind: int, n: int, unit: int, idx: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """Write a SPARSE or BITMAP blob of the changed units ``idx`` (ascending) with ``vals`` into ``out``."""
    k = idx.size
    if kind == SPARSE:
        nblocks = -(-n // _BLOCK)
        out[:4 * nblocks].view(np.int32)[:] = np.bincount(idx >> _BLOCK_BITS, minlength=nblocks)
        at = _pad8(4 * nblocks)
        out[at:at + 2 * k].view(np.uint16)[:] = idx & (_BLOCK - 1)
        at += _pad8(2 * k)
    else:
        nbits = -(-n // 8)
        mask = np.zeros(n, dtype=np.bool_)
        mask[idx] = True
        out[:nbits] = np.packbits(mask)
        at = _pad8(nbits)
    out[at:at + k * unit].view(vals.dtype)[:] = vals
    return out


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    if _numpy_ok(mask):
        return torch.from_numpy(np.packbits(mask.numpy()))
    n = mask.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1).to(torch.uint8)


def _unpackbits(bits: torch.Tensor, n: int) -> torch.Tensor:
    if _numpy_ok(bits):
        return torch.from_numpy(np.unpackbits(bits.numpy(), count=n).view(np.bool_))
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=bits.device)
    return ((bits.view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()


def apply(dst: torch.Tensor, kind: int, count: int, blob: torch.Tensor) -> None:
    """Write the changed units of ``blob`` into ``dst`` (a 1-D unit tensor, the base).

    ``ProtocolError`` when the blob does not fit ``dst`` (wrong length, counts that do
    not add up, an index past the end): nothing is written then.
    """
    n, unit = dst.numel(), dst.element_size()
    if kind == NONE:
        if count != 0 or blob.numel() != 0:
            raise ProtocolError("delta: an empty encoding with a payload")
        return
    if count < 1 or count > n or blob.numel() != blob_bytes(kind, n, count, unit):
        raise ProtocolError(f"delta: {blob.numel()} bytes do not encode {count} of {n} {unit}-byte units as {kind}")
    if kind == RAW:
        dst.view(torch.uint8).copy_(blob.narrow(0, 0, n * unit))
        return
    if _numpy_ok(dst):
        _apply_np(dst.numpy(), blob.numpy(), kind, n, count, unit)
        return
    if kind == SPARSE:
        nblocks = -(-n // _BLOCK)
        counts = blob.narrow(0, 0, 4 * nblocks).view(torch.int32).to(torch.int64)
        at = _pad8(4 * nblocks)
        offsets = blob.narrow(0, at, 2 * count).view(torch.int16).to(torch.int64) & (_BLOCK - 1)
        at += _pad8(2 * count)
        if bool((counts < 0).any()) or int(counts.sum()) != count:
            raise ProtocolError(f"delta: block counts do not add up to {count}")
        blocks = torch.repeat_interleave(torch.arange(nblocks, device=dst.device), counts)
        idx = (blocks << _BLOCK_BITS) | offsets
        if count and int(idx.max()) >= n:
            raise ProtocolError(f"delta: an index past the {n} units of the stream")
    elif kind == BITMAP:
        nbits = -(-n // 8)
        idx = _unpackbits(blob.narrow(0, 0, nbits), n).nonzero().squeeze(1)
        at = _pad8(nbits)
        if idx.numel() != count:
            raise ProtocolError(f"delta: the bitmap marks {idx.numel()} units, the header {count}")
    else:
        raise ProtocolError(f"unknown delta encoding {kind}")
    dst[idx] = blob.narrow(0, at, count * unit).view(dst.dtype)


def _apply_np(dst: np.ndarray, blob: np.ndarray, kind: int, n: int, count: int, unit: int) -> None:
    if kind == SPARSE:
        nblocks = -(-n // _BLOCK)
        counts = blob[:4 * nblocks].view(np.int32)
        at = _pad8(4 * nblocks)
        offsets = blob[at:at + 2 * count].view(np.uint16)
        at += _pad8(2 * count)
        if (counts < 0).any() or int(counts.sum(dtype=np.int64)) != count:
            raise ProtocolError(f"delta: block counts do not add up to {count}")
        idx = (np.repeat(np.arange(nblocks, dtype=np.int64), counts) << _BLOCK_BITS) | offsets
        if int(idx.max()) >= n:
            raise ProtocolError(f"delta: an index past the {n} units of the stream")
        dst[idx] = blob[at:at + count * unit].view(dst.dtype)
    elif kind == BITMAP:
        nbits = -(-n // 8)
        mask = np.unpackbits(blob[:nbits], count=n).view(np.bool_)
        at = _pad8(nbits)
        if int(np.count_nonzero(mask)) != count:
            raise ProtocolError(f"delta: the bitmap does not mark {count} units")
        dst[mask] = blob[at:at + count * unit].view(dst.dtype)
    else:
        raise ProtocolError(f"unknown delta encoding {kind}")


def changed_fraction(cur: torch.Tensor, old: torch.Tensor, stride: int = 127) -> tuple[int, int]:
    """(changed, looked at) over every ``stride``-th unit: a cheap estimate of the fraction."""
    if _numpy_ok(cur):
        a, b = cur.numpy()[::stride], old.numpy()[::stride]
        return int(np.count_nonzero(a != b)), a.size
    a, b = cur[::stride], old[::stride]
    return int((a != b).sum()), a.numel()


_ROW = 128  # words per row of the matrix-vector product


@functools.lru_cache(maxsize=8)
def _row_weights(device: torch.device) -> torch.Tensor:
    return _weights(_ROW, 1, device)


def _weights(n: int, salt: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(weights_at(np.arange(n, dtype=np.uint64), salt).view(np.int64)).to(device)


def weights_at(i: np.ndarray, salt: int) -> np.ndarray:
    """The odd pseudo-random weights (uint64) of positions ``i`` (uint64): word ``j`` of a
    checksummed span weighs ``weights_at(j % 128, 1) * weights_at(j // 128, 2)`` mod 2**64.
    numpy's uint64 arithmetic wraps by definition (torch's int64 overflow is C++ signed
    overflow)."""
    with np.errstate(over="ignore"):
        w = ((i + np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)) ^ (i >> np.uint64(3))
        return (w * np.uint64(0xBF58476D1CE4E5B9)) | np.uint64(1)


def checksum(data: torch.Tensor) -> int:
    """64-bit linear hash of the bytes of a tensor (see the module docstring)."""
    raw = data.reshape(-1).view(torch.uint8) if data.is_contiguous() else data.contiguous().reshape(-1).view(torch.uint8)
    ops = _fused(raw)
    if ops is not None:
        return _checksums_fused(ops, raw, [(0, raw.numel())])[0]
    return _checksum_torch(raw)


def checksums(raw: torch.Tensor, segments: list[tuple[int, int]]) -> list[int]:
    """``checksum(raw[at:at + n])`` for each ``(at, n)`` of a 1-D uint8 tensor (one launch on CUDA)."""
    ops = _fused(raw)
    if ops is not None:
        return _checksums_fused(ops, raw, segments)
    return [_checksum_torch(raw.narrow(0, at, n)) for at, n in segments]


def _checksums_fused(ops, raw: torch.Tensor, segments: list[tuple[int, int]]) -> list[int]:
    live = [(at, n) for at, n in segments if n]
    if not live:
        return [0] * len(segments)
    lo, hi = min(at for at, _ in live), max(at + n for at, n in live)
    unit = 8  # the widest unit every segment is made of (and the pointer is aligned to)
    while unit > 1 and ((raw.data_ptr() + lo) % unit or (raw.storage_offset() + lo) % unit or (hi - lo) % unit
                        or any((at - lo) % unit or n % unit for at, n in live)):
        unit //= 2
    units = raw.narrow(0, lo, hi - lo).view(unit_dtype(unit))
    sums = ops.checksums(units, [((at - lo) // unit, n // unit) if n else (0, 0) for at, n in segments]).tolist()
    return [(s + n) & _M64 for s, (_, n) in zip(sums, segments)]


def _checksum_torch(raw: torch.Tensor) -> int:
    """The torch path of :func:`checksum` on a 1-D uint8 tensor."""
    n = raw.numel()
    words = n // 8
    if n % 8 or raw.storage_offset() % 8:
        padded = torch.zeros(_pad8(n), dtype=torch.uint8, device=raw.device)
        padded[:n] = raw
        raw, words = padded, _pad8(n) // 8
    x = raw.view(torch.int64)
    rows = words // _ROW
    w = _row_weights(raw.device)
    total = 0
    if rows:
        mat = x.narrow(0, 0, rows * _ROW).view(rows, _ROW)
        per_row = torch.mv(mat, w) if raw.device.type == "cpu" else (mat * w).sum(1)
        total += int((per_row * _weights(rows, 2, raw.device)).sum())
    rest = words - rows * _ROW
    if rest:
        tail = int((x.narrow(0, rows * _ROW, rest) * w[:rest]).sum())
        total += tail * int(_weights(rows + 1, 2, raw.device)[rows])
    return (total + n) & _M64
