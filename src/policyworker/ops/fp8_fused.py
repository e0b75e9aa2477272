"""One persistent launch for a whole fp8 refit: quantize tiles and copy tiles, one table.

Why: an fp8 refit is two kinds of traffic, the linear weights (quantized) and the
tensors that stay bf16 (embeddings, ``lm_head``, norms: plain copies). Issued as a
kernel plus a hundred-odd ``copy_`` calls, the copies cost a Python launch each and
either queue behind the kernel (which keeps every SM busy to its end) or delay its
launch. Here the copies are tiles of the same table: every program of
:func:`_fused_kernel` walks the table, and each tile is either *quantize* (a whole
``BLOCK x BLOCK`` bf16 tile into fp8 + one scale, the arithmetic of
:mod:`.fp8_persist`) or *copy* (a ``rows x 8*cols`` region of 16-bit words written
back unchanged: a copy is a copy, whatever the dtype), so big copies are cut into
tiles that all SMs share and one launch moves everything. Row strides are per tile
(read from the table) rather than compile-time constants, so one launch covers every
shape.

Table: int64 ``[ntiles, 7]`` = (source offset, destination offset, scale offset or
-1 for a copy, source row stride, destination row stride, rows, columns). Offsets and
strides are in 16-byte units from the launch's base pointers, columns in 16-byte units
of the source; multiplying them by the elements per 16 bytes tells the compiler
that every row is 16-byte aligned, so loads and stores move 16 bytes per access,
masked ones too (a column bound that is a multiple of 8 words keeps masks constant
over each vector).

Copies of at least ``torch_min_bytes`` (``PersistVariant.torch_min_mib``) are left to
the caller too: torch's copy moves a big contiguous run ~10% faster per byte than any
persistent launch here (``benchmarks/probe_fused_bw.py``), and one launch per such
copy costs a few µs of host. What a fused launch cannot express is returned to the
caller (``left``) to copy with torch as well: copies whose dtypes differ, whose
addresses, row strides or row lengths are not multiples of 16 bytes (a contiguous
run's last ``< 16`` bytes alone go back), views that do not fold into 2-D with unit
inner stride, strides past the int32 offsets of a tile. Quantize jobs that are not
bf16, not aligned or not made of whole tiles are left to
:class:`.fp8_persist.PersistProgram`'s other launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from policyworker.ops.fp8_tiles import _load_tile, _quant_store

__all__ = ["FusedLaunch", "copy_rows", "quant_rows"]

Pair = tuple[torch.Tensor, torch.Tensor]


@triton.jit
def _row(tiles_ptr, t):
    row = tiles_ptr + t * 7  # int32 is enough: < 2**31 / 7 tiles
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3).to(tl.int32),
            tl.load(row + 4).to(tl.int32), tl.load(row + 5).to(tl.int32), tl.load(row + 6).to(tl.int32))


@triton.jit
def _fetch(src_ptr, so, srs, rows, cols, rb, BLOCK: tl.constexpr, STREAM: tl.constexpr,
           MASK_ALL: tl.constexpr = False):
    """The tile's bf16 words, ``rows x 8*cols`` of them, zero-padded to BLOCK x BLOCK.
    ``MASK_ALL``: one masked load for every tile, no branch (a whole tile's mask is all
    true): the only kind of load Triton's software pipeliner stages."""
    ptrs = src_ptr + so * 8 + (rb[:, None] * (srs * 8) + rb[None, :])
    if not MASK_ALL and ((rows == BLOCK) & (cols * 8 == BLOCK)):  # whole: no mask
        x = _load_tile(ptrs, STREAM)
    else:
        x = tl.load(ptrs, mask=(rb[:, None] < rows) & (rb[None, :] < cols * 8), other=0.0)
    return x


