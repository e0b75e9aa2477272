"""Moving bytes by a plan: pack, unpack, and building expected shards.

Pure functions over torch tensors; the transports call `pack` on the sender and
`unpack` on the receiver, tests call `apply_plan` to run a whole plan in one
process. A transfer's message is its copies back to back (plan order, no padding),
each copy's box in row-major order — `pack` and `unpack` are each other's inverse.

Copies the plan's destination format converts (:mod:`.formats`) are its business: it
packs, unpacks and cuts them, and gives a rank its extra tensors; everything else is
moved here as raw bytes.

Views: a copy's region of a local tensor is ``narrow(d, at[d], stop[d] - start[d])``
per dim — one strided view, one ``copy_``, however many rows it spans. Messages are
raw bytes (``torch.uint8``) so mixed dtypes share a buffer without alignment rules.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from math import prod

import torch

from policyworker.config import torch_dtype
from policyworker.errors import PlanError
from policyworker.layout.plan import Copy, ReshardPlan, Transfer, dtype_size

__all__ = [
    "apply_plan",
    "bucket_copies",
    "copy_moves",
    "copy_nbytes",
    "dest_shards",
    "empty_local_tensors",
    "local_shape",
    "pack",
    "source_shards",
    "unpack",
]


def _region(t: torch.Tensor, at: Sequence[int], start: Sequence[int],
            stop: Sequence[int]) -> torch.Tensor:
    for d, (a, s, e) in enumerate(zip(at, start, stop)):
        t = t.narrow(d, a, e - s)
    return t


def _as_bytes(view: torch.Tensor) -> torch.Tensor:
    """``view`` reinterpreted as uint8 (last dim widened by the item size)."""
    if view.dim() == 0:
        view = view.reshape(1)
    if view.stride(-1) != 1:
        view = view.contiguous()
    return view.view(torch.uint8)


def copy_nbytes(plan: ReshardPlan, copy: Copy) -> int:
    """Wire bytes of ``copy`` (the format's count for a copy it converts)."""
    p = plan.params[copy.param]
    fmt = plan.dest_format
    if fmt.converts(plan, copy):
        return fmt.box_nbytes(copy.start, copy.stop, p.dtype)
    return prod(b - a for a, b in zip(copy.start, copy.stop)) * dtype_size(p.dtype)


def local_shape(plan: ReshardPlan, side: str, rank: int, name: str) -> tuple[int, ...]:
    """Shape of local tensor ``name`` on ``rank`` of ``side`` ("src" or "dst")."""
    t = plan.local_tensors(side, rank).get(name)
    if t is None:
        raise PlanError(f"rank {rank} has no {side} tensor {name!r}", rank=rank, param=name)
    return t.shape


def _lookup(local: Mapping[str, torch.Tensor], name: str, rank_hint: str) -> torch.Tensor:
    try:
        return local[name]
    except KeyError:
        raise PlanError(f"{rank_hint} local tensors lack {name!r}", param=name) from None


def pack(plan: ReshardPlan, copies: Sequence[Copy], local_tensors: Mapping[str, torch.Tensor],
         out: torch.Tensor, offset: int = 0) -> int:
    """Sender side: write each copy's source region into ``out`` (flat uint8) from
    byte ``offset`` on, back to back. Returns the offset after the last byte."""
    names, params, fmt = plan.body.tensor_names, plan.params, plan.dest_format
    for c in copies:
        if fmt.converts(plan, c):
            offset = fmt.pack_copy(plan, c, local_tensors, out, offset)
            continue
        src = _region(_lookup(local_tensors, names[c.src_tensor], "sender"),
                      c.src_at, c.start, c.stop)
        n = src.numel() * dtype_size(params[c.param].dtype)
        raw = _as_bytes(src)
        out.narrow(0, offset, n).view(raw.shape).copy_(raw)
        offset += n
    return offset


def unpack(plan: ReshardPlan, copies: Sequence[Copy], buf: torch.Tensor,
           local_tensors: MutableMapping[str, torch.Tensor], offset: int = 0) -> int:
    """Receiver side: the inverse of `pack`, writing into views of ``local_tensors``
    (which must be contiguous in their last dim). Returns the offset after the last byte."""
    names, params, fmt = plan.body.tensor_names, plan.params, plan.dest_format
    for c in copies:
        if fmt.converts(plan, c):
            offset = fmt.unpack_copy(plan, c, buf, local_tensors, offset)
            continue
        dst = _region(_lookup(local_tensors, names[c.dst_tensor], "receiver"),
                      c.dst_at, c.start, c.stop)
        n = dst.numel() * dtype_size(params[c.param].dtype)
        if dst.dim() == 0:
            dst = dst.reshape(1)
        if dst.stride(-1) != 1:
            raise PlanError(f"receiver tensor {names[c.dst_tensor]!r} is not contiguous in "
                            "its last dim", param=names[c.dst_tensor])
        raw = dst.view(torch.uint8)
        raw.copy_(buf.narrow(0, offset, n).view(raw.shape))
        offset += n
    return offset


def copy_moves(plan: ReshardPlan, copies: Sequence[Copy], local_tensors: Mapping[str, torch.Tensor],
               buf: torch.Tensor, side: str) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """What `pack` (``side="src"``) or `unpack` (``side="dst"``) of ``copies`` does, as
    (destinations, sources): pairs of byte views to copy, from byte 0 of ``buf`` on.

    Views only, so they can be kept and replayed (``torch._foreach_copy_``) while the
    tensors and ``buf`` stay put: the per-copy work of finding regions is done once.
    None when some copy cannot be a plain view (a format converts it, or a source
    region is strided in its last dim and `pack` would copy it first).
    """
    names, params, fmt = plan.body.tensor_names, plan.params, plan.dest_format
    dsts, srcs = [], []
    offset = 0
    for c in copies:
        if fmt.converts(plan, c):
            return None
        name = names[c.src_tensor] if side == "src" else names[c.dst_tensor]
        t = local_tensors.get(name)
        if t is None:
            return None
        region = _region(t, c.src_at if side == "src" else c.dst_at, c.start, c.stop)
        if region.dim() == 0:
            region = region.reshape(1)
        if region.stride(-1) != 1:
            return None
        raw = region.view(torch.uint8)
        n = region.numel() * dtype_size(params[c.param].dtype)
        wire = buf.narrow(0, offset, n).view(raw.shape)
        dsts.append(wire if side == "src" else raw)
        srcs.append(raw if side == "src" else wire)
        offset += n
    return dsts, srcs


def bucket_copies(plan: ReshardPlan, copies: Sequence[Copy], max_bytes: int) -> list[list[Copy]]:
    """Split ``copies`` into buckets of at most ``max_bytes`` (in order).

    A copy larger than ``max_bytes`` is cut along its first dim longer than one into
    row blocks that fit (a single row larger than ``max_bytes`` becomes its own
    bucket); a converted copy is cut where its format allows. Deterministic, so
    sender and receiver compute the same buckets.
    """
    if max_bytes < 1:
        raise PlanError(f"max_bytes must be positive, got {max_bytes}")
    buckets: list[list[Copy]] = []
    cur: list[Copy] = []
    used = 0
    for c in copies:
        for part in _split(plan, c, max_bytes):
            n = copy_nbytes(plan, part)
            if cur and used + n > max_bytes:
                buckets.append(cur)
                cur, used = [], 0
            cur.append(part)
            used += n
    if cur:
        buckets.append(cur)
    return buckets


def _split(plan: ReshardPlan, c: Copy, max_bytes: int) -> list[Copy]:
    if plan.dest_format.converts(plan, c):
        return plan.dest_format.split_copy(plan, c, max_bytes)
    n = copy_nbytes(plan, c)
    if n <= max_bytes:
        return [c]
    extents = [b - a for a, b in zip(c.start, c.stop)]
    dim = next((d for d, e in enumerate(extents) if e > 1), None)
    if dim is None:
        return [c]
    row = n // extents[dim]
    step = max(1, max_bytes // row)
    parts = []
    for lo in range(0, extents[dim], step):
        hi = min(extents[dim], lo + step)
        parts.append(Copy(c.param, _shift(c.start, dim, lo),
                          _shift(c.stop, dim, hi - extents[dim]),
                          c.src_tensor, _shift(c.src_at, dim, lo),
                          c.dst_tensor, _shift(c.dst_at, dim, lo)))
    return parts


def _shift(t: tuple[int, ...], dim: int, by: int) -> tuple[int, ...]:
    return t[:dim] + (t[dim] + by,) + t[dim + 1:]


def empty_local_tensors(plan: ReshardPlan, side: str, rank: int,
                        device: torch.device | str = "cpu", *, flat: bool = False) -> dict[str, torch.Tensor]:
    """Uninitialised local tensors of ``rank`` on ``side`` ("src"/"dst"), by local name.

    ``flat``: carve them out of one buffer, in the order the plan's copies first touch
    them (its transfers in order), each aligned to 64 bytes. Then the copies of one
    transfer tend to be adjacent in memory, and a transport can move them as one span.
    """
    specs = plan.local_tensors(side, rank)
    # a generation rank's tensors come with its format's extra ones (block scales, say)
    extra = plan.dest_format.extra_tensors(plan, rank, device) if side == "dst" else {}
    if not flat:
        return {**{name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device)
                   for name, t in specs.items()}, **extra}
    order: dict[str, None] = {}
    names = plan.body.tensor_names
    for t in (plan.sends(rank) if side == "src" else plan.receives(rank)):
        for c in t.all_copies():
            order.setdefault(names[c.src_tensor if side == "src" else c.dst_tensor], None)
    for name in specs:
        order.setdefault(name, None)
    sizes = {n: prod(specs[n].shape) * dtype_size(specs[n].dtype) for n in order}
    offsets, total = {}, 0
    for n in order:
        offsets[n] = total
        total += -(-sizes[n] // 64) * 64
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    return {**{n: buf.narrow(0, offsets[n], sizes[n]).view(torch_dtype(specs[n].dtype)).view(specs[n].shape)
               for n in order}, **extra}


def _shards(plan: ReshardPlan, side: str, rank: int,
            full_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params, fmt = plan.params, plan.dest_format
    out = {}
    for name, t in plan.local_tensors(side, rank).items():
        converted = fmt.converts_tensor(plan, t)
        dtype = params[t.pieces[0].param].dtype if converted and t.pieces else t.dtype
        local = torch.empty(t.shape, dtype=torch_dtype(dtype))
        for p in t.pieces:
            pname = params[p.param].name
            full = _lookup(full_state, pname, "full state")
            if tuple(full.shape) != params[p.param].shape or full.dtype != local.dtype:
                raise PlanError(f"full tensor {pname!r} is {tuple(full.shape)} {full.dtype}, "
                                f"the plan expects {params[p.param].shape} {local.dtype}",
                                param=pname)
            _region(local, p.at, p.start, p.stop).copy_(_region(full, p.start, p.start, p.stop))
        if converted:  # the format's oracle from the unconverted contents
            out.update(fmt.reference_local(plan, rank, name, local))
        else:
            out[name] = local
    return out


def source_shards(plan: ReshardPlan, src_rank: int,
                  full_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What training rank ``src_rank`` holds, cut from full (unsharded) tensors."""
    return _shards(plan, "src", src_rank, full_state)


def dest_shards(plan: ReshardPlan, dst_rank: int,
                full_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What generation rank ``dst_rank`` must hold after a refit (fused tensors fused)."""
    return _shards(plan, "dst", dst_rank, full_state)


def apply_plan(
    plan: ReshardPlan,
    source_local_by_rank: Mapping[int, Mapping[str, torch.Tensor]],
    dest_local_by_rank: Mapping[int, MutableMapping[str, torch.Tensor]],
) -> int:
    """Run every transfer in one process (pack into a buffer, unpack from it).

    Returns the bytes moved. Each transfer's buffer is exactly ``nbytes`` long: a
    plan whose byte accounting is off fails here, as it would on the wire.
    """
    moved = 0
    for t in plan.transfers:
        moved += _run(plan, t, source_local_by_rank[t.src], dest_local_by_rank[t.dst])
    return moved


def _run(plan: ReshardPlan, t: Transfer, src: Mapping[str, torch.Tensor],
         dst: MutableMapping[str, torch.Tensor]) -> int:
    buf = torch.empty(t.nbytes, dtype=torch.uint8)
    copies = t.all_copies()
    end = pack(plan, copies, src, buf)
    if end != t.nbytes or unpack(plan, copies, buf, dst) != t.nbytes:
        raise PlanError(f"transfer {t.stage}/{t.src}->{t.dst} packs {end} bytes, "
                        f"declares {t.nbytes}")
    return t.nbytes
