"""nccl_reshard's schedule: every message of a refit, in the one global order both sides
issue them (``(round, src, dst)``: headers first, then buckets), how a transfer is cut
into messages (a function of the plan alone, so both ends agree), where a message's
bytes can go straight from or into the tensors (a contiguous span of one storage, kept
across refits while the tensors stay put), and the header rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policyworker.layout.apply import _region, bucket_copies, copy_moves, copy_nbytes
from policyworker.layout.parallelism import Parallelism
from policyworker.layout.plan import Copy, ReshardPlan
from policyworker.transports.base import TransportContext

__all__ = ["plan_hash63", "stage_members"]  # and the transport's private helpers (underscored)

_HEADER_MAGIC = 0x5057524546495431  # "PWREFIT1"
_HEADER_LEN = 6  # magic, version, nbytes, nbuckets, plan hash (63 bits), checksum flag
_TAG_HEADER = 0


def stage_members(plan: ReshardPlan) -> list[list[int]]:
    """Training ranks of each pipeline stage, in group order (the plan's rank map)."""
    train = plan.body.train
    if train:
        par = Parallelism(**train)
        return [list(par.stage_ranks(s)) for s in range(par.pp)]
    return [list(range(plan.body.train_world_size))]


def plan_hash63(plan: ReshardPlan) -> int:
    return int.from_bytes(bytes.fromhex(plan.hash)[:8], "little") & (2**63 - 1)


@dataclass(slots=True)
class _Msg:
    """One point-to-point message of a refit (header or bucket)."""

    key: tuple[int, int, int]  # (round, src, dst): the global issue order
    group: Any  # CommGroup
    peer: int  # the other end's rank in ``group``
    tag: int
    copies: list[Copy] | None  # None: header
    nbytes: int
    relay: str | None = None  # "send" / "recv": a fan-out message of a relayed refit (relay.py)
    dep: tuple[int, int, int] | None = None  # a fan-out send: the bulk message it forwards


def _schedule(plan: ReshardPlan, ctx: TransportContext, bucket_bytes: int,
              caps: Mapping[tuple[int, int], int] | None = None) -> list[_Msg]:
    """This rank's messages in global key order (the same order on every rank).

    ``caps``: a smaller message size for some (src, dst) pairs (the transfers into a
    relaying entry, :mod:`.relay`); the same on every rank."""
    members = stage_members(plan)
    msgs: list[_Msg] = []
    if ctx.role == "send":
        stage = ctx.state["stage"]
        group = ctx.state["group"]
        n_train = len(members[stage])
        transfers = [t for t in plan.sends(ctx.rank) if t.stage == stage]
        peer_of = lambda t: n_train + t.dst  # noqa: E731
        group_of = lambda t: group  # noqa: E731
    else:
        groups = ctx.state["groups"]
        transfers = plan.receives(ctx.rank)
        peer_of = lambda t: members[t.stage].index(t.src)  # noqa: E731
        group_of = lambda t: groups[t.stage]  # noqa: E731
    for t in transfers:
        buckets = _buckets(plan, t.all_copies(), (caps or {}).get((t.src, t.dst), bucket_bytes))
        g, peer = group_of(t), peer_of(t)
        msgs.append(_Msg((-1, t.src, t.dst), g, peer, _TAG_HEADER, None, len(buckets)))
        for r, bucket in enumerate(buckets):
            nbytes = sum(copy_nbytes(plan, c) for c in bucket)
            msgs.append(_Msg((r, t.src, t.dst), g, peer, r + 1, bucket, nbytes))
    msgs.sort(key=lambda m: m.key)
    return msgs


# A copy of 1 MiB or more travels as its own message, so that each side can move it
# straight from / into the tensor when its region is contiguous there (no staging
# copy); smaller copies share packed buckets (fewer messages).
_OWN_MESSAGE_MIN_BYTES = 1 << 20


def _buckets(plan: ReshardPlan, copies: list[Copy], bucket_bytes: int) -> list[list[Copy]]:
    """Messages of one transfer: big copies alone (split to ``bucket_bytes``), small ones packed.

    A function of the plan alone, so sender and receiver agree; whether a message then
    goes direct or through staging is each side's own choice (the bytes are the same).
    """
    out: list[list[Copy]] = []
    small: list[Copy] = []
    for c in copies:
        if copy_nbytes(plan, c) >= _OWN_MESSAGE_MIN_BYTES:
            if small:
                out += bucket_copies(plan, small, bucket_bytes)
                small = []
            out += [[part] for bucket in bucket_copies(plan, [c], bucket_bytes) for part in bucket]
        else:
            small.append(c)
    if small:
        out += bucket_copies(plan, small, bucket_bytes)
    return out


def _direct_view(plan: ReshardPlan, copies: list[Copy], tensors: Mapping[str, torch.Tensor], side: str):
    """The message's bytes as one contiguous span of local memory, or None.

    True when every copy's region is contiguous and each starts where the previous
    one ended, in one storage: a single copy of a row block, or consecutive tensors
    of a flat buffer (the rollout allocates its tensors that way, in plan order).
    Then the message goes straight from / into the tensors: no staging copy.
    """
    if any(plan.dest_format.converts(plan, c) for c in copies):
        return None  # converted copies are packed (sender) / unpacked (receiver) by their format
    names = plan.body.tensor_names
    storage = None
    start = end = 0
    for c in copies:
        t = tensors.get(names[c.src_tensor] if side == "src" else names[c.dst_tensor])
        if t is None:
            return None
        view = _region(t, c.src_at if side == "src" else c.dst_at, c.start, c.stop)
        if not view.is_contiguous():
            return None
        nbytes = view.numel() * view.element_size()
        if nbytes == 0:
            continue
        st = view.untyped_storage()
        ptr = view.data_ptr()
        if storage is None:
            storage, base, start = st, st.data_ptr(), ptr
        elif st.data_ptr() != base or ptr != end:
            return None
        end = ptr + nbytes
    if storage is None:
        return None
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start - base, (end - start,), (1,))


