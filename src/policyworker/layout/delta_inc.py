"""A delta's CPU work in proportion to what changed: one cache-sized pass, incremental checksums.

A sender keeps a *shadow* of the stream it last sent and the checksums of the shadow's
segments (each segment one copy: a tensor's box, back to back in the stream). For the
next version it must find the changed units, encode them, make the shadow equal to the
new bytes and know the new bytes' checksums. Done naively that is four passes over the
stream (compare, gather, refresh the shadow, checksum) plus random reads of the changed
places twice. :func:`encode_update` does one:

* the stream as 8-byte words, compared in chunks of 32,768 words (256 KiB a side, in
  the L2 cache), and in the same chunk the changed words are read from both sides and
  written into the shadow — while those cache lines are still there;
* the changed units, their values and the encoding come out of the changed words only;
* the checksum (:func:`policyworker.layout.delta.checksum`) is linear in the words:
  ``C(new) = C(old) + sum(w_j * (new_j - old_j)) mod 2**64`` over the changed words
  ``j`` of a segment, so the new checksums cost the changed words, not the stream.

The incremental checksums are the checksums of what the sender *sent* (its shadow
grown by exactly the encoded changes), computed without a pass over its bytes; the
receiver's own checksum pass over the bytes it holds then proves them equal to the
sender's. Many changes (``sparse=False``, or a layout the word pass cannot take) use
:func:`~policyworker.layout.delta.encode`, one copy into the shadow and a full checksum
pass: the same results.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from policyworker.errors import ProtocolError
from policyworker.layout import delta as _delta
from policyworker.layout.delta import RAW, Encoded, blob_bytes, weights_at

__all__ = ["INCREMENTAL_MAX", "apply_update", "encode_update", "segment_checksums", "word_deltas_sum"]

_CHUNK = 1 << 15  # words per step of the pass: both sides' chunks (2 x 256 KiB) stay in L2
_M64 = (1 << 64) - 1


def segment_checksums(data: torch.Tensor, segments: Sequence[tuple[int, int]]) -> list[int]:
    """:func:`~policyworker.layout.delta.checksum` (unsigned) of each ``(offset, bytes)`` segment of ``data``'s bytes.

    On CPU, with every segment on an 8-byte boundary: one matrix-vector product per
    segment's whole rows of 128 words, written side by side, then every segment's
    weighting and sum at once (the same value, without a dozen small operations and a
    weight table per segment).
    """
    raw = data.reshape(-1).view(torch.uint8)
    if raw.device.type != "cpu" or raw.data_ptr() % 8 or any(at % 8 for at, _ in segments):
        return _delta.checksums(raw, list(segments))  # one launch on CUDA
    lay = _layout(tuple(segments))
    x = raw.narrow(0, 0, raw.numel() // 8 * 8).view(torch.int64)
    w = torch.from_numpy(_ROW_W.view(np.int64))
    per_row = torch.empty(lay.total_rows, dtype=torch.int64)
    tails = torch.zeros((len(segments), _ROW), dtype=torch.int64)
    tails_u8 = tails.view(torch.uint8)
    for i, (at, n) in enumerate(segments):
        rows, start = n >> 10, lay.starts[i]
        if rows:
            torch.mv(x.narrow(0, at >> 3, rows * _ROW).view(rows, _ROW), w, out=per_row.narrow(0, start, rows))
        rest = n - (rows << 10)
        if rest:
            tails_u8[i, :rest] = raw.narrow(0, at + (rows << 10), rest)
    with np.errstate(over="ignore"):
        prod = per_row.numpy().view(np.uint64) * lay.row_weights
        csum = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(prod, dtype=np.uint64)])
        tail = torch.mv(tails, w).numpy().view(np.uint64) * lay.tail_weights
        total = csum[lay.ends] - csum[lay.begins] + tail + lay.lengths
    return [int(t) for t in total]


_ROW = 128  # words per row, as in :func:`policyworker.layout.delta.checksum`
_ROW_W = weights_at(np.arange(_ROW, dtype=np.uint64), 1)


class _Layout:
    """Per segment: where its rows' sums go, and the weights of its rows and tail."""

    def __init__(self, segments: tuple[tuple[int, int], ...]) -> None:
        rows = np.array([n >> 10 for _, n in segments], dtype=np.int64)
        self.starts = [0, *np.cumsum(rows)[:-1].tolist()] if len(segments) else []
        self.total_rows = int(rows.sum())
        self.begins = np.array(self.starts, dtype=np.int64)
        self.ends = self.begins + rows
        # each segment's rows weigh weights_at(r, 2) for its own r = 0, 1, ...
        local = np.arange(self.total_rows, dtype=np.int64) - np.repeat(self.begins, rows)
        self.row_weights = weights_at(local.astype(np.uint64), 2)
        self.tail_weights = weights_at(rows.astype(np.uint64), 2)
        self.lengths = np.array([n for _, n in segments], dtype=np.uint64)
        # every row of every segment, its tail row included, for word_deltas_sum
        self.word_starts = np.array([at >> 3 for at, _ in segments], dtype=np.int64)
        self.w2_begins = np.concatenate([[0], np.cumsum(rows + 1)[:-1]]).astype(np.int64)
        all_local = np.arange(int((rows + 1).sum()), dtype=np.int64) - np.repeat(self.w2_begins, rows + 1)
        self.w2_all = weights_at(all_local.astype(np.uint64), 2)


