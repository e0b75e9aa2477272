"""The delta encoding alone: round trips, bit patterns, checksums, the handshake's decision."""

from __future__ import annotations

import pytest
import torch

from policyworker.errors import ConfigError, ProtocolError
from policyworker.transports.nccl_reshard.transport import NcclReshardOptions, NcclReshardSetup
from policyworker.layout import delta as D
from policyworker.layout.delta_inc import (
    INCREMENTAL_MAX,
    apply_update,
    encode_update,
    segment_checksums,
    word_deltas_sum,
)
from policyworker.transports.nccl_reshard.delta_handshake import (
    _HS_MAGIC,
    _NO_SHADOW,
    _RECEIVER,
    _TOO_MANY,
    _TRAINER,
    _WANT_DELTA,
    decide,
)


def _units(t: torch.Tensor) -> torch.Tensor:
    return t.view(D.unit_dtype(t.element_size())).view(-1)


@pytest.mark.parametrize("fraction, kind", [(0.0, D.NONE), (0.001, D.SPARSE), (0.03, D.SPARSE), (0.2, D.BITMAP),
                                            (1.0, D.RAW)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_round_trip_is_bit_exact_and_picks_the_smallest_encoding(fraction, kind, dtype, path, monkeypatch):
    if path == "torch":  # the device path (CUDA), run on CPU tensors
        monkeypatch.setattr(D, "_numpy_ok", lambda t: False)
    g = torch.Generator().manual_seed(1)
    n = 200_003  # several 65,536-unit blocks and a ragged end
    old = torch.randn(n, generator=g).to(dtype)
    new = old.clone()
    mask = torch.rand(n, generator=g) < fraction
    new[mask] = torch.randn(int(mask.sum()), generator=g).to(dtype)
    enc = D.encode(_units(new), _units(old))
    assert enc.kind == kind
    assert enc.blob.numel() == D.blob_bytes(enc.kind, n, enc.count, new.element_size())
    base = old.clone()
    D.apply(_units(base), enc.kind, enc.count, enc.blob)
    assert torch.equal(_units(base), _units(new))
    if kind == D.SPARSE:  # index (2 B) + value per changed unit, and little else
        assert enc.blob.numel() <= enc.count * (2 + new.element_size()) + 4 * (n // 65536 + 1) + 24


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_signed_zeros_and_nan_payloads_are_changes_by_their_bits(dtype):
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0, float("nan")], dtype=dtype)
    new = old.clone()
    new[0] = -0.0  # equal as a value, another bit pattern
    bits = _units(new)
    bits[4] = bits[4] ^ 1  # another NaN payload: NaN != NaN as values either way
    enc = D.encode(_units(new), _units(old))
    assert enc.count == 2  # the untouched NaN at index 2 is not a change
    base = old.clone()
    D.apply(_units(base), enc.kind, enc.count, enc.blob)
    assert torch.equal(_units(base), _units(new))
    assert D.checksum(base) == D.checksum(new) != D.checksum(old)


def test_checksum_sees_any_one_changed_word_and_swaps_and_ragged_tails():
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (8 * 1000 + 5,), dtype=torch.uint8, generator=g)
    ref = D.checksum(x)
    assert ref == D.checksum(x.clone())
    for i in (0, 7, 8, 4000, 8004):
        y = x.clone()
        y[i] ^= 0x80
        assert D.checksum(y) != ref
    y = x.clone()
    y[0:8], y[8:16] = x[8:16].clone(), x[0:8].clone()
    assert D.checksum(y) != ref
    assert D.checksum(x[1:]) != D.checksum(x[:-1])  # an unaligned view works and differs
    assert D.checksum(torch.zeros(3, dtype=torch.uint8)) != D.checksum(torch.zeros(4, dtype=torch.uint8))


def test_a_damaged_blob_is_refused_before_anything_is_written():
    old = torch.zeros(1000, dtype=torch.int16)
    new = old.clone()
    new[[3, 500]] = 7
    enc = D.encode(new, old)
    base = old.clone()
    with pytest.raises(ProtocolError):
        D.apply(base, enc.kind, enc.count + 1, enc.blob)
    with pytest.raises(ProtocolError):
        D.apply(base, enc.kind, enc.count, enc.blob[:-8])
    bad = enc.blob.clone()
    bad[:4].view(torch.int32)[0] = 5  # block counts no longer add up
    with pytest.raises(ProtocolError):
        D.apply(base, enc.kind, enc.count, bad)
    assert torch.equal(base, old)


