"""The fp8 Triton kernels (one-tile and persistent, every division path) against the
oracle, bit for bit, on CPU through Triton's interpreter (issue 16). The GPU run of
the same check is in test_fp8_gpu.py."""

from __future__ import annotations

import json
import os
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
    out = subprocess.run([sys.executable, "-m", "policyworker.ops.fp8_check", "--device", "cpu", "--block", "32"],
                         env=env, capture_output=True, text=True, timeout=200)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    res = json.loads(lines[-1])
    assert {k.split(",")[0] for k in res} == {"kernel=tile", "kernel=persist"} and len(res) >= 6, res
    assert all(res.values()), res
    assert out.returncode == 0, out.stderr[-2000:]


def test_variant_strings_round_trip():
    pytest.importorskip("triton")
    from policyworker.errors import ConfigError
    from policyworker.ops import fp8_triton
    from policyworker.ops.fp8_persist import PersistVariant

    v = PersistVariant(num_warps=4, stages=3, prefetch=False, grid=3, fast_div=True, stream=True)
    try:
        fp8_triton.configure_from_string(v.name())
        assert fp8_triton.KERNEL == "persist" and fp8_triton.PERSIST == v
        fp8_triton.configure_from_string("warps=8,narrow_amax=1,stream=0,fast_div=1")
        assert (fp8_triton.KERNEL, fp8_triton.NUM_WARPS, fp8_triton.FAST_DIV) == ("tile", 8, True)
        with pytest.raises(ConfigError):
            fp8_triton.configure_from_string("kernel=persist,warps=8,bogus=1")
        with pytest.raises(ConfigError):
            fp8_triton.configure_from_string("kernel=nope")
    finally:
        fp8_triton.configure(kernel="tile", num_warps=16, fast_div=False, persist=PersistVariant())
