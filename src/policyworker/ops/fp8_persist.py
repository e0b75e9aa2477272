"""Block-FP8 quantization on CUDA, persistent: a fixed grid loops over a tile table.

Why: one program per 128x128 tile (``fp8_triton``) loads its 32 KB, then reduces,
divides and stores with no load of its own in flight; at 2 programs per SM the
memory system idles during every reduction. Here ``grid`` programs (a few per SM)
walk the tile table; the next tile's bytes are requested before the current one is
reduced, either by Triton's software pipeliner (``tl.range(num_stages=...)``) or by
an explicit register double buffer (``prefetch``). Full, 16-byte-aligned tiles go
through this unmasked path with their row strides as compile-time constants (one
launch per distinct pair of strides, a handful per model: the *grouped* layout) or,
by default (``PersistVariant.fused``), through one launch whose strides are read per
tile and which also makes the refit's plain copies (:mod:`.fp8_fused`); partial tiles
(N or K not a multiple of 128) and unaligned views go through a small masked launch,
one tile per program.

Arithmetic: that of :func:`policyworker.layout.formats.block_fp8_pack.quantize_reference`:
``amax = max |x|`` with NaN propagating (a block holding a NaN gets ``s = 1``, as
the oracle's ``amax > 0`` test gives), ``s = amax / 448`` (IEEE division),
``s = 1`` unless ``amax > 0``, then ``RN_e4m3(RN_f32(x / s))``. ``x / s`` is either
the IEEE division per element (``div_rn``) or, for a normal finite ``s``, one
reciprocal per tile and two exact-remainder corrections per element (``fast_div``),
written with the negated remainder ``q*s - x`` so that a zero keeps its sign with
no extra select. The clamp to ±448 of the oracle changes nothing after rounding
(``|x / s| <= 448 (1 + 2**-23)``, and e4m3's conversion rounds that to 448) and is
left to the conversion. ``Q_F32`` stores ``RN_f32(x / s)`` as float32 instead of
fp8: Triton's CPU interpreter converts to fp8 with its own (not correctly rounded)
routine, so CPU tests check the arithmetic there and convert with torch; on the GPU
the conversion is the hardware's ``cvt.rn.satfinite``, checked by the GPU tests.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from policyworker.ops.fp8_fused import build
from policyworker.ops.fp8_tiles import _load_tile, _quant, _quant_store

__all__ = ["PersistProgram", "PersistVariant"]


@triton.jit
def _persist_kernel(tiles_ptr, ntiles, src_ptr, dst_ptr, sc_ptr, BLOCK: tl.constexpr, SRC_RS: tl.constexpr,
                    DST_RS: tl.constexpr, SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr,
                    FAST_DIV: tl.constexpr, STREAM: tl.constexpr, STAGES: tl.constexpr,
                    PREFETCH: tl.constexpr, Q_F32: tl.constexpr):
    # tiles: int64 [ntiles, 3] = (source offset / SRC_ALIGN, destination offset /
    # DST_ALIGN, scale offset), offsets in elements from the three base pointers; the
    # multiplication tells the compiler every row is 16-byte aligned (a multiple_of hint
    # on the loaded value is lost when the pipeliner moves that load); strides are
    # constants of this launch.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rb = tl.arange(0, BLOCK)
    offs_s = rb[:, None] * SRC_RS + rb[None, :]
    offs_d = rb[:, None] * DST_RS + rb[None, :]
    if PREFETCH:
        # Register double buffer: tile t + nprog is requested before tile t is reduced.
        # The last request of each program repeats a valid tile (clamped index) rather
        # than branching; it is loaded and dropped.
        row = tiles_ptr + pid.to(tl.int64) * 3
        so = tl.load(row) * SRC_ALIGN
        do = tl.load(row + 1) * DST_ALIGN
        co = tl.load(row + 2)
        x = _load_tile(src_ptr + so + offs_s, STREAM)
        for t in range(pid, ntiles, nprog):
            tn = tl.minimum(t + nprog, ntiles - 1)
            row = tiles_ptr + tn.to(tl.int64) * 3
            so_n = tl.load(row) * SRC_ALIGN
            do_n = tl.load(row + 1) * DST_ALIGN
            co_n = tl.load(row + 2)
            x_n = _load_tile(src_ptr + so_n + offs_s, STREAM)
            _quant_store(x, dst_ptr + do + offs_d, sc_ptr + co, FAST_DIV, STREAM, Q_F32)
            x, do, co = x_n, do_n, co_n
    else:
        for t in tl.range(pid, ntiles, nprog, num_stages=STAGES):
            row = tiles_ptr + t * 3  # int32 is enough: < 2**31 / 3 tiles
            so = tl.load(row) * SRC_ALIGN
            do = tl.load(row + 1) * DST_ALIGN
            co = tl.load(row + 2)
            x = _load_tile(src_ptr + so + offs_s, STREAM)
            _quant_store(x, dst_ptr + do + offs_d, sc_ptr + co, FAST_DIV, STREAM, Q_F32)


@triton.jit
def _edge_kernel(tiles_ptr, src_ptr, dst_ptr, sc_ptr, BLOCK: tl.constexpr, FAST_DIV: tl.constexpr,
                 Q_F32: tl.constexpr):
    # tiles: int64 [n, 7] = (source offset, source row stride, destination offset,
    # destination row stride, scale offset, rows, columns); one masked tile per program.
    row = tiles_ptr + tl.program_id(0).to(tl.int64) * 7
    so = tl.load(row)
    srs = tl.load(row + 1)
    do = tl.load(row + 2)
    drs = tl.load(row + 3)
    co = tl.load(row + 4)
    n = tl.load(row + 5)
    k = tl.load(row + 6)
    rb = tl.arange(0, BLOCK)
    mask = (rb[:, None] < n) & (rb[None, :] < k)
    x = tl.load(src_ptr + so + rb[:, None].to(tl.int64) * srs + rb[None, :], mask=mask, other=0.0)
    y, s = _quant(x, FAST_DIV)  # the zero padding leaves amax as it is
    if Q_F32:
        tl.store(dst_ptr + do + rb[:, None].to(tl.int64) * drs + rb[None, :], y, mask=mask)
    else:
        tl.store(dst_ptr + do + rb[:, None].to(tl.int64) * drs + rb[None, :], y.to(tl.float8e4nv), mask=mask)
    tl.store(sc_ptr + co, s)


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistVariant:
    """Launch settings of the persistent kernel (``benchmarks/bench_fp8_kernel.py``
    sweeps them). ``grid``: programs per SM (0: the fused launch runs one tile per
    program, no persistent loop); ``stages``: ``tl.range`` pipelining depth
    (1 = none); ``prefetch``: the register double buffer instead of the pipeliner;
    ``fused``: bf16 jobs and the program's copies in one launch whose row strides are
    read per tile (:mod:`.fp8_fused`), instead of one launch per pair of constant
    strides (copies then go through torch); ``maxnreg``: registers per thread the fused
    launch may use (0: the compiler's choice); ``graph``: from a program's second launch
    on CUDA, its launches are one captured CUDA graph, replayed (Triton's host-side launch
    of the fused kernel costs ~0.25 ms, a replay a few µs; the tables and base pointers
    a program launches with never change); ``torch_min_mib``: contiguous copies of at
    least that many MiB are left to the caller (``copies_left``: torch's copy runs at
    the memory's full rate, ~10% above a copy tile's; a launch costs ~5 µs of host,
    less than that 10% of a copy this big), smaller ones ride in the launch (0: all).
    With per-tile strides ptxas gives the 8-warp prefetch loop ~195 registers, one
    program per SM; capped at 128 it has no spills (sm_90a, Triton 3.6 and 3.9) and
    two fit, as the grouped kernel's do."""

    num_warps: int = 8
    stages: int = 1
    prefetch: bool = True
    grid: int = 2  # programs per SM: the fused launch fits two (128 registers); more only queue
    fast_div: bool = True
    stream: bool = False
    fused: bool = True
    maxnreg: int = 128
    graph: bool = True
    torch_min_mib: int = 64

    def name(self) -> str:
        return (f"kernel=persist,warps={self.num_warps},stages={self.stages},prefetch={int(self.prefetch)},"
                f"grid={self.grid},fast_div={int(self.fast_div)},stream={int(self.stream)},fused={int(self.fused)},"
                f"maxnreg={self.maxnreg},graph={int(self.graph)},torch_min_mib={self.torch_min_mib}")


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so that each loops over several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


Job = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class PersistProgram:
    """A fixed set of ``(src, q, s)`` jobs (as :class:`fp8_triton.QuantProgram`) and
    ``copies`` (``(src, dst)`` pairs, same shape and dtype), tile tables built once per
    layout (fused or grouped, on first use); `launch` issues them on the current stream.

    The copies the fused table cannot express (:mod:`.fp8_fused`) are `copies_left`,
    for the caller to copy; with a variant that is not ``fused`` the copies the table
    would take are issued with torch in `launch`, so a program moves the same bytes
    whatever its variant. ``q`` may be float32 instead of fp8 (``Q_F32``, for
    interpreter tests: the quotient before the conversion)."""

    def __init__(self, jobs: Sequence[Job], block: int = 128, variant: PersistVariant | None = None,
                 copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        self.block = block
        self._variant = variant or PersistVariant()
        self._graph: torch.cuda.CUDAGraph | None = None
        self._warm = False
        self._keep = list(jobs)
        self._copies = list(copies)
        self.device = next((src.device for src, _, _ in self._keep if src.numel()), None)
        if self.device is None and self._copies:
            self.device = self._copies[0][0].device
        self._sms = _sm_count(self.device) if self.device is not None else 1
        self._layouts: dict[bool, tuple] = {}
        # The fused table decides which copies it takes, also for the grouped layout.
        self._fused, self._covered, self.copies_left = build(self._keep, self._copies, block, self.device,
                                                             torch_min_bytes=self._variant.torch_min_mib << 20)
        self.copy_bytes = self._fused.copy_bytes if self._fused is not None else 0

    @property
    def variant(self) -> PersistVariant:
        return self._variant

    @variant.setter
    def variant(self, v: PersistVariant) -> None:
        """Launch with ``v`` from now on; a captured graph (of the old variant's launches)
        is dropped. Which copies the launch takes stays as built."""
        if v != self._variant:
            self._graph, self._warm = None, False
        self._variant = v

    def _layout(self, fused: bool) -> tuple:
        """(fused launch or None, grouped launches, edge launches) of this layout."""
        got = self._layouts.get(fused)
        if got is None:
            if fused and self._fused is not None:
                got = (self._fused, *_grouped(self._keep, self._covered, self.block, self.device))
            else:
                got = (None, *_grouped(self._keep, [None] * len(self._keep), self.block, self.device))
            self._layouts[fused] = got
        return got

    @property
    def tables(self) -> list[torch.Tensor]:
        """The device tables of the layouts built so far (kept alive by the caller's stream)."""
        out = []
        for fused, groups, edges in self._layouts.values():
            out += ([fused.tiles] if fused is not None else []) + [g[0] for g in groups] + [e[0] for e in edges]
        return out

    @property
    def launches(self) -> int:
        fused, groups, edges = self._layout(self.variant.fused)
        return (fused is not None) + len(groups) + len(edges)

    def launch(self) -> None:
        """Issue every launch on the current stream (a replay of their CUDA graph once warm)."""
        if self._graph is not None:
            self._graph.replay()
            return
        if self._warm and self._graphable():
            graph = torch.cuda.CUDAGraph()
            try:
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._issue()
                finally:
                    graph.capture_end()
            except RuntimeError:
                self._variant = dataclasses.replace(self._variant, graph=False)  # not capturable here: launch
            else:
                self._graph = graph
                graph.replay()  # the capture ran nothing: this is the launch
                return
        self._issue()
        self._warm = True  # compiled (and run once): a capture records launches, not compiles

    @property
    def graphed(self) -> bool:
        """True once the launches replay a captured CUDA graph."""
        return self._graph is not None

    def _graphable(self) -> bool:
        dev = self.device
        return (self.variant.graph and dev is not None and dev.type == "cuda"
                and os.environ.get("TRITON_INTERPRET") != "1"
                and torch.cuda.current_stream(dev) != torch.cuda.default_stream(dev))  # capture: not stream 0

    def _issue(self) -> None:
        v = self.variant
        fused, groups, edges = self._layout(v.fused)
        if fused is not None:
            fused.launch(v, self._sms, self.block)
        else:
            for a, b in self._fused.taken if self._fused is not None else ():
                b.copy_(a, non_blocking=True)
        for tiles, ntiles, (src0, q0, s0), srs, drs, sa, da in groups:
            grid = (max(1, min(ntiles, (v.grid or 2) * self._sms)),)  # grid=0 is the fused launch's
            q_f32 = q0.dtype == torch.float32
            _persist_kernel[grid](tiles, ntiles, src0, q0, s0, BLOCK=self.block, SRC_RS=srs, DST_RS=drs,
                                  SRC_ALIGN=sa, DST_ALIGN=da, FAST_DIV=v.fast_div, STREAM=v.stream,
                                  STAGES=v.stages, PREFETCH=v.prefetch, Q_F32=q_f32, num_warps=v.num_warps,
                                  num_stages=v.stages)  # prefetch: stages=1, no second pipeline
        for tiles, ntiles, (src0, q0, s0) in edges:
            _edge_kernel[(ntiles,)](tiles, src0, q0, s0, BLOCK=self.block, FAST_DIV=v.fast_div,
                                    Q_F32=q0.dtype == torch.float32, num_warps=8)


def _grouped(jobs: Sequence[Job], covered: Sequence, block: int, device) -> tuple[list, list]:
    """Launches for the tiles ``covered`` leaves out (None: all of a job's): one per
    (dtypes, strides) of whole 16-byte-aligned tiles, one masked launch per dtypes."""
    groups: list[tuple] = []  # (tiles, ntiles, (src0, q0, s0), src_rs, dst_rs, src_align, dst_align)
    edges: list[tuple] = []  # (tiles, ntiles, (src0, q0, s0))
    full: dict[tuple, list] = {}  # (dtypes, strides) -> [(job, int64 [m, 3] byte addresses)]
    edge: dict[tuple, list] = {}  # dtypes -> [(job, int64 [m, 7])]
    b = block
    for (src, q, s), done in zip(jobs, covered):
        if src.numel() == 0:
            continue
        n, k = src.shape
        es, ed = src.element_size(), q.element_size()
        aligned = all(v % 16 == 0 for v in (src.data_ptr(), src.stride(0) * es, q.data_ptr(), q.stride(0) * ed))
        bi, bj = torch.meshgrid(torch.arange(-(-n // b)), torch.arange(-(-k // b)), indexing="ij")
        bi, bj = bi.reshape(-1), bj.reshape(-1)
        rows, cols = (n - bi * b).clamp(max=b), (k - bj * b).clamp(max=b)
        so = src.data_ptr() + es * (bi * b * src.stride(0) + bj * b)
        do = q.data_ptr() + ed * (bi * b * q.stride(0) + bj * b)
        co = s.data_ptr() + 4 * (bi * s.stride(0) + bj)
        todo = ~done if done is not None else torch.ones_like(rows, dtype=torch.bool)
        whole = (rows == b) & (cols == b) if aligned else torch.zeros_like(rows, dtype=torch.bool)
        whole &= todo
        if bool(whole.any()):
            key = (src.dtype, q.dtype, src.stride(0), q.stride(0))
            full.setdefault(key, []).append(((src, q, s), torch.stack([so, do, co], 1)[whole]))
        part = todo & ~whole
        if bool(part.any()):
            t = torch.stack([so, torch.full_like(so, src.stride(0)), do, torch.full_like(so, q.stride(0)), co,
                             rows, cols], 1)[part]
            edge.setdefault((src.dtype, q.dtype), []).append(((src, q, s), t))
    for (_, _, srs, drs), items in full.items():
        base = items[0][0]
        es, ed = base[0].element_size(), base[1].element_size()
        t = torch.cat([x for _, x in items])
        # offsets in 16-byte units for the two tiles, in float32 elements for the scale
        t = (t - torch.tensor([base[0].data_ptr(), base[1].data_ptr(), base[2].data_ptr()])) // torch.tensor(
            [16, 16, 4])
        groups.append((t.contiguous().to(device), t.shape[0], base, srs, drs, 16 // es, 16 // ed))
    for _, items in edge.items():
        base = items[0][0]
        es, ed = base[0].element_size(), base[1].element_size()
        t = torch.cat([x for _, x in items])
        t[:, 0] = (t[:, 0] - base[0].data_ptr()) // es
        t[:, 2] = (t[:, 2] - base[1].data_ptr()) // ed
        t[:, 4] = (t[:, 4] - base[2].data_ptr()) // 4
        edges.append((t.contiguous().to(device), t.shape[0], base))
    return groups, edges