def _segments(nbytes: int, g: torch.Generator, aligned: bool = True) -> list[tuple[int, int]]:
    """A stream cut into copies at random places (8-byte boundaries when ``aligned``), and an empty one."""
    cuts = torch.randint(0, nbytes, (6,), generator=g).tolist()
    cuts = sorted({0, *((c // 8 * 8) if aligned else c for c in cuts)})
    ends = [*cuts[1:], nbytes]
    return [(a, b - a) for a, b in zip(cuts, ends)] + [(nbytes, 0)]


@pytest.mark.parametrize("dtype, n", [(torch.bfloat16, 200_003), (torch.float32, 70_001), (torch.uint8, 1_001)])
def test_one_pass_encode_matches_encode_refreshes_the_shadow_and_updates_the_checksums(dtype, n):
    # Versions with few, many, all and no changes (one at the ragged end): the one-pass
    # path's blob is encode()'s byte for byte, the shadow ends equal to the new bytes and
    # the checksums updated from the changed words alone equal a full pass over them.
    g = torch.Generator().manual_seed(3)
    unit = torch.empty(0, dtype=dtype).element_size()
    cur = torch.randint(0, 256, (n * unit,), dtype=torch.uint8, generator=g).view(D.unit_dtype(unit))
    segs = _segments(n * unit, g)
    shadow, sums = cur.clone(), None
    for fraction in (0.001, 0.0, 0.01, 0.3, 1.0, "last"):
        mask = torch.zeros(n, dtype=torch.bool) if fraction == "last" else torch.rand(n, generator=g) < fraction
        mask[-1] = fraction == "last" or bool(mask[-1])
        cur[mask] ^= 1
        want, before = D.encode(cur, shadow), shadow.clone()
        enc, sums = encode_update(cur, shadow, segs, sums, sparse=True)
        assert (enc.kind, enc.count) == (want.kind, want.count) and torch.equal(enc.blob, want.blob), fraction
        assert torch.equal(shadow, cur)
        assert sums == [D.checksum(cur.view(torch.uint8)[a:a + m]) for a, m in segs], fraction
        D.apply(before, enc.kind, enc.count, enc.blob)
        assert torch.equal(before, cur)
    dense_shadow = shadow.clone()
    cur[::7] ^= 1
    enc, dense_sums = encode_update(cur, dense_shadow, segs, sums, sparse=False)
    assert torch.equal(dense_shadow, cur) and dense_sums == segment_checksums(cur, segs)


@pytest.mark.parametrize("dtype, n", [(torch.bfloat16, 200_003), (torch.float32, 70_001), (torch.uint8, 1_001),
                                      (torch.float64, 9_001)])
def test_apply_update_lands_the_delta_and_updates_the_checksums_from_the_changed_units(dtype, n):
    # The receiver's incremental check: from the checksums of its bytes before a delta,
    # the changed units' old and new values give the checksums after it, equal to a
    # full pass over the bytes (few changes: sparse; many: bitmap; one at the ragged end).
    g = torch.Generator().manual_seed(5)
    unit = torch.empty(0, dtype=dtype).element_size()
    held = torch.randint(0, 256, (n * unit,), dtype=torch.uint8, generator=g).view(D.unit_dtype(unit))
    segs = _segments(n * unit, g)[:-1]  # every copy on an 8-byte boundary (the empty one at the end is not)
    sums = segment_checksums(held, segs)
    for fraction in (0.001, 0.004, 0.01, 0.2, "last"):
        cur = held.clone()
        mask = torch.zeros(n, dtype=torch.bool) if fraction == "last" else torch.rand(n, generator=g) < fraction
        mask[-1] = fraction == "last" or bool(mask[-1])
        cur[mask] = torch.randint(-100, 100, (int(mask.sum()),), generator=g).to(cur.dtype)
        enc = D.encode(cur, held)
        sums, updated = apply_update(held, enc.kind, enc.count, enc.blob, segs, sums)
        # past INCREMENTAL_MAX of the units changed: a full pass (cheaper there), same sums
        assert updated == (enc.count <= n * INCREMENTAL_MAX) and enc.kind in (D.SPARSE, D.BITMAP), fraction
        assert torch.equal(held, cur) and sums == segment_checksums(cur, segs), fraction
    # Unknown sums or a raw blob: a full pass. A damaged blob: nothing written.
    cur = held.clone() ^ 1
    enc = D.encode(cur, held)
    assert enc.kind == D.RAW and apply_update(held, enc.kind, enc.count, enc.blob, segs, sums) == (
        segment_checksums(cur, segs), False)
    cur[3] ^= 2
    enc, before = D.encode(cur, held), held.clone()
    with pytest.raises(ProtocolError):
        apply_update(held, enc.kind, enc.count + 1, enc.blob, segs, segment_checksums(held, segs))
    assert torch.equal(held, before)
    # The trust it rests on: bytes changed after their checksums were taken, where the
    # delta does not touch, go unseen (the sums are the old ones plus the delta's).
    sums = segment_checksums(held, segs)
    held[n // 2] ^= 4
    enc = D.encode(cur, before)
    got, _ = apply_update(held, enc.kind, enc.count, enc.blob, segs, sums)
    assert got == segment_checksums(cur, segs) != segment_checksums(held, segs)


@pytest.mark.parametrize("aligned", [True, False])
def test_segment_checksums_equal_checksum_per_segment(aligned):
    g = torch.Generator().manual_seed(4)
    for nbytes in (1, 7, 8, 1024, 1031, 300_017):
        raw = torch.randint(0, 256, (nbytes + 8,), dtype=torch.uint8, generator=g)
        segs = _segments(nbytes, g, aligned)
        for data in (raw[:nbytes], raw[1:nbytes + 1]):  # an 8-byte-aligned start, and not
            assert segment_checksums(data, segs) == [D.checksum(data[a:a + m]) for a, m in segs]


def test_word_deltas_sum_finds_each_words_segment_across_empty_ones():
    # Changed words (with repeats, as units of one word give) in segments of a stream that
    # has empty segments at its start, in its middle and at its end: the increments equal
    # the checksums' difference, segment by segment.
    g = torch.Generator().manual_seed(6)
    segs = [(0, 0), (0, 2048), (2048, 0), (2048, 8), (2056, 4096), (6152, 0), (6152, 1032), (7184, 0)]
    old = torch.randint(0, 256, (7184,), dtype=torch.uint8, generator=g)
    new = old.clone()
    units = torch.randint(0, 7184 // 2, (300,), generator=g).unique()
    new.view(torch.int16)[units] ^= 3
    words = (units >> 2).numpy()  # ascending, with repeats
    delta = (new.view(torch.int64)[units >> 2].numpy().view("u8") - old.view(torch.int64)[units >> 2].numpy().view("u8"))
    first = [i == 0 or words[i] != words[i - 1] for i in range(words.size)]  # one delta per changed word
    got = word_deltas_sum(segs, words[first], delta[first])
    before, after = segment_checksums(old, segs), segment_checksums(new, segs)
    assert {i: (a - b) % 2**64 for i, (a, b) in enumerate(zip(after, before)) if a != b} == got


def _row(role, v, shadow=0, want=_WANT_DELTA):
    return [_HS_MAGIC, role, v, shadow, want, 0]


def test_the_handshake_decides_delta_only_when_every_base_matches():
    trainers = [_row(_TRAINER, 5, 4), _row(_TRAINER, 5, 4)]
    assert decide([*trainers, _row(_RECEIVER, 4), _row(_RECEIVER, 4)])[0]
    fresh, why = decide([*trainers, _row(_RECEIVER, 4), _row(_RECEIVER, 0)])  # a replacement rollout
    assert not fresh and "holds version 0" in why
    assert not decide([*trainers, _row(_RECEIVER, -1)])[0]  # torn
    assert not decide([_row(_TRAINER, 5, -1, _NO_SHADOW), _row(_TRAINER, 5, 4), _row(_RECEIVER, 4)])[0]
    assert not decide([_row(_TRAINER, 5, 4), _row(_TRAINER, 5, 3), _row(_RECEIVER, 4)])[0]
    assert not decide([_row(_TRAINER, 5, 4), _row(_TRAINER, 6, 4), _row(_RECEIVER, 4)])[0]
    assert not decide([*trainers, _row(_RECEIVER, 4), _row(_RECEIVER, 5)])[0]  # ahead of the base
    too_many, why = decide([_row(_TRAINER, 5, 4, _TOO_MANY), _row(_TRAINER, 5, 4), _row(_RECEIVER, 4)])
    assert not too_many and "too many" in why
    assert decide(trainers)[0]  # no receiver in the group: nothing to disagree with
    with pytest.raises(ProtocolError):
        decide([[0, 0, 0, 0, 0, 0]])
    with pytest.raises(ProtocolError):
        decide([_row(_RECEIVER, 4)])  # no trainer


@pytest.mark.parametrize("bad", [{"delta_max_fraction": 1.5}, {"delta_max_fraction": -0.1},
                                 {"delta_full_every": 0}, {"delta_verify": "sometimes"}])
def test_bad_delta_settings_fail_at_attach(bad):
    with pytest.raises(ConfigError):
        NcclReshardSetup(delta=True, **bad)


def test_delta_settings_parse_from_plain_keywords():
    from policyworker.config import parse

    setup = parse(NcclReshardSetup, {"delta": True, "delta_max_fraction": 0.1, "delta_full_every": 8}, what="t")
    assert (setup.delta, setup.delta_max_fraction, setup.delta_full_every) == (True, 0.1, 8)
    assert parse(NcclReshardOptions, {"delta": False}, what="t").delta is False
    assert parse(NcclReshardSetup, {"delta": True, "delta_verify": "incremental"}, what="t").delta_verify == "incremental"
    assert parse(NcclReshardOptions, {"delta_verify": "full"}, what="t").delta_verify == "full"
    with pytest.raises(ConfigError):
        parse(NcclReshardOptions, {"delta_verify": "none"}, what="t")
    with pytest.raises(ConfigError):
        parse(NcclReshardSetup, {"delta": "yes"}, what="t")



# -- the Triton kernels (CUDA's path), in Triton's interpreter on CPU -------------------------
@pytest.mark.timeout(120)
def test_kernels_encode_and_checksum_bit_for_bit_as_the_torch_and_numpy_paths_in_the_interpreter():
    # A fresh process: TRITON_INTERPRET is read when Triton's own jit functions are defined.
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from policyworker.testing.delta_check import ENCODE_CASES, FORMS, MASKED_CASES, TILES_CASES

    src = str(Path(D.__file__).resolve().parents[2])
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "policyworker.testing.delta_check", "--device", "cpu"], env=env,
                         capture_output=True, text=True, timeout=100)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    res = json.loads(lines[-1])
    assert {k: v for k, v in res.items() if not v["ok"]} == {}
    encodes = [v for k, v in res.items() if k.startswith("encode")]
    assert len(encodes) == len(ENCODE_CASES) + len(TILES_CASES) + len(MASKED_CASES) + 9 and len(res) >= len(encodes) + 8
    assert {(v["finish"], v["kind"]) for v in encodes} >= {(f, kind) for f in ("device", "fused", "torch", "mixed", "tiles")
                                                           for kind in (D.SPARSE, D.BITMAP)}
    # the tiles finish: every kind and unit width, the three refreshing passes, and blobs of each
    # kind where tiles over their scratch slot (gathered again) meet tiles under it (compacted)
    tiles = [v for v in encodes if v["finish"] == "tiles"]
    assert {v["kind"] for v in tiles} == {D.NONE, D.SPARSE, D.BITMAP, D.RAW}
    assert {v["unit"] for v in tiles} == {1, 2, 4, 8} and {v["refresh"] for v in tiles} == {"gather", "scan", "masked"}
    mixed = {(v["unit"], v["kind"]) for v in tiles if v["over_cap"] and v["under_cap"]}
    assert mixed >= {(u, kind) for u in (1, 2, 4, 8) for kind in (D.SPARSE, D.BITMAP)}, mixed
    assert {tuple(v["forms"]) for v in encodes} == set(FORMS)
    assert {v["kind"] for v in encodes if tuple(v["forms"]) == FORMS[0]} >= {D.SPARSE, D.BITMAP, D.NONE}
    assert any(v["offset"] for v in encodes)  # an unaligned stream: the units scan under the words form
    assert {v["kind"] for v in encodes} == {D.NONE, D.SPARSE, D.BITMAP, D.RAW}
    assert {(v["kind"], v["refresh"]) for v in encodes} >= {(D.SPARSE, "gather"), (D.SPARSE, "scan"),
                                                           (D.BITMAP, "gather"), (D.BITMAP, "scan")}
    masked = [v for v in encodes if v["refresh"] == "masked"]  # the scan stores the changed units only
    assert {v["kind"] for v in masked} == {D.SPARSE, D.BITMAP, D.RAW} and {v["unit"] for v in masked} == {1, 2, 4, 8}
    assert {tuple(v["forms"]) for v in masked} >= set(FORMS[:2]) and any(v["offset"] for v in masked)
    assert {v["finish"] for v in masked} == {"mixed", "device", "torch", "fused", "tiles"}
    specials = [v for k, v in res.items() if "NaN" in k]
    assert [v["count"] for v in specials] == [2100, 2100, 2100]  # -0.0, a NaN payload, +0.0 per 7; equal NaNs are not
    assert out.returncode == 0, out.stderr[-2000:]



@pytest.mark.timeout(120)
def test_kernels_compile_for_hopper_with_16_byte_loads_of_whole_tiles(monkeypatch):
    # What the interpreter cannot show: the kernels compile (sm_90a, this machine's
    # Triton) and a whole tile is read 16 bytes per access, whatever the stream's length.
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    from policyworker.ops import delta_triton as K

    def ptx(fn, sig, consts):
        sig = dict(sig) | {k: "constexpr" for k in consts}
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton_compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

    bf16 = dict(T=K.tile_units(2), PER=4, UBITS=16, UDT=tl.uint16)
    scan = ptx(K._scan_kernel, {"cur_ptr": "*i16", "old_ptr": "*i16", "n": "i64", "counts_ptr": "*i32",
                                "bits_ptr": "*u8", "part_ptr": "*i64"}, dict(bf16, REFRESH=True))
    assert "st.global.v4.b32" in scan  # the scan's refresh writes whole tiles 16 bytes at a time
    masked = ptx(K._scan_kernel, {"cur_ptr": "*i16", "old_ptr": "*i16", "n": "i64", "counts_ptr": "*i32",
                                  "bits_ptr": "*u8", "part_ptr": "*i64"}, dict(bf16, REFRESH=2))
    assert "@%p" in masked and "st.global.b16" in masked  # the masked refresh: predicated 2-byte stores
    sums = ptx(K._sum_kernel, {"x_ptr": "*i16", "seg_ptr": "*i64", "nseg": "i32", "part_ptr": "*i64"},
               dict(bf16, LOG=12, ALIGN=8))
    for code in (scan, sums):
        assert "ld.global.v4.b32" in code and "mul.lo.s64" in code
    words = ptx(K._scan_words_kernel, {"cur_ptr": "*i16", "old_ptr": "*i16", "n": "i64", "counts_ptr": "*i32",
                                       "bits_ptr": "*u8", "part_ptr": "*i64"},
                dict(bf16, REFRESH=False, **K._lane_masks(2)))
    assert "ld.global.v2.b64" in words or "ld.global.v4.b32" in words  # whole tiles: 16-byte word loads
    gsig = {"cur_ptr": "*i16", "old_ptr": "*i16", "counts_ptr": "*i32", "starts_ptr": "*i64", "bits_ptr": "*u8",
            "val_ptr": "*i16", "off_ptr": "*i16", "blob_ptr": "*u8", "tiles": "i64", "k": "i64", "at_offs": "i64",
            "at_vals": "i64", "size": "i64"}
    # the header and padding: none, the sparse block counts, the bitmap copy (vector stores)
    for kernel, glue in ((K._gather_kernel, 0), (K._gather_bits_kernel, 1), (K._gather_bits_kernel, 2)):
        code = ptx(kernel, gsig, dict(T=K.tile_units(2), OFFSETS=glue != 2, UPDATE=True, GLUE=glue, TPB=8, UNIT=2))
        assert "st.global.b16" in code and (glue != 2 or "st.global.v2.b32" in code or "st.global.v4.b32" in code)
    # the tiles finish's scan: whole steps 16-byte loads, the changed units 2-byte masked stores
    tiles = ptx(K._scan_tiles_kernel, {"cur_ptr": "*i16", "old_ptr": "*i16", "n": "i64", "counts_ptr": "*i32",
                                       "bits_ptr": "*u8", "part_ptr": "*i64", "val_ptr": "*i16", "off_ptr": "*i16"},
                dict(bf16, S=K.TILE_STEP // 2, CAP=K.tile_cap(2), REFRESH=False, UPDATE=True, AHEAD=True))
    assert "ld.global.v4.b32" in tiles and "st.global.b16" in tiles and "mul.lo.s64" in tiles
    # The other opt-in finishes' kernels ("fused", "device") are compiled and checked bit for bit
    # on the GPU (tests/test_delta_gpu.py); compiling them here too cost ~20 s of CI.


def test_encode_options_on_the_cpu_paths(monkeypatch):
    # update_old / with_checksum mean the same without the kernels (numpy and torch paths)
    for path in ("numpy", "torch"):
        if path == "torch":
            monkeypatch.setattr(D, "_numpy_ok", lambda t: False)
        g = torch.Generator().manual_seed(9)
        old = torch.randint(-(2**15), 2**15, (100_001,), dtype=torch.int16, generator=g)
        new = old.clone()
        new[::97] ^= 1
        shadow = old.clone()
        enc = D.encode(new, shadow, update_old=True, with_checksum=True)
        assert torch.equal(shadow, new) and enc.checksum == D.checksum(new)
        assert D.encode(new, old).checksum is None


def test_the_fused_scans_scratch_holds_every_sparse_blob():
    # the fused scan keeps at most _sparse_cap(n, unit) changed units: exactly the most a sparse blob can have
    for unit in (1, 2, 4, 8):
        for n in (1, 7, 100, 4_097):
            sparse = [k for k in range(1, n + 1) if D._smallest(n, k, unit) == D.SPARSE]
            assert D._sparse_cap(n, unit) == max(sparse, default=0)
            assert sparse == list(range(1, len(sparse) + 1))  # an interval from 1
        for n in (65_537, 200_003, 1 << 30):
            cap = D._sparse_cap(n, unit)
            assert D._smallest(n, cap, unit) == D.SPARSE != D._smallest(n, cap + 1, unit)


def test_kernel_settings_are_checked():
    pytest.importorskip("triton")
    from policyworker.ops import delta_triton as K

    for bad in ({"tile_bytes": 3000}, {"tile_bytes": 512}, {"tile_bytes": 1 << 17}, {"num_warps": 3},
                {"refresh": "both"}, {"refresh": True}):
        with pytest.raises(ConfigError):
            K.configure(**bad)
    for bad in ({"scan": "bytes"}, {"gather": "all"}, {"finish": "host"}, {"plan_chunk": 100}, {"plan_chunk": 8},
                {"tile_share": 1}, {"tile_share": 12}, {"tile_share": 128}, {"tile_step": 512}, {"tile_step": 3072},
                {"tile_ahead": 1}):
        with pytest.raises(ConfigError):
            K.configure(**bad)
    assert (K.TILE_BYTES, K.NUM_WARPS, K.REFRESH, K.SCAN, K.GATHER) == (16384, 4, "masked", "units", "bits")
    assert (K.FINISH, K.PLAN_CHUNK, K.PLAN_WARPS, K.TILE_SHARE, K.TILE_STEP, K.TILE_AHEAD) == ("mixed", 4096, 8, 16,
                                                                                          4096, False)
    assert [K.tile_cap(u) for u in (1, 2, 4, 8)] == [1024, 512, 256, 128]  # the fused scan's bound: n / 16 units
    assert [K.tile_units(u) for u in (1, 2, 4, 8)] == [16384, 8192, 4096, 2048]  # each divides a 65,536-unit block
