"""The delta kernels on CUDA against the torch and numpy paths, bit for bit: the
interpreter's cases at several scales (many tiles and blocks), a large bf16 stream at
a few changed fractions (each kernel form, each finish), the per-copy checksums of a
transfer in one launch, and
``layout.delta`` choosing the kernels for CUDA tensors."""

from __future__ import annotations

import pytest
import torch

from policyworker.layout import delta as D

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("scale", [1, 7, 64])
def test_every_case_of_the_interpreters_check_on_the_gpu(scale):
    from policyworker.testing.delta_check import run

    res = run(torch.device("cuda:0"), scale)
    assert {k: v for k, v in res.items() if not v["ok"]} == {}
    assert {v["kind"] for k, v in res.items() if k.startswith("encode")} == {D.NONE, D.SPARSE, D.BITMAP, D.RAW}


def test_cuda_tensors_take_the_kernels():
    from policyworker.ops import delta_triton

    x = torch.zeros(1000, dtype=torch.int16, device="cuda:0")
    assert D._fused(x, x) is delta_triton
    assert D._fused(x[::2]) is None  # not contiguous: the torch path


@pytest.mark.parametrize("forms", [("units", "bits"), ("words", "bits"), ("units", "units")])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.03, 0.1, 0.5])
def test_a_large_bf16_stream_encodes_as_the_torch_path(fraction, forms):
    _configured(fraction, scan=forms[0], gather=forms[1])


@pytest.mark.parametrize("finish", ["mixed", "torch", "fused", "tiles"])
@pytest.mark.parametrize("fraction", [0.001, 0.03, 0.1])
def test_a_large_bf16_stream_encodes_as_the_torch_path_under_each_finish(fraction, finish):
    _configured(fraction, finish=finish)


@pytest.mark.parametrize("refresh", ["scan", "masked"])
@pytest.mark.parametrize("fraction", [0.001, 0.03, 0.5])
def test_a_large_bf16_stream_encodes_as_the_torch_path_with_the_scan_refreshing(fraction, refresh):
    _configured(fraction, refresh=refresh)


def _configured(fraction, **settings):
    """:func:`_large_bf16_stream` under the kernels' ``settings``; the defaults restored after."""
    from policyworker.ops import delta_triton

    before = {k: getattr(delta_triton, k.upper()) for k in settings}
    delta_triton.configure(**settings)
    try:
        _large_bf16_stream(fraction)
    finally:
        delta_triton.configure(**before)


def _large_bf16_stream(fraction):
    dev = torch.device("cuda:0")
    n = (64 << 20) + 12_345  # 128 MiB of bf16, a ragged end
    g = torch.Generator(device=dev).manual_seed(3)
    old = torch.randn(n, generator=g, device=dev).to(torch.bfloat16).view(torch.int16)
    cur = old.clone()
    hit = torch.rand(n, generator=g, device=dev) < fraction
    cur[hit] ^= 1
    want = D._encode_torch(cur, old)
    shadow = old.clone()
    got = D.encode(cur, shadow, update_old=True, with_checksum=True)
    assert (got.kind, got.count) == (want.kind, want.count)
    assert torch.equal(got.blob, want.blob)
    assert got.checksum == D._checksum_torch(cur.view(torch.uint8))
    assert torch.equal(shadow, cur)
    base = old.clone()
    D.apply(base, got.kind, got.count, got.blob)
    assert torch.equal(base, cur)


def test_a_transfers_copies_are_checksummed_in_one_launch():
    # a stream as nccl_reshard lays one out: copies back to back, some of odd byte counts
    dev = torch.device("cuda:0")
    g = torch.Generator().manual_seed(4)
    sizes = [int(s) * 2 for s in torch.randint(1, 300_000, (300,), generator=g)] + [2, 6, 4096 * 4096 * 2]
    segments, at = [], 0
    for s in sizes:
        segments.append((at, s))
        at += s
    raw = torch.randint(0, 256, (at,), dtype=torch.uint8, device=dev)
    want = [D._checksum_torch(raw.narrow(0, a, n)) for a, n in segments]
    assert D.checksums(raw, segments) == want
    assert D.checksum(raw) == D._checksum_torch(raw)