def _header_rows(ctx: TransportContext, version: int, checksum: bool, schedule: list[_Msg]) -> dict[int, torch.Tensor]:
    """Every header of this refit (schedule index → row), made before the window opens.

    On CUDA one pinned host tensor goes to the device in one asynchronous copy on the
    transport's stream: a header made per message from a Python list would be a
    pageable copy, which waits for the stream, inside the send window.
    """
    hash63 = plan_hash63(ctx.state.get("bulk_plan") or ctx.plan)
    totals = ctx.state["pair_bytes"]
    index = [i for i, m in enumerate(schedule) if m.copies is None]
    rows = torch.tensor([[_HEADER_MAGIC, version, totals.get((schedule[i].key[1], schedule[i].key[2]), 0),
                          schedule[i].nbytes, hash63, int(checksum)] for i in index] or [[0] * _HEADER_LEN],
                        dtype=torch.int64)
    dev = schedule[index[0]].group.device if index else torch.device("cpu")
    if dev.type == "cuda":
        rows = rows.pin_memory().to(dev, non_blocking=True)
    return {i: rows[j] for j, i in enumerate(index)}


def _header_inbox(ctx: TransportContext, schedule: list[_Msg]) -> dict[int, torch.Tensor]:
    """Receive buffers of every header (schedule index → row of one tensor per device)."""
    index = [i for i, m in enumerate(schedule) if m.copies is None]
    dev = schedule[index[0]].group.device if index else torch.device("cpu")
    rows = torch.zeros((max(1, len(index)), _HEADER_LEN), dtype=torch.int64, device=dev)
    return {i: rows[j] for j, i in enumerate(index)}


class _DirectSpans:
    """``_direct_view`` of every message, kept across refits while the tensors stay put;
    likewise the byte views that pack / unpack a staged message (:func:`copy_moves`).

    Working a message's span out walks its copies (views, strides, storages): tens of
    microseconds a copy, every refit, on a CPU that is moving the bytes meanwhile. The
    answer depends only on the plan and where the local tensors (and the staging ring)
    live, so it is kept and reused while every tensor keeps its storage address, shape,
    strides and dtype (checked each refit, ~1 µs a tensor). A message of many small
    copies (a LoRA adapter's factors) is then one ``_foreach_copy_`` of kept views.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._spans: dict[int, torch.Tensor | None] = {}
        self._moves: dict[tuple[tuple[int, int, int], int], tuple[list[torch.Tensor], list[torch.Tensor]] | None] = {}

    def get(self, plan: ReshardPlan, index: int, copies: list[Copy], tensors: Mapping[str, torch.Tensor],
            side: str) -> torch.Tensor | None:
        if index not in self._spans:
            self._spans[index] = _direct_view(plan, copies, tensors, side)
        return self._spans[index]

    def moves(self, plan: ReshardPlan, msg_key: tuple[int, int, int], slot: int, copies: list[Copy],
              tensors: Mapping[str, torch.Tensor], buf: torch.Tensor, side: str) -> bool:
        """Pack (``side="src"``: tensors into ``buf``) or unpack (``"dst"``) the message of key
        ``msg_key`` staged in ring slot ``slot`` through kept views; False when it cannot (the caller
        packs / unpacks it the long way)."""
        key = (msg_key, slot)
        if key not in self._moves:
            self._moves[key] = copy_moves(plan, copies, tensors, buf, side)
        pairs = self._moves[key]
        if pairs is None:
            return False
        torch._foreach_copy_(*pairs)
        return True

    def check(self, plan: ReshardPlan, tensors: Mapping[str, torch.Tensor],
              ring: list[torch.Tensor] | None = None) -> _DirectSpans:
        key = (plan.hash, tuple((n, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for n, t in tensors.items()),
               tuple(r.data_ptr() for r in ring or ()))
        if key != self._key:
            self._key, self._spans, self._moves = key, {}, {}
        return self
