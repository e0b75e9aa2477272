"""Quantizing while packing: the reference quantizer, the CPU fused one, fp8 copies.

``quantize_reference`` is the oracle, written plainly (one block at a time). The
fused quantizers compute the same function bit for bit: on CPU
(:func:`quantize_into`) one band of ``block`` rows at a time — the band is read
from the source once, into a float32 scratch that stays in cache, then scaled,
rounded and written as fp8 + scales; on CUDA, :mod:`policyworker.ops.fp8_triton`
(one kernel, one read of the source, on its own stream).

Arithmetic (float32 throughout, IEEE round-to-nearest-even): ``x`` widened to
float32 (exact for bf16), ``amax = max |x|`` over the block (exact),
``s = amax / 448`` (``s = 1`` when ``amax == 0``), ``q = fp8_e4m3fn(clamp(x / s,
±448))``. The clamp only catches ``x / s`` rounding just above 448.

Dequantization bound (tested): with ``dq = q * s`` computed exactly, every element
``w`` of a block obeys ``|w - dq| <= 2**-4 * |w| + 2**-10 * s`` (+ ``2**-22 * |w|``
of float32 rounding in ``x / s``): e4m3 keeps 3 mantissa bits, so rounding a
normal value costs at most half an ulp, ``2**-4`` of it; below e4m3's smallest
normal (``2**-6``) the spacing is ``2**-9``, half of which times ``s`` is the
absolute term.

``pack_copy`` / ``unpack_copy``: a quantized copy's bytes in a message are its
box's fp8 bytes (row-major) then its blocks' float32 scales (row-major); messages
are raw bytes with no alignment, so scales travel through a small aligned scratch.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch

from policyworker.errors import PlanError
from policyworker.layout.formats import block_fp8_grid as fp8
from policyworker.layout.formats.base import PullLaunch
from policyworker.layout.formats.block_fp8_grid import FP8_MAX

__all__ = ["QuantJobs", "dequantize", "pack_copy", "quant_job", "quantize_bands", "quantize_into",
           "quantize_reference", "reference_local", "scale_tensors", "unpack_copy"]

F8 = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_reference(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: ``(q, scale_inv)`` of a 2-D tensor, block by block, in plain torch."""
    if w.dim() != 2:
        raise PlanError(f"fp8 quantizes 2-D tensors, got shape {tuple(w.shape)}")
    n, k = w.shape
    q = torch.empty((n, k), dtype=F8, device=w.device)
    s = torch.empty((_cdiv(n, block), _cdiv(k, block)), dtype=torch.float32, device=w.device)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block].to(torch.float32)
            amax = blk.abs().max()
            # amax / 448 as a true division (a tensor divisor: see quantize_bands)
            scale = amax / torch.full_like(amax, FP8_MAX) if amax.item() > 0 else torch.ones_like(amax)
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / scale).clamp(-FP8_MAX, FP8_MAX).to(F8)
            s[i, j] = scale
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``q * scale_inv`` per block, in float64 (exact: e4m3 times float32 fits)."""
    full = s.to(torch.float64).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return q.to(torch.float64) * full[: q.shape[0], : q.shape[1]]


def quantize_into(src: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int = 128) -> None:
    """Quantize 2-D ``src`` into ``q`` (fp8, same shape) and ``s`` (float32,
    ``[ceil(n/B), ceil(k/B)]``), bit for bit as `quantize_reference`; CUDA tensors go
    to the Triton kernel, CPU ones through the band loop below."""
    if src.device.type == "cuda":
        from policyworker.ops.fp8_triton import quantize_jobs

        quantize_jobs([(src, q, s)], block)
        return
    quantize_bands(src, q, s, block)


def quantize_bands(src: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int = 128) -> None:
    """The fused quantizer in plain torch (any device), a chunk of whole block rows at
    a time: the chunk is read from the source once, into a float32 scratch padded to
    whole blocks with zeros (which leave every ``amax`` as it is; the scratch stays in
    cache), then scaled, rounded and written as fp8 + scales."""
    n, k = src.shape
    nbc = _cdiv(k, block)
    step = block * max(1, (1 << 20) // (block * nbc * block))  # ~1M elements (4 MB) of scratch
    scratch = None
    for r0 in range(0, n, step):
        rows = min(step, n - r0)
        nbr = _cdiv(rows, block)
        if scratch is None or scratch.shape[0] < nbr * block:
            scratch = torch.zeros((nbr * block, nbc * block), dtype=torch.float32, device=src.device)
        x = scratch[: nbr * block]
        if rows % block or k % block:
            x.zero_()  # the padding must be zeros (a previous chunk left values there)
        x[:rows, :k].copy_(src[r0:r0 + rows])
        blocks4 = x.view(nbr, block, nbc, block)
        # max |x| as max(max, -min): two reads, no |x| temporary (the same value exactly)
        amax = torch.maximum(blocks4.amax(dim=(1, 3)), blocks4.amin(dim=(1, 3)).neg_())
        # A tensor divisor: torch turns division by a Python scalar into multiplication
        # by its reciprocal on CUDA, which is not the same float.
        # amax > 0, not amax != 0: a block holding a NaN gets 1 (NaN > 0 is false), as the oracle
        scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
        blocks4.div_(scale.view(nbr, 1, nbc, 1))
        # No clamp pass: |x / s| <= 448 * (1 + 2**-23) here, which rounds to 448 exactly
        # as the oracle's clamped value does (e4m3's next step would be 480).
        q[r0:r0 + rows].copy_(x[:rows, :k])
        s[r0 // block:r0 // block + nbr].copy_(scale)


def _region(t: torch.Tensor, at: Sequence[int], start: Sequence[int], stop: Sequence[int]) -> torch.Tensor:
    for d, (a, b, e) in enumerate(zip(at, start, stop)):
        t = t.narrow(d, a, e - b)
    return t


def pack_copy(plan, c, local_tensors: Mapping[str, torch.Tensor], out: torch.Tensor, offset: int) -> int:
    """Sender: quantize copy ``c``'s source box into ``out`` at ``offset`` (fp8, then
    scales); returns the offset after its last byte."""
    block = plan.body.dest_format.block
    name = plan.body.tensor_names[c.src_tensor]
    try:
        local = local_tensors[name]
    except KeyError:
        raise PlanError(f"sender local tensors lack {name!r}", param=name) from None
    src = _region(local, c.src_at, c.start, c.stop)
    r, k = src.shape
    br, bc = fp8.blocks(c.start, c.stop, block)
    q = out.narrow(0, offset, r * k).view(r, k).view(F8)
    s = torch.empty((br, bc), dtype=torch.float32, device=out.device)
    quantize_into(src, q, s, block)
    out.narrow(0, offset + r * k, 4 * br * bc).copy_(s.view(-1).view(torch.uint8))
    return offset + r * k + 4 * br * bc


def _fp8_names(plan, c, tensors: Mapping[str, torch.Tensor]) -> tuple[str, str]:
    """The destination tensor's name and its scale's name of quantized copy ``c``, both
    present in ``tensors`` (else a ``PlanError`` naming the missing one)."""
    name = plan.body.tensor_names[c.dst_tensor]
    sname = fp8.scale_name(name)
    for n in (name, sname):
        if n not in tensors:
            raise PlanError(f"receiver local tensors lack {n!r}", param=n)
    return name, sname


def unpack_copy(plan, c, buf: torch.Tensor, local_tensors: MutableMapping[str, torch.Tensor], offset: int) -> int:
    """Receiver: land a quantized copy's fp8 bytes in its tensor and its scales in the
    tensor's ``_scale_inv``; returns the offset after its last byte."""
    block = plan.body.dest_format.block
    name, sname = _fp8_names(plan, c, local_tensors)
    dst = _region(local_tensors[name], c.dst_at, c.start, c.stop)
    r, k = dst.shape
    dst.view(torch.uint8).copy_(buf.narrow(0, offset, r * k).view(r, k))
    br, bc = fp8.blocks(c.start, c.stop, block)
    sr, sc = fp8.scale_at(plan, c)
    sview = local_tensors[sname].narrow(0, sr, br).narrow(1, sc, bc)
    sview.view(torch.uint8).copy_(buf.narrow(0, offset + r * k, 4 * br * bc).view(br, 4 * bc))
    return offset + r * k + 4 * br * bc