@triton.jit
def _put(x, dst_ptr, cdst_ptr, sc_ptr, do, co, drs, rows, cols, rb, BLOCK: tl.constexpr,
         DST_ALIGN: tl.constexpr, FAST_DIV: tl.constexpr, STREAM: tl.constexpr, Q_F32: tl.constexpr):
    if co >= 0:  # quantize (whole tiles only: the table builder sends partial ones elsewhere)
        offs = rb[:, None] * (drs * DST_ALIGN) + rb[None, :]
        _quant_store(x, dst_ptr + do * DST_ALIGN + offs, sc_ptr + co, FAST_DIV, STREAM, Q_F32)
    else:  # copy: the bits as loaded (as int16: no float conversion can touch a NaN payload)
        ptrs = cdst_ptr + do * 8 + (rb[:, None] * (drs * 8) + rb[None, :])
        xi = x.to(tl.int16, bitcast=True)
        if (rows == BLOCK) & (cols * 8 == BLOCK):
            if STREAM:
                tl.store(ptrs, xi, cache_modifier=".cs")
            else:
                tl.store(ptrs, xi)
        else:
            tl.store(ptrs, xi, mask=(rb[:, None] < rows) & (rb[None, :] < cols * 8))


@triton.jit
def _fused_kernel(tiles_ptr, ntiles, src_ptr, dst_ptr, cdst_ptr, sc_ptr, BLOCK: tl.constexpr,
                  DST_ALIGN: tl.constexpr, FAST_DIV: tl.constexpr, STREAM: tl.constexpr, STAGES: tl.constexpr,
                  PREFETCH: tl.constexpr, Q_F32: tl.constexpr):
    # src_ptr: bf16 (8 per 16 bytes); dst_ptr: fp8 (or float32 with Q_F32), DST_ALIGN per
    # 16 bytes; cdst_ptr: int16, the copies' destination base; sc_ptr: float32 scales.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rb = tl.arange(0, BLOCK)
    if PREFETCH:
        # Register double buffer, as fp8_persist: tile t + nprog is requested before tile
        # t is reduced or stored; the last request repeats a valid tile and is dropped.
        so, do, co, srs, drs, rows, cols = _row(tiles_ptr, pid)
        x = _fetch(src_ptr, so, srs, rows, cols, rb, BLOCK, STREAM)
        for t in range(pid, ntiles, nprog):
            tn = tl.minimum(t + nprog, ntiles - 1)
            so_n, do_n, co_n, srs_n, drs_n, rows_n, cols_n = _row(tiles_ptr, tn)
            x_n = _fetch(src_ptr, so_n, srs_n, rows_n, cols_n, rb, BLOCK, STREAM)
            _put(x, dst_ptr, cdst_ptr, sc_ptr, do, co, drs, rows, cols, rb, BLOCK, DST_ALIGN, FAST_DIV, STREAM,
                 Q_F32)
            x, do, co, drs, rows, cols = x_n, do_n, co_n, drs_n, rows_n, cols_n
    else:
        # Triton's software pipeliner stages a loop's loads through shared memory
        # (cp.async, STAGES - 1 tiles in flight per program, no registers held), but only
        # a load outside any branch: MASK_ALL.
        for t in tl.range(pid, ntiles, nprog, num_stages=STAGES):
            so, do, co, srs, drs, rows, cols = _row(tiles_ptr, t)
            x = _fetch(src_ptr, so, srs, rows, cols, rb, BLOCK, STREAM, True)
            _put(x, dst_ptr, cdst_ptr, sc_ptr, do, co, drs, rows, cols, rb, BLOCK, DST_ALIGN, FAST_DIV, STREAM,
                 Q_F32)


@triton.jit
def _fused_tile_kernel(tiles_ptr, src_ptr, dst_ptr, cdst_ptr, sc_ptr, BLOCK: tl.constexpr, DST_ALIGN: tl.constexpr,
                       FAST_DIV: tl.constexpr, STREAM: tl.constexpr, Q_F32: tl.constexpr):
    # One tile per program, no loop (``PersistVariant(grid=0)``): the hardware starts the
    # next program as one ends, so many tiles' loads are in flight per SM with no
    # software pipeline. Same table and arithmetic as _fused_kernel.
    rb = tl.arange(0, BLOCK)
    so, do, co, srs, drs, rows, cols = _row(tiles_ptr, tl.program_id(0))
    x = _fetch(src_ptr, so, srs, rows, cols, rb, BLOCK, STREAM)
    _put(x, dst_ptr, cdst_ptr, sc_ptr, do, co, drs, rows, cols, rb, BLOCK, DST_ALIGN, FAST_DIV, STREAM, Q_F32)