_LAYOUTS: dict[tuple[tuple[int, int], ...], _Layout] = {}


def _layout(segments: tuple[tuple[int, int], ...]) -> _Layout:
    lay = _LAYOUTS.get(segments)
    if lay is None:
        if len(_LAYOUTS) >= 64:  # a few streams per rank; a new plan replaces them
            _LAYOUTS.clear()
        lay = _LAYOUTS[segments] = _Layout(segments)
    return lay


def word_deltas_sum(segments: Sequence[tuple[int, int]], words: np.ndarray, delta: np.ndarray) -> dict[int, int]:
    """Per segment, ``sum(w_j * delta)`` mod 2**64 over the stream words ``words`` (ascending).

    ``delta`` (uint64) is how much each word changed as a little-endian integer, mod
    2**64; every segment must start on an 8-byte boundary of the stream (its words are
    then the stream's). Returns {segment index: increment} for the segments touched.
    """
    if words.size == 0:
        return {}
    lay = _layout(tuple(segments))
    # ``words`` is ascending: each segment's words are one run, found by a binary search
    # per segment (not one per word).
    cuts = np.searchsorted(words, lay.word_starts)
    ends = np.append(cuts[1:], words.size)
    counts = ends - cuts
    touched = np.flatnonzero(counts)
    with np.errstate(over="ignore"):
        j = words - np.repeat(lay.word_starts[touched], counts[touched])  # the word's index in its segment
        # weight of word j: the row weight of j % 128 times its row's weight (tables)
        row = (j >> 7) + np.repeat(lay.w2_begins[touched], counts[touched])
        contrib = _ROW_W.take(j & 127)
        contrib *= lay.w2_all.take(row)
        contrib *= delta
    sums = np.add.reduceat(contrib, cuts[touched])
    return {int(s): int(v) for s, v in zip(touched, sums)}


def _aligned(cur: torch.Tensor, shadow: torch.Tensor, segments: Sequence[tuple[int, int]]) -> bool:
    return (cur.device.type == "cpu" and shadow.device.type == "cpu" and cur.element_size() <= 8
            and cur.data_ptr() % 8 == 0 and shadow.data_ptr() % 8 == 0 and all(at % 8 == 0 for at, _ in segments)
            and sum(n for _, n in segments) == cur.numel() * cur.element_size())  # the copies tile the stream