def scale_tensors(plan, rank: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed ``_scale_inv`` tensors of generation rank ``rank`` (empty without fp8)."""
    return {n: torch.zeros(shape, dtype=torch.float32, device=device)
            for n, shape in fp8.scale_shapes(plan, rank).items()}


def reference_local(plan, rank: int, name: str, high: torch.Tensor) -> dict[str, torch.Tensor]:
    """What fp8 tensor ``name`` of generation rank ``rank`` must hold, from its
    unquantized contents ``high``: ``{name: q, name_scale_inv: s}`` by the oracle,
    member by member (fused tensors quantize per source block)."""
    block = plan.body.dest_format.block
    tensor = plan.local_tensors("dst", rank)[name]
    q = torch.empty(tuple(high.shape), dtype=F8)
    s = torch.empty(fp8.scale_shapes(plan, rank)[fp8.scale_name(name)], dtype=torch.float32)
    row = 0
    for p in sorted(tensor.pieces, key=lambda p: p.at[0]):
        rows = p.stop[0] - p.start[0]
        pq, ps = quantize_reference(high.narrow(0, p.at[0], rows), block)
        q.narrow(0, p.at[0], rows).copy_(pq)
        s.narrow(0, row, ps.shape[0]).copy_(ps)
        row += ps.shape[0]
    return {name: q, fp8.scale_name(name): s}


class QuantJobs(PullLaunch):
    """A fixed list of ``(src, q, s)`` quantizations, run together (the colocated
    pull: source views straight into the rollout's fp8 tensors and scales). On CUDA
    one Triton launch whose tables are built once; on CPU the band loop per job.

    ``copies``: the same refit's plain ``(src, dst)`` copies. On CUDA the launch takes
    what it can (copy tiles of the persistent kernel, :mod:`policyworker.ops.fp8_fused`);
    `copies_left` is what the caller must still copy (all of them on CPU), and
    `run`'s byte count includes the copies it made."""

    def __init__(self, jobs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block: int = 128,
                 copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        self.jobs, self.block = list(jobs), block
        self.nbytes = sum(q.numel() + 4 * s.numel() for _, q, s in self.jobs)
        self._cuda = None
        self.copies_left = list(copies)
        self.copy_bytes = 0
        if self.jobs and self.jobs[0][0].device.type == "cuda":
            from policyworker.ops.fp8_triton import QuantProgram

            self._cuda = QuantProgram(self.jobs, block, copies)
            self.copies_left, self.copy_bytes = self._cuda.copies_left, self._cuda.copy_bytes
            self.nbytes += self.copy_bytes

    def __len__(self) -> int:
        return len(self.jobs)

    def fence(self) -> None:
        """CUDA: order the coming `run(fenced=True)` after the current stream's work so
        far, not after what is issued between (no-op on CPU)."""
        if self._cuda is not None:
            self._cuda.fence()

    @property
    def replays(self) -> bool:
        """CUDA: the launch is a captured graph now (from its second run on), which
        `run_inline` can replay on the current stream."""
        return self._cuda is not None and self._cuda.replays

    def run_inline(self) -> int:
        """`run` on the current stream itself (the captured graph replayed there: no side
        stream, no fence, no join); only once `replays`. Returns the bytes written."""
        self._cuda.replay_inline()
        return self.nbytes

    def run(self, *, join: bool = True, fenced: bool = False) -> int:
        """Quantize every job; returns the bytes written (fp8 + scales + the copies the
        launch makes). On CUDA the
        launch goes on a side stream; ``join=False`` leaves the current stream free to
        run other copies meanwhile (the caller synchronizes the device before use);
        ``fenced``: ordered by the last `fence` instead of by everything issued so far."""
        if self._cuda is not None:
            self._cuda.run(join=join, fenced=fenced)
        else:
            for src, q, s in self.jobs:
                quantize_into(src, q, s, self.block)
        return self.nbytes

    def join(self, device: torch.device) -> None:
        """CUDA: order the current stream after the side stream a `run` used (an event,
        no device-wide sync)."""
        if self.jobs and device.type == "cuda":
            from policyworker.ops.fp8_triton import _side_stream

            torch.cuda.current_stream(device).wait_stream(_side_stream(device))

    def note(self, torch_copies: int) -> str | None:
        if not self.jobs:
            return None
        return f"fp8 launch copies {self.copy_bytes} bytes, torch copies {torch_copies}"


def quant_job(plan, c, src_local: torch.Tensor, dst_tensors: Mapping[str, torch.Tensor]):
    """``(src, q, s)`` views of quantized copy ``c``: its source box in ``src_local``
    and its destination box and scale blocks in the receiver's tensors."""
    block = plan.body.dest_format.block
    name, sname = _fp8_names(plan, c, dst_tensors)
    br, bc = fp8.blocks(c.start, c.stop, block)
    sr, sc = fp8.scale_at(plan, c)
    return (_region(src_local, c.src_at, c.start, c.stop), _region(dst_tensors[name], c.dst_at, c.start, c.stop),
            dst_tensors[sname].narrow(0, sr, br).narrow(1, sc, bc))
