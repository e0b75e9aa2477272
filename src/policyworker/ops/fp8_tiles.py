"""Triton helpers shared by the block-FP8 kernels (:mod:`.fp8_persist`, :mod:`.fp8_fused`):
the per-tile amax, the scale division, the e4m3 conversion, and the streaming
load/store of one tile. Their arithmetic is documented in :mod:`.fp8_persist`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max_int(a, b):
    return tl.maximum(a, b)


@triton.jit
def _abs_max(x):
    """max |x| of a 2-D bf16 or float32 tile, as float32; NaN if the tile holds a NaN.

    On the bit patterns with the sign cleared, in the source's width: for non-NaN
    floats of one sign the integer order is the float order, and every NaN pattern
    lies above inf's, so an integer max is exact and NaN-propagating with no float
    max at all. (Not ``tl.maximum(..., propagate_nan=ALL)`` on the floats: Triton
    3.6 promotes bf16 operands of ``tl.maximum`` to float32, and a combine function
    returning float32 for bf16 inputs does not compile there.)"""
    if x.dtype.primitive_bitwidth == 16:
        bits = x.to(tl.int16, bitcast=True) & 0x7FFF
        m = tl.reduce(tl.reduce(bits, 1, _max_int), 0, _max_int)
        amax = m.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        m = tl.reduce(tl.reduce(bits, 1, _max_int), 0, _max_int)
        amax = m.to(tl.float32, bitcast=True)
    return amax


@triton.jit
def _div_scale(xf, s, FAST_DIV: tl.constexpr):
    """RN_f32(xf / s) for a float32 tile and its scale, ``-0`` kept as ``-0``."""
    if FAST_DIV and ((s >= 1.1754943508222875e-38) & (s <= 3.4028234663852886e38)):  # 2 terms: Triton's BoolOp
        # r = RN(1/s); q0 = RN(x r); then twice q <- q - (q s - x) r, the remainder exact
        # by fma (one step makes q faithful, the next correctly rounded). Normal s only:
        # 1/s must not overflow (tiny tiles take the division below). The remainder is
        # q s - x, not x - q s, so that q = -0 stays -0 (-0 + -0 = -0). Negation by
        # multiplying by -1, never unary minus: Triton 3.6 lowers -v to 0 - v, which
        # makes -(+0) = +0 (the zero's sign lost on the GPU, not in the interpreter).
        nr = tl.math.div_rn(tl.zeros_like(s) - 1.0, s)  # -RN(1/s), exactly
        sv = tl.zeros_like(xf) + s
        nrv = tl.zeros_like(xf) + nr
        nx = xf * -1.0
        q = xf * (nr * -1.0)
        q = tl.math.fma(tl.math.fma(q, sv, nx), nrv, q)
        y = tl.math.fma(tl.math.fma(q, sv, nx), nrv, q)
    else:
        y = tl.math.div_rn(xf, tl.zeros_like(xf) + s)
    return y


@triton.jit
def _quant(x, FAST_DIV: tl.constexpr):
    """(y, s): y = RN_f32(x / s) as float32 (not yet fp8), s the tile's scale."""
    amax = _abs_max(x)
    s = tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0)  # not amax * 0: inf * 0 is NaN
    s = tl.where(amax > 0.0, s, 1.0)  # NaN and 0 blocks: 1, as the oracle
    y = _div_scale(x.to(tl.float32), s, FAST_DIV)
    return y, s


@triton.jit
def _load_tile(ptrs, STREAM: tl.constexpr):
    if STREAM:  # read once, never again: do not keep it in L2
        x = tl.load(ptrs, eviction_policy="evict_first")
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _quant_store(x, dst_ptrs, sc_ptr, FAST_DIV: tl.constexpr, STREAM: tl.constexpr, Q_F32: tl.constexpr):
    y, s = _quant(x, FAST_DIV)
    if Q_F32:  # the interpreter's check: float32 out, torch converts (see fp8_check)
        tl.store(dst_ptrs, y)
    elif STREAM:
        tl.store(dst_ptrs, y.to(tl.float8e4nv), cache_modifier=".cs")
    else:
        tl.store(dst_ptrs, y.to(tl.float8e4nv))
    tl.store(sc_ptr, s)