def _changed_words(cur: np.ndarray, shadow: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(word index, old, new) of every 8-byte word that differs (the last one zero-padded);
    the shadow takes the new words as they are found."""
    raw_a, raw_b = cur.view(np.uint8), shadow.view(np.uint8)
    nwords = raw_a.size // 8
    aw, bw = raw_a[:nwords * 8].view(np.uint64), raw_b[:nwords * 8].view(np.uint64)
    buf = np.empty(min(_CHUNK, max(nwords, 1)), dtype=np.bool_)
    hits, olds, news = [], [], []
    for s in range(0, nwords, _CHUNK):
        a, b = aw[s:s + _CHUNK], bw[s:s + _CHUNK]
        h = np.flatnonzero(np.not_equal(a, b, out=buf[:a.size]))
        if h.size:
            # ``take`` is cheaper than fancy indexing; the chunk is in cache, so refreshing
            # it whole costs less than scattering the changed words into it
            olds.append(b.take(h))
            news.append(a.take(h))
            h += s
            hits.append(h)
            np.copyto(b, a)
    tail = raw_a.size - nwords * 8
    if tail and not np.array_equal(raw_a[nwords * 8:], raw_b[nwords * 8:]):
        pad = np.zeros((2, 8), dtype=np.uint8)
        pad[0, :tail], pad[1, :tail] = raw_b[nwords * 8:], raw_a[nwords * 8:]
        raw_b[nwords * 8:] = raw_a[nwords * 8:]
        hits.append(np.array([nwords], dtype=np.int64))
        olds.append(pad[0].view(np.uint64))
        news.append(pad[1].view(np.uint64))
    if not hits:
        empty = np.empty(0, dtype=np.uint64)
        return np.empty(0, dtype=np.int64), empty, empty
    return np.concatenate(hits), np.concatenate(olds), np.concatenate(news)


def encode_update(cur: torch.Tensor, shadow: torch.Tensor, segments: Sequence[tuple[int, int]],
                  sums: list[int] | None, *, sparse: bool = True) -> tuple[Encoded, list[int]]:
    """Encode ``cur`` against ``shadow`` (1-D unit tensors of one length), make ``shadow``
    equal to ``cur``, and return the encoding and the checksums of ``cur``'s segments.

    ``sums``: the shadow's segment checksums when known (then they are updated from the
    changed words), else None (a checksum pass over ``cur``). ``sparse``: few changes are
    expected (the one-pass path); False takes the dense path (see the module docstring).
    The encoding is :func:`~policyworker.layout.delta.encode`'s, byte for byte.
    """
    if not sparse or not _aligned(cur, shadow, segments):
        enc = _delta.encode(cur, shadow, update_old=True)  # on CUDA: the shadow refreshed in the kernels
        return enc, segment_checksums(cur, segments)
    a, b = cur.numpy(), shadow.numpy()
    words, old, new = _changed_words(a, b)
    n, unit = a.size, a.itemsize
    if sums is None:
        sums = segment_checksums(cur, segments)
    else:
        with np.errstate(over="ignore"):
            inc = word_deltas_sum(segments, words, new - old)
        sums = [(s + inc.get(i, 0)) & _M64 for i, s in enumerate(sums)]
    if words.size == 0:
        return Encoded(_delta.NONE, 0, torch.empty(0, dtype=torch.uint8)), sums
    shift = (8 // unit).bit_length() - 1  # log2 of the units per word
    lanes = np.flatnonzero((new ^ old).view(a.dtype) != 0)  # changed units among the changed words' lanes
    idx = (words.take(lanes >> shift) << shift) | (lanes & ((1 << shift) - 1))
    vals = new.view(a.dtype).take(lanes)
    k = idx.size
    kind = _delta._smallest(n, k, unit)
    out = np.zeros(blob_bytes(kind, n, k, unit), dtype=np.uint8)
    if kind == RAW:
        out[:n * unit] = a.view(np.uint8)
    else:
        _delta._fill_np(out, kind, n, unit, idx, vals)
    return Encoded(kind, k, torch.from_numpy(out)), sums


#: Above this fraction of changed units a receiver's incremental check is a full pass
#: instead: the changed units' old values are random reads (and so are their writes),
#: and at ~1% of 2-byte units they touch a quarter of the cache lines — past ~1.5% no
#: cheaper than the apply plus one sequential pass, which proves more (measured on one
#: CPU core, 29.4 MB, apply + check: 0.5% changed 2.1 ms against 6.8 ms; 1% 5.5–5.8
#: against 7.5–7.8; 1.5% 6.3 against 6.0; 2% 8.0 against 7.4).
INCREMENTAL_MAX = 1 / 80


def _decode_np(blob: np.ndarray, kind: int, n: int, count: int, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """(ascending unit indices, values) of a SPARSE or BITMAP blob, validated as
    :func:`~policyworker.layout.delta.apply` validates it (``ProtocolError``, nothing written)."""
    if kind == _delta.SPARSE:
        nblocks = -(-n // _delta._BLOCK)
        counts = blob[:4 * nblocks].view(np.int32)
        at = _delta._pad8(4 * nblocks)
        offsets = blob[at:at + 2 * count].view(np.uint16)
        at += _delta._pad8(2 * count)
        if (counts < 0).any() or int(counts.sum(dtype=np.int64)) != count:
            raise ProtocolError(f"delta: block counts do not add up to {count}")
        idx = (np.repeat(np.arange(nblocks, dtype=np.int64), counts) << _delta._BLOCK_BITS) | offsets
        if int(idx.max()) >= n:
            raise ProtocolError(f"delta: an index past the {n} units of the stream")
    elif kind == _delta.BITMAP:
        nbits = -(-n // 8)
        idx = np.flatnonzero(np.unpackbits(blob[:nbits], count=n))
        at = _delta._pad8(nbits)
        if idx.size != count:
            raise ProtocolError(f"delta: the bitmap does not mark {count} units")
    else:
        raise ProtocolError(f"unknown delta encoding {kind}")
    return idx, blob[at:at + count * unit].view(f"<u{unit}")


def apply_update(dst: torch.Tensor, kind: int, count: int, blob: torch.Tensor, segments: Sequence[tuple[int, int]],
                 sums: list[int] | None) -> tuple[list[int], bool]:
    """:func:`~policyworker.layout.delta.apply` ``blob`` to ``dst`` (a 1-D unit tensor) and
    return (the checksums of ``dst``'s segments after it, whether they were updated).

    ``sums``: the segments' checksums *before* the apply, when the caller knows them. On
    CPU, for a sparse or bitmap blob and segments on 8-byte boundaries, the new sums are
    ``sums`` plus the weighted differences of the changed units alone (each read once
    before it is overwritten): no pass over ``dst``. They are then the checksums of
    ``dst``'s bytes only if ``sums`` were those of its bytes just before the apply —
    what was checked earlier is taken on trust. An empty encoding returns ``sums``.
    Otherwise (no ``sums``, more than :data:`INCREMENTAL_MAX` of the units changed, a raw
    encoding, another device or layout) the delta is applied and every byte of ``dst``
    is checksummed: (sums, False).
    """
    n, unit = dst.numel(), dst.element_size()
    if kind == _delta.NONE and sums is not None:
        _delta.apply(dst, kind, count, blob)  # validates: nothing to write
        return list(sums), True
    if (sums is None or kind not in (_delta.SPARSE, _delta.BITMAP) or count > n * INCREMENTAL_MAX
            or not _aligned(dst, dst, segments)
            or count < 1 or count > n or blob.numel() != blob_bytes(kind, n, count, unit)):
        _delta.apply(dst, kind, count, blob)  # validates (ProtocolError before any write)
        return segment_checksums(dst, segments), False
    idx, new = _decode_np(blob.numpy(), kind, n, count, unit)
    held = dst.numpy().view(new.dtype)
    old = held.take(idx)
    held.put(idx, new)  # ``take``/``put``: cheaper than fancy indexing
    per = 8 // unit
    with np.errstate(over="ignore"):
        diff = new.astype(np.uint64) - old.astype(np.uint64)  # wraps mod 2**64: the word's change
        if per > 1:
            diff <<= (idx & (per - 1)).astype(np.uint64) * np.uint64(8 * unit)  # the unit's lane in its word
        inc = word_deltas_sum(segments, idx >> (per.bit_length() - 1), diff)
    return [(s + inc.get(i, 0)) & _M64 for i, s in enumerate(sums)], True
