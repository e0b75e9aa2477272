"""Block-FP8 quantization on CUDA: one Triton kernel, one read of the source.

Each program quantizes one ``block x block`` tile of one *job* (a 2-D source view,
its fp8 destination view, its float32 scale view): it loads the tile once (bf16
or float32), takes ``amax``, and writes the tile's fp8 values and its one scale.
All jobs of a refit go in one launch (two when some views are not 16-byte aligned):
a job table (offsets, row strides, sizes) and a tile table (job, block row, block
column) built once per program and kept (:class:`QuantProgram`), so a refit of
hundreds of tensors costs one launch, not hundreds. The arithmetic is that of
:func:`policyworker.layout.formats.block_fp8_pack.quantize_reference`, bit for bit:
IEEE division (``div_rn``, not Triton's default approximate fp32 division), ``s = 1``
for an all-zero block, clamp to ±448, then round-to-nearest-even to e4m3. Not covered: blocks whose float32 scale would be
subnormal (``amax < 448 * 2**-126``, about 5e-36), where Triton's libdevice division
may flush to zero; no weight block is that small, and the GPU test does not go there.

``configure(kernel="persist")`` (or ``configure_from_string`` with a name printed by
``benchmarks/bench_fp8_kernel.py``) makes programs launch :mod:`.fp8_persist`'s
persistent kernel over the same jobs instead; both take a block with a NaN to
``s = 1`` and keep the sign of zeros, as the oracle does (:mod:`.fp8_check`).

Launches go on a side stream per device (after it waits for the current stream,
and the current stream then waits for it), so the quantization overlaps other
copies of the refit while everything issued later on the current stream still
sees its results.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from policyworker.errors import ConfigError
from policyworker.ops.fp8_persist import PersistProgram, PersistVariant
from policyworker.ops.fp8_tiles import _abs_max, _div_scale

__all__ = ["QuantProgram", "configure", "configure_from_string", "quantize_jobs"]

# Job table columns (int64): source offset and row stride (elements of the source
# dtype, from the launch's source base), fp8 offset and row stride (bytes, from the
# fp8 base), scale offset and row stride (float32 elements, from the scale base),
# rows, columns. Offsets from one base pointer per kind (they may be negative) keep
# real pointer arguments, whose 16-byte alignment Triton knows; with ``ALIGNED`` the
# offsets and strides are promised to keep every row 16-byte aligned too, so each
# thread loads and stores 16 bytes at a time.


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fp8_block_kernel(tiles_ptr, jobs_ptr, src_ptr, dst_ptr, sc_ptr, BLOCK: tl.constexpr,
                      SRC_BF16: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr,
                      NARROW_AMAX: tl.constexpr, STREAM: tl.constexpr, FAST_DIV: tl.constexpr,
                      Q_F32: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    job = tl.load(tiles_ptr + 3 * t).to(tl.int64)
    bi = tl.load(tiles_ptr + 3 * t + 1).to(tl.int64)
    bj = tl.load(tiles_ptr + 3 * t + 2).to(tl.int64)
    row = jobs_ptr + job * 8
    src_off = tl.load(row)
    src_rs = tl.load(row + 1)
    dst_off = tl.load(row + 2)
    dst_rs = tl.load(row + 3)
    sc_off = tl.load(row + 4)
    sc_rs = tl.load(row + 5)
    n = tl.load(row + 6)
    k = tl.load(row + 7)
    src_rs32 = src_rs.to(tl.int32)
    dst_rs32 = dst_rs.to(tl.int32)
    if ALIGNED:
        if SRC_BF16:
            src_off = tl.multiple_of(src_off, 8)
            src_rs = tl.multiple_of(src_rs, 8)
            src_rs32 = tl.multiple_of(src_rs32, 8)
        else:
            src_off = tl.multiple_of(src_off, 4)
            src_rs = tl.multiple_of(src_rs, 4)
            src_rs32 = tl.multiple_of(src_rs32, 4)
        dst_off = tl.multiple_of(dst_off, 16)
        dst_rs = tl.multiple_of(dst_rs, 16)
        dst_rs32 = tl.multiple_of(dst_rs32, 16)
    # One 64-bit base per tile; 32-bit offsets inside it (fewer registers per element).
    src_t = src_ptr + src_off + bi * BLOCK * src_rs + bj * BLOCK
    dst_t = dst_ptr + dst_off + bi * BLOCK * dst_rs + bj * BLOCK
    rb = tl.arange(0, BLOCK)
    offs_s = rb[:, None] * src_rs32 + rb[None, :]
    offs_d = rb[:, None] * dst_rs32 + rb[None, :]
    if EVEN:  # whole tiles: no masks, so loads and stores vectorize
        if STREAM:  # read once, never again: do not keep it in L2
            x = tl.load(src_t + offs_s, eviction_policy="evict_first")
        else:
            x = tl.load(src_t + offs_s)
    else:
        mask = (rb[:, None] < n - bi * BLOCK) & (rb[None, :] < k - bj * BLOCK)
        x = tl.load(src_t + offs_s, mask=mask, other=0.0)
    # max |x| with NaN propagating (tl.max drops NaNs): a NaN block gets s = 1, as the oracle's
    # amax > 0 test gives; narrow: on the source's bits (exact), the tile stays narrow in registers
    if NARROW_AMAX:
        amax = _abs_max(x)
    else:
        x = x.to(tl.float32)
        amax = tl.reduce(tl.reduce(tl.abs(x), 1, _max_nan), 0, _max_nan)
    s = tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0)  # not amax * 0 + 448: inf * 0 is NaN
    s = tl.where(amax > 0.0, s, 1.0)
    y = _div_scale(x.to(tl.float32), s, FAST_DIV)
    # NaN-propagating clamp: NaN stays NaN, as the oracle's torch.clamp
    y = tl.minimum(tl.maximum(y, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                   propagate_nan=tl.PropagateNan.ALL)
    if not Q_F32:  # Q_F32: store the float32 quotient (interpreter tests convert with torch)
        y = y.to(tl.float8e4nv)
    if EVEN:
        if STREAM:
            tl.store(dst_t + offs_d, y, cache_modifier=".cs")
        else:
            tl.store(dst_t + offs_d, y)
    else:
        tl.store(dst_t + offs_d, y, mask=mask)
    tl.store(sc_ptr + sc_off + bi * sc_rs + bj, s)


# Launch settings (measured on one H200, benchmarks/bench_fp8_kernel.py); `configure`
# changes them for programs made afterwards (benchmarks compare variants).
KERNEL = "persist"  # "tile": one program per tile (this module); "persist": ops.fp8_persist
NUM_WARPS = 16  # per 128x128 tile: 32 elements per thread
NARROW_AMAX = True
STREAM = False
FAST_DIV = False
PERSIST = PersistVariant()


def configure(*, kernel: str | None = None, num_warps: int | None = None, narrow_amax: bool | None = None,
              stream: bool | None = None, fast_div: bool | None = None, persist: PersistVariant | None = None) -> None:
    """Set the launch settings of programs made from now on (this process)."""
    global KERNEL, NUM_WARPS, NARROW_AMAX, STREAM, FAST_DIV, PERSIST
    if kernel is not None and kernel not in ("tile", "persist"):
        raise ConfigError(f"fp8 kernel must be 'tile' or 'persist', got {kernel!r}")
    KERNEL = KERNEL if kernel is None else kernel
    NUM_WARPS = NUM_WARPS if num_warps is None else int(num_warps)
    NARROW_AMAX = NARROW_AMAX if narrow_amax is None else bool(narrow_amax)
    STREAM = STREAM if stream is None else bool(stream)
    FAST_DIV = FAST_DIV if fast_div is None else bool(fast_div)
    PERSIST = PERSIST if persist is None else persist


def configure_from_string(spec: str) -> None:
    """`configure` from a variant name as `bench_fp8_kernel.py` prints it:
    ``kernel=persist,warps=8,stages=1,prefetch=1,grid=2,fast_div=1,stream=0,fused=1`` (a
    name without ``fused`` is one of before it existed: it means ``fused=1``, the default) or
    ``warps=16,narrow_amax=1,stream=0,fast_div=1`` (the one-tile kernel)."""
    try:
        kw = dict(item.split("=", 1) for item in spec.split(",") if item.strip())
        kind = kw.pop("kernel", "tile")
        flag = lambda key, default: kw.pop(key, str(int(default))) == "1"  # noqa: E731
        if kind == "persist":
            d = PersistVariant()
            v = PersistVariant(num_warps=int(kw.pop("warps", d.num_warps)), stages=int(kw.pop("stages", d.stages)),
                               prefetch=flag("prefetch", d.prefetch), grid=int(kw.pop("grid", d.grid)),
                               fast_div=flag("fast_div", d.fast_div), stream=flag("stream", d.stream),
                               fused=flag("fused", d.fused), maxnreg=int(kw.pop("maxnreg", d.maxnreg)),
                               graph=flag("graph", d.graph),
                               torch_min_mib=int(kw.pop("torch_min_mib", d.torch_min_mib)))
            configure(kernel="persist", persist=v)
        else:
            configure(kernel=kind, num_warps=int(kw.pop("warps", NUM_WARPS)),
                      narrow_amax=flag("narrow_amax", NARROW_AMAX), stream=flag("stream", STREAM),
                      fast_div=flag("fast_div", FAST_DIV))
    except ValueError as exc:
        raise ConfigError(f"bad fp8 kernel variant {spec!r}: {exc}") from exc
    if kw:
        raise ConfigError(f"bad fp8 kernel variant {spec!r}: unknown keys {sorted(kw)}")

_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    s = _STREAMS.get(index)
    if s is None:
        s = _STREAMS[index] = torch.cuda.Stream(device=index)
    return s


class QuantProgram:
    """A fixed set of quantization jobs, tables built once; `run` launches them.

    ``jobs``: ``(src, q, s)`` triples on one CUDA device; ``src`` 2-D bf16/float32,
    ``q`` fp8 of the same shape, ``s`` float32 ``[ceil(n/B), ceil(k/B)]``, each with
    unit stride in its last dim. The views must stay valid while the program lives.

    ``copies``: ``(src, dst)`` pairs (same shape and dtype) of the same refit. With the
    persistent kernel configured fused (the default) they become copy tiles of its one
    launch (:mod:`.fp8_fused`); `copies_left` lists what the caller must still copy
    (all of them with another kernel), ``copy_bytes`` what the launch copies (counted
    in ``nbytes``).
    """

    def __init__(self, jobs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block: int = 128,
                 copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        self.block = block
        self.num_warps, self.narrow_amax, self.stream, self.fast_div = NUM_WARPS, NARROW_AMAX, STREAM, FAST_DIV
        self.kernel = KERNEL
        self.nbytes = 0
        self._launches: list[tuple] = []
        self._keep = list(jobs)
        groups: dict[bool, list] = {}
        device = None
        for src, q, s in jobs:
            if src.dim() != 2 or q.shape != src.shape or q.dtype not in (torch.float8_e4m3fn, torch.float32):
                raise ValueError(f"bad fp8 job: src {tuple(src.shape)} q {tuple(q.shape)} {q.dtype}")
            br, bc = -(-src.shape[0] // block), -(-src.shape[1] // block)
            if tuple(s.shape) != (br, bc) or s.dtype != torch.float32:
                raise ValueError(f"bad fp8 scale view {tuple(s.shape)} {s.dtype}, want {(br, bc)} float32")
            if src.numel() and (src.stride(1) != 1 or q.stride(1) != 1 or s.stride(1) != 1):
                raise ValueError("fp8 job views need unit stride in their last dim")
            if src.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"fp8 sources are bfloat16 or float32, got {src.dtype}")
            device = src.device
            if src.numel():
                groups.setdefault(src.dtype == torch.bfloat16, []).append((src, q, s, br, bc))
            self.nbytes += q.numel() + 4 * s.numel()
        self._persist: PersistProgram | None = None
        self._persist_variant = PERSIST
        # Copies ride in the persistent kernel's fused launch (one table, fp8_fused) when
        # that is the configured kernel; whatever it cannot take is the caller's.
        self.copies_left = list(copies)
        self.copy_bytes = 0
        if copies and KERNEL == "persist" and PERSIST.fused:
            self._persist = PersistProgram(self._keep, block, PERSIST, copies)
            self.copies_left, self.copy_bytes = self._persist.copies_left, self._persist.copy_bytes
            self.nbytes += self.copy_bytes
            device = device or self._persist.device
        for is_bf16, items in groups.items():
            esize = 2 if is_bf16 else 4
            for src, q, *_ in items:
                if max(src.stride(0), q.stride(0)) * (block + 1) >= 2**31:
                    raise ValueError("fp8 job rows too far apart for 32-bit offsets inside a tile")
            aligned = [q.dtype == torch.float8_e4m3fn and all(
                x % 16 == 0 for x in (src.data_ptr(), src.stride(0) * esize, q.data_ptr(), q.stride(0)))
                for src, q, *_ in items]
            even = [src.shape[0] % block == 0 and src.shape[1] % block == 0 for src, *_ in items]
            for flag in ((True, True), (True, False), (False, False), (False, True)):
                pick = [items[i] for i in range(len(items)) if (aligned[i], even[i]) == flag]
                if not pick:
                    continue
                # Offsets from the first job's own tensors (aligned ones when flag says so).
                src0, q0, s0 = pick[0][0], pick[0][1], pick[0][2]
                bases = (src0.data_ptr(), q0.data_ptr(), s0.data_ptr())
                table = torch.tensor([[(src.data_ptr() - bases[0]) // esize, src.stride(0),
                                       (q.data_ptr() - bases[1]) // q.element_size(),
                                       q.stride(0), (s.data_ptr() - bases[2]) // 4, s.stride(0), src.shape[0],
                                       src.shape[1]] for src, q, s, _, _ in pick], dtype=torch.int64)
                counts = torch.tensor([br * bc for *_, br, bc in pick], dtype=torch.int64)
                cols = torch.tensor([bc for *_, bc in pick], dtype=torch.int64)
                job = torch.repeat_interleave(torch.arange(len(pick)), counts)
                first = torch.cumsum(counts, 0) - counts
                local = torch.arange(int(counts.sum())) - first[job]
                tiles = torch.stack([job, local // cols[job], local % cols[job]], 1).to(torch.int32).contiguous()
                self._launches.append((tiles.to(device), table.to(device), tiles.shape[0], is_bf16, flag,
                                       (src0, q0, s0)))
        self.device = device

    @property
    def persist(self) -> PersistProgram:
        """The persistent kernel's program over the same jobs (tables built on first use)."""
        if self._persist is None:
            self._persist = PersistProgram(self._keep, self.block, self._persist_variant)
        return self._persist

    def launch(self) -> None:
        """Issue every launch on the current stream (on CPU: Triton's interpreter)."""
        if self.kernel == "persist":
            self.persist.launch()
            return
        if self.copy_bytes:  # made with copies for the persistent kernel, now the tile one: torch copies them
            for a, b in self.persist._fused.taken:
                b.copy_(a, non_blocking=True)
        for tiles, table, ntiles, is_bf16, (aligned, even), (src0, q0, s0) in self._launches:
            _fp8_block_kernel[(ntiles,)](tiles, table, src0, q0, s0, BLOCK=self.block, SRC_BF16=is_bf16,
                                         ALIGNED=aligned, EVEN=even, NARROW_AMAX=self.narrow_amax,
                                         STREAM=self.stream, FAST_DIV=self.fast_div,
                                         Q_F32=q0.dtype == torch.float32, num_warps=self.num_warps)

    @property
    def empty(self) -> bool:
        """Nothing to launch (no tiles, no copies taken)."""
        return not self._launches and not self.copy_bytes

    def fence(self) -> None:
        """Order the side stream after the current stream's work so far (what `run`
        does first unless told ``fenced``)."""
        if not self.empty:
            _side_stream(self.device).wait_stream(torch.cuda.current_stream(self.device))

    @property
    def replays(self) -> bool:
        """The persistent program's launches are a captured CUDA graph (see `replay_inline`)."""
        return self.kernel == "persist" and self._persist is not None and self._persist.graphed

    def replay_inline(self) -> None:
        """Replay the captured graph on the *current* stream: ordered after its earlier
        work and before its later work, as `run` with its fence and join, minus the side
        stream (a graph is not tied to the stream it was captured on). Only once `replays`."""
        if not self.replays:
            raise RuntimeError("replay_inline before the launch was captured (check `replays`)")
        self._persist.launch()

    def run(self, *, join: bool = True, fenced: bool = False) -> None:
        """Launch every job on the device's side stream, after the current stream's
        work so far (``fenced``: after it as of the caller's last `fence`, so that
        work issued since, e.g. unrelated copies, need not finish first); with
        ``join`` the current stream then waits for it (else the caller synchronizes
        the device before using the results)."""
        if self.empty:
            return
        cur = torch.cuda.current_stream(self.device)
        side = _side_stream(self.device)
        if not fenced:
            side.wait_stream(cur)
        with torch.cuda.stream(side):
            self.launch()
        if join:
            cur.wait_stream(side)


def quantize_jobs(jobs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block: int = 128) -> None:
    """Quantize ``jobs`` now (a one-off `QuantProgram`)."""
    prog = QuantProgram(jobs, block)
    prog.run()
    # The tables were made on the current stream and are used on the side one: keep
    # them alive until that work is done.
    side = _side_stream(prog.device) if prog.device is not None else None
    for tiles, table, *_ in prog._launches:
        tiles.record_stream(side)
        table.record_stream(side)
    if prog._persist is not None:
        for table in prog._persist.tables:
            table.record_stream(side)
