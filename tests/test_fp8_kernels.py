"""The fp8 Triton kernels (one-tile and persistent, every division path) against the
oracle, bit for bit, on CPU through Triton's interpreter (issue 16). The GPU run of
the same check is in test_fp8_gpu.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.timeout(240)
def test_every_kernel_variant_equals_the_oracle_in_the_interpreter():
    # A fresh process: TRITON_INTERPRET is read when the kernels are defined.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-m", "policyworker.testing.fp8_check", "--device", "cpu", "--block", "32"],
                         env=env, capture_output=True, text=True, timeout=200)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    got = json.loads(lines[-1])
    res, cov = got["variants"], got["copies"]
    assert {k.split(",")[0] for k in res} == {"kernel=tile", "kernel=persist"} and len(res) >= 7, res
    # null: a fast_div variant that an interpreter without a fused fma (Triton 3.6's) cannot check
    assert all(v is True or (v is None and "fast_div=1" in k) for k, v in res.items()), res
    assert any(v is True for k, v in res.items() if k.startswith("kernel=persist")), res
    # True means the quantized bytes *and* the plain copies of the same program landed bit
    # for bit; the fused variants made some copies as copy tiles (some checked, not null),
    # the others left every copy to torch
    fused = [k for k in cov if "fused=1" in k]
    assert fused and any(res[k] is True for k in fused), (res, cov)
    for k, c in cov.items():
        if k in fused:
            assert c["copy_bytes"] > 0 and 0 < c["copies_left"] < c["copies"], (k, c)
        else:
            assert c["copy_bytes"] == 0 and c["copies_left"] == c["copies"], (k, c)
    assert out.returncode == 0, out.stderr[-2000:]


def test_variant_strings_round_trip():
    pytest.importorskip("triton")
    from policyworker.errors import ConfigError
    from policyworker.ops import fp8_triton
    from policyworker.ops.fp8_persist import PersistVariant

    v = PersistVariant(num_warps=4, stages=3, prefetch=False, grid=3, fast_div=True, stream=True, fused=False,
                       maxnreg=0)
    try:
        fp8_triton.configure_from_string(v.name())
        assert fp8_triton.KERNEL == "persist" and fp8_triton.PERSIST == v
        # a name from before `fused` and `maxnreg` existed: their defaults
        fp8_triton.configure_from_string("kernel=persist,warps=8,stages=1,prefetch=1,grid=6,fast_div=1,stream=0")
        assert fp8_triton.PERSIST == PersistVariant(grid=6)
        fp8_triton.configure_from_string("warps=8,narrow_amax=1,stream=0,fast_div=1")
        assert (fp8_triton.KERNEL, fp8_triton.NUM_WARPS, fp8_triton.FAST_DIV) == ("tile", 8, True)
        with pytest.raises(ConfigError):
            fp8_triton.configure_from_string("kernel=persist,warps=8,bogus=1")
        with pytest.raises(ConfigError):
            fp8_triton.configure_from_string("kernel=nope")
    finally:
        fp8_triton.configure(kernel="tile", num_warps=16, fast_div=False, persist=PersistVariant())


def _compile_sm90(fn, pointers: dict[str, str], consts: dict, num_warps: int, num_stages: int) -> str:
    """PTX of ``fn`` for sm_90a, compiled here without a GPU (pointer args 16-byte aligned,
    as Triton specializes them at launch)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    sig = dict(pointers) | {k: "constexpr" for k in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton_compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    return k.asm["ptx"]


# Compiled for sm_90a by the Triton installed here. The H200 has had an older Triton
# (3.6) than this machine: run this file under it too (any venv with that triton and
# a CPU torch); the kernels use nothing newer. 3.6 promotes bf16 operands of
# tl.maximum to float32 (a bf16 reduce with such a combine does not compile there),
# hence the amax on integer bits, which this checks for (max.s16).
_PERSIST_PTRS = {"tiles_ptr": "*i64", "ntiles": "i32", "src_ptr": "*bf16", "dst_ptr": "*fp8e4nv", "sc_ptr": "*fp32"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prefetch,stages", [(True, 1), (False, 3)], ids=["prefetch", "pipelined"])
def test_persistent_kernel_compiles_for_hopper_with_16_byte_accesses(prefetch, stages, monkeypatch):
    # Structure, not speed: full tiles load and store 16 bytes per access and convert
    # with the hardware's saturating e4m3 conversion; the pipelined loop stages its
    # tiles through cp.async (a lost alignment fact once turned every store into bytes).
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from policyworker.ops.fp8_persist import _persist_kernel

    consts = dict(BLOCK=128, SRC_RS=4096, DST_RS=4096, SRC_ALIGN=8, DST_ALIGN=16, FAST_DIV=True, STREAM=False,
                  STAGES=stages, PREFETCH=prefetch, Q_F32=False)
    ptx = _compile_sm90(_persist_kernel, _PERSIST_PTRS, consts, num_warps=8, num_stages=stages)
    assert "st.global.v4.b32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx and "max.s16" in ptx
    assert "st.global.b8" not in ptx
    assert ("ld.global.v4.b32" in ptx) if prefetch else ("cp.async" in ptx)
    # no float subtraction in the kernel: 3.6 lowers unary minus to 0 - v, losing -0
    assert "sub.f32" not in ptx and "sub.rn.f32" not in ptx


@pytest.mark.timeout(120)
@pytest.mark.parametrize("aligned,even,fast_div", [(True, True, False), (True, True, True), (False, False, False)],
                         ids=["default", "fast_div", "masked"])
def test_one_tile_and_edge_kernels_compile_for_hopper(aligned, even, fast_div, monkeypatch):
    # The library default (one tile per program) and the persistent kernel's masked
    # edge launch, bf16 sources: what every fp8 refit on a GPU runs.
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from policyworker.ops.fp8_persist import _edge_kernel
    from policyworker.ops.fp8_triton import _fp8_block_kernel

    ptrs = {"tiles_ptr": "*i32", "jobs_ptr": "*i64", "src_ptr": "*bf16", "dst_ptr": "*fp8e4nv", "sc_ptr": "*fp32"}
    consts = dict(BLOCK=128, SRC_BF16=True, ALIGNED=aligned, EVEN=even, NARROW_AMAX=True, STREAM=False,
                  FAST_DIV=fast_div, Q_F32=False)
    ptx = _compile_sm90(_fp8_block_kernel, ptrs, consts, num_warps=16, num_stages=3)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "max.s16" in ptx
    assert "sub.f32" not in ptx and "sub.rn.f32" not in ptx  # -0 kept (see above)
    if aligned and even:
        assert "st.global.v4.b32" in ptx and "ld.global.v4.b32" in ptx
    else:
        ptrs = {k: v for k, v in _PERSIST_PTRS.items() if k != "ntiles"}
        ptx = _compile_sm90(_edge_kernel, ptrs, dict(BLOCK=128, FAST_DIV=fast_div, Q_F32=False), num_warps=8,
                            num_stages=1)
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "max.s16" in ptx


_FUSED_PTRS = {"tiles_ptr": "*i64", "ntiles": "i32", "src_ptr": "*bf16", "dst_ptr": "*fp8e4nv", "cdst_ptr": "*i16",
               "sc_ptr": "*fp32"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("prefetch,stages,maxnreg", [(True, 1, 128), (False, 3, None)], ids=["prefetch", "pipelined"])
def test_fused_kernel_compiles_for_hopper_with_16_byte_accesses(prefetch, stages, maxnreg, monkeypatch):
    # The one launch of an fp8 refit (quantize tiles and copy tiles, row strides per
    # tile): every load and store, masked copy tiles included, moves 16 bytes (the
    # strides' and column bounds' multiples of 16 bytes must reach the compiler: no
    # 1- or 2-byte accesses); the register cap is in the PTX.
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    from policyworker.ops.fp8_fused import _fused_kernel

    consts = dict(BLOCK=128, DST_ALIGN=16, FAST_DIV=True, STREAM=False, STAGES=stages, PREFETCH=prefetch, Q_F32=False)
    sig = dict(_FUSED_PTRS) | {k: "constexpr" for k in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    opts = {"num_warps": 8, "num_stages": stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    k = triton_compile(ASTSource(fn=_fused_kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    assert "st.global.v4.b32" in ptx
    if prefetch:
        assert "ld.global.v4.b32" in ptx
    else:  # the pipeliner stages the tiles through shared memory, 16 bytes per cp.async
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx), "no 16-byte cp.async"
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "max.s16" in ptx
    for narrow in ("st.global.b8", "st.global.b16", "ld.global.b16", "st.global.u16", "ld.global.u16"):
        assert narrow not in ptx, narrow
    assert "sub.f32" not in ptx and "sub.rn.f32" not in ptx
    if maxnreg:
        assert f".maxnreg {maxnreg}" in ptx