def _fits(units: int, per16: int, block: int) -> bool:
    """A row stride of ``units`` 16-byte units keeps a tile's int32 element offsets."""
    return (units * per16 + 1) * block < 2**31


def _fold_2d(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Shape and strides of ``t`` with size-1 dims dropped and mergeable dims merged."""
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    out: list[list[int]] = []
    for n, s in reversed(dims):
        if out and s == out[-1][0] * out[-1][1]:
            out[-1][0] *= n  # this dim steps over the whole inner one: one dim
        else:
            out.append([n, s])
    out.reverse()
    return [n for n, _ in out], [s for _, s in out]


def _words_2d(src: torch.Tensor, dst: torch.Tensor):
    """(rows, row bytes, src row stride bytes, dst row stride bytes) of a same-shape
    copy seen as rows of contiguous bytes, or None when it is not such."""
    if src.dtype != dst.dtype or src.shape != dst.shape:
        return None
    e = src.element_size()
    if src.is_contiguous() and dst.is_contiguous():
        return 1, src.numel() * e, 0, 0
    (sn, ss), (dn, ds) = _fold_2d(src), _fold_2d(dst)
    if sn != dn or len(sn) > 2 or not sn or ss[-1] != 1 or ds[-1] != 1:
        return None
    if len(sn) == 1:
        return 1, sn[0] * e, 0, 0
    return sn[0], sn[1] * e, ss[0] * e, ds[0] * e


def _split(src: torch.Tensor, dst: torch.Tensor, at: int) -> tuple[Pair, Pair]:
    """Bytes ``:at`` and ``at:`` of a contiguous pair, as uint8 views."""
    a, b = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
    return (a[:at], b[:at]), (a[at:], b[at:])


def copy_rows(src: torch.Tensor, dst: torch.Tensor, block: int, src_base: int, dst_base: int):
    """Table rows for copying ``src`` into ``dst`` (same shape and dtype), offsets from the
    16-byte aligned byte addresses ``src_base`` / ``dst_base``: ``(rows, body, left)``,
    ``rows`` int64 ``[m, 7]`` (None when the launch cannot take the copy), ``body`` the
    ``(src, dst)`` views those rows copy (None: none) and ``left`` what torch must still
    copy (the whole pair, the last ``< 16`` bytes of a contiguous run, or nothing)."""
    geo = _words_2d(src, dst)
    nbytes = src.numel() * src.element_size()
    if geo is None or nbytes == 0 or src.data_ptr() % 16 or dst.data_ptr() % 16:
        return None, None, [(src, dst)] if nbytes else []
    r, row_bytes, srs_b, drs_b = geo
    unit_cols = block // 8  # 16-byte units in one tile row (BLOCK bf16 words)
    left: list[Pair] = []
    s16, d16 = (src.data_ptr() - src_base) // 16, (dst.data_ptr() - dst_base) // 16
    if r == 1:  # a contiguous run: rows of BLOCK words, the last row shorter
        units, rest = divmod(row_bytes, 16)
        body: Pair | None = (src, dst)
        if rest:
            body, tail = _split(src, dst, units * 16)
            left.append(tail)
        if units == 0:
            return None, None, left
        nrow, last = divmod(units, unit_cols)
        rows = []
        if nrow:
            first = torch.arange(0, nrow, block, dtype=torch.int64)
            n = (nrow - first).clamp(max=block)
            off = first * unit_cols
            rows.append(torch.stack([s16 + off, d16 + off, torch.full_like(off, -1), torch.full_like(off, unit_cols),
                                     torch.full_like(off, unit_cols), n, torch.full_like(off, unit_cols)], 1))
        if last:
            off = nrow * unit_cols
            rows.append(torch.tensor([[s16 + off, d16 + off, -1, unit_cols, unit_cols, 1, last]], dtype=torch.int64))
        return torch.cat(rows), body, left
    if row_bytes % 16 or srs_b % 16 or drs_b % 16:
        return None, None, [(src, dst)]
    cu, srs, drs = row_bytes // 16, srs_b // 16, drs_b // 16
    if not (_fits(srs, 8, block) and _fits(drs, 8, block)):
        return None, None, [(src, dst)]
    bi, bj = torch.meshgrid(torch.arange(-(-r // block)), torch.arange(-(-cu // unit_cols)), indexing="ij")
    bi, bj = bi.reshape(-1), bj.reshape(-1)
    rows_n = (r - bi * block).clamp(max=block)
    cols_n = (cu - bj * unit_cols).clamp(max=unit_cols)
    t = torch.stack([s16 + bi * block * srs + bj * unit_cols, d16 + bi * block * drs + bj * unit_cols,
                     torch.full_like(bi, -1), torch.full_like(bi, srs), torch.full_like(bi, drs), rows_n, cols_n], 1)
    return t, (src, dst), left


def quant_rows(src: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int, bases: tuple[int, int, int]):
    """Table rows for job ``(src, q, s)``'s whole tiles, or None when the fused launch
    cannot take them (not bf16, unaligned views, a stride past int32 tile offsets);
    also the mask of the job's tiles (block-row major) that the rows cover."""
    n, k = src.shape
    per16 = 16 // q.element_size()
    if src.dtype != torch.bfloat16 or not all(v % 16 == 0 for v in (src.data_ptr(), 2 * src.stride(0),
                                                                       q.data_ptr(), q.element_size() * q.stride(0))):
        return None, None
    srs, drs = 2 * src.stride(0) // 16, q.element_size() * q.stride(0) // 16
    if not (_fits(srs, 8, block) and _fits(drs, per16, block)):
        return None, None
    bi, bj = torch.meshgrid(torch.arange(-(-n // block)), torch.arange(-(-k // block)), indexing="ij")
    bi, bj = bi.reshape(-1), bj.reshape(-1)
    whole = ((n - bi * block) >= block) & ((k - bj * block) >= block)
    bi, bj = bi[whole], bj[whole]
    so = (src.data_ptr() - bases[0]) // 16 + bi * block * srs + bj * (block // 8)
    do = (q.data_ptr() - bases[1]) // 16 + bi * block * drs + bj * (block // per16)
    co = (s.data_ptr() - bases[2]) // 4 + bi * s.stride(0) + bj
    full = lambda v: torch.full_like(bi, v)  # noqa: E731
    return torch.stack([so, do, co, full(srs), full(drs), full(block), full(block // 8)], 1), whole


@dataclass(frozen=True, slots=True)
class FusedLaunch:
    """A built table and its base tensors; `launch` issues the one kernel."""

    tiles: torch.Tensor  # int64 [ntiles, 7] on the device
    ntiles: int
    src0: torch.Tensor  # bf16, data_ptr = the source base
    q0: torch.Tensor  # fp8 (or float32), data_ptr = the quantized base
    c0: torch.Tensor  # int16, data_ptr = the copies' destination base
    s0: torch.Tensor  # float32, data_ptr = the scale base (the lowest scale address: offsets >= 0)
    copy_bytes: int
    copy_tiles: int
    taken: tuple[Pair, ...]  # the (src, dst) views the copy tiles cover (torch copies them in a grouped layout)

    def launch(self, variant, sms: int, block: int) -> None:
        q_f32 = self.q0.dtype == torch.float32
        extra = {"maxnreg": variant.maxnreg} if variant.maxnreg and self.tiles.device.type == "cuda" else {}
        if variant.grid == 0:  # one tile per program
            _fused_tile_kernel[(self.ntiles,)](self.tiles, self.src0, self.q0, self.c0, self.s0, BLOCK=block,
                                               DST_ALIGN=16 // self.q0.element_size(), FAST_DIV=variant.fast_div,
                                               STREAM=variant.stream, Q_F32=q_f32, num_warps=variant.num_warps,
                                               num_stages=1, **extra)
            return
        grid = (max(1, min(self.ntiles, variant.grid * sms)),)
        _fused_kernel[grid](self.tiles, self.ntiles, self.src0, self.q0, self.c0, self.s0, BLOCK=block,
                            DST_ALIGN=16 // self.q0.element_size(), FAST_DIV=variant.fast_div, STREAM=variant.stream,
                            STAGES=variant.stages, PREFETCH=variant.prefetch, Q_F32=q_f32,
                            num_warps=variant.num_warps, num_stages=variant.stages, **extra)


def _at(t: torch.Tensor, dtype: torch.dtype, addr: int) -> torch.Tensor:
    """A one-element ``dtype`` view of ``t``'s storage at byte address ``addr`` (a base pointer)."""
    st = t.untyped_storage()
    off = addr - st.data_ptr()
    item = torch.empty((), dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=t.device).set_(st, off // item, (1,))


def build(jobs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], copies: Sequence[Pair], block: int,
          device: torch.device, torch_min_bytes: int = 0):
    """``(launch or None, covered, left)``: the fused launch over ``jobs``' whole tiles
    and ``copies``; ``covered[i]`` the mask of job ``i``'s tiles it quantizes (None: none);
    ``left`` the copies (or parts) torch must still do: also, with ``torch_min_bytes``,
    every contiguous copy at least that big (torch copies those at full rate)."""
    def big(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (torch_min_bytes > 0 and a.numel() * a.element_size() >= torch_min_bytes and a.is_contiguous()
                and b.is_contiguous())

    if any(big(a, b) for a, b in copies):
        launch, covered, left = build(jobs, [p for p in copies if not big(*p)], block, device)
        return launch, covered, [p for p in copies if big(*p)] + left
    if block % 8:
        return None, [None] * len(jobs), list(copies)
    live = [j for j in jobs if j[0].numel()]
    bf16 = [j for j in live if j[0].dtype == torch.bfloat16]
    # every base 16-byte aligned, as the offsets in 16-byte units from it must be exact
    qbase = next((j[1] for j in bf16 if j[1].data_ptr() % 16 == 0), None)
    sbase = min((j[2] for j in bf16), key=lambda s: s.data_ptr()) if bf16 else None
    cand = [(a, b) for a, b in copies if a.numel() and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0]
    srcs = [j[0] for j in bf16 if j[0].data_ptr() % 16 == 0] + [a for a, _ in cand]
    if not srcs:
        return None, [None] * len(jobs), list(copies)
    src_base = srcs[0].data_ptr()
    dst_copy = cand[0][1] if cand else None
    bases = (src_base, qbase.data_ptr() if qbase is not None else 0, sbase.data_ptr() if sbase is not None else 0)
    rows, covered, left, taken = [], [], [], []
    for src, q, s in jobs:
        r, mask = (None, None) if qbase is None or src.numel() == 0 or q.dtype != qbase.dtype else \
            quant_rows(src, q, s, block, bases)
        covered.append(mask)
        if r is not None and r.shape[0]:
            rows.append(r)
    nquant = sum(r.shape[0] for r in rows)
    for src, dst in copies:
        r, body, rest = copy_rows(src, dst, block, src_base, dst_copy.data_ptr() if dst_copy is not None else 0)
        left += rest
        if r is not None and r.shape[0]:
            rows.append(r)
            taken.append(body)
    if not rows:
        return None, [None] * len(jobs), list(copies)
    table = torch.cat(rows)
    # Walk the source in address order: tiles next in the table are next in memory.
    table = table[torch.argsort(table[:, 0], stable=True)].contiguous()
    q0 = qbase if qbase is not None else torch.empty(16, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    s0 = sbase if sbase is not None else torch.empty(1, dtype=torch.float32, device=device)
    c0 = _at(dst_copy, torch.int16, dst_copy.data_ptr()) if dst_copy is not None else \
        torch.empty(8, dtype=torch.int16, device=device)
    src0 = _at(srcs[0], torch.bfloat16, src_base)
    copy_bytes = sum(a.numel() * a.element_size() for a, _ in taken)
    launch = FusedLaunch(table.to(device), table.shape[0], src0, q0, c0, s0, copy_bytes, table.shape[0] - nquant,
                         tuple(taken))
    return launch, covered, left
