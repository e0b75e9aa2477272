"""The receiving side of one nccl_reshard refit's bulk: headers, buckets, direct receives.

Split from the transport (``transport.py``) for size; ``t`` is the transport (its
window, ring buffers, checksum setting and deadline).
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Any

import torch

from policyworker.errors import PeerLost, PlanMismatch, PolicyWorkerError, ProtocolError, TransportError
from policyworker.layout.apply import unpack
from policyworker.transports.base import TransportContext
from policyworker.transports.nccl_reshard.schedule import (
    _HEADER_MAGIC, _DirectSpans, _direct_view, _Msg, _header_inbox, plan_hash63,
)

__all__ = ["bucket_crc", "recv_bulk"]


def bucket_crc(buf: torch.Tensor) -> int:
    """crc32 of a bucket's bytes (``checksum=True``: the sender appends it, the receiver checks it)."""
    data = buf if buf.device.type == "cpu" else buf.cpu()
    return zlib.crc32(memoryview(data.numpy())) & 0x7FFFFFFF


def _completed(work: Any) -> bool:
    """Whether ``work`` delivered its bytes: a gloo work is a future (``CommGroup``'s
    waiter completes it), an NCCL work answers ``is_completed``."""
    is_completed = getattr(work, "is_completed", None)
    if is_completed is None:  # a group's completion future (gloo point-to-point)
        return work.done() and not work.cancelled() and work.exception() is None
    try:
        return bool(is_completed())
    except RuntimeError:  # an aborted work: it delivered nothing more
        return False


class _OnDemand:
    """``ctx.landing``'s bookkeeping for one refit: which messages write which destinations,
    when a placeholder must be opened (before its first message is posted) and when a
    destination has landed (its last message done). ``params`` becomes a copy that the
    opened tensors join, so the caller's mapping keeps its placeholders."""

    def __init__(self, landing: Any, plan: Any, schedule: list[_Msg], params: Any, rank: int) -> None:
        self.landing, self.rank = landing, rank
        self.params = dict(params)
        names = plan.body.tensor_names
        self.writes: dict[int, tuple[str, ...]] = {}
        self.left: dict[str, int] = {}
        for i, m in enumerate(schedule):
            if m.copies is None:
                continue
            side = (lambda c: c.src_tensor) if m.relay == "send" else (lambda c: c.dst_tensor)
            touched = tuple(n for n in dict.fromkeys(names[side(c)] for c in m.copies) if n in self.params)
            self.writes[i] = touched
            for name in touched:
                self.left[name] = self.left.get(name, 0) + 1
        self.placeholders = {n for n, t in self.params.items() if t.is_meta}
        self.bytes_open = 0  # opened, not landed yet

    def bytes_to_open(self, i: int) -> int:
        """What opening message ``i``'s placeholders would add to :attr:`bytes_open`."""
        return sum(self.params[n].nbytes for n in self.writes.get(i, ())
                   if n in self.placeholders and self.params[n].is_meta)

    def on_demand(self, i: int) -> bool:
        """Whether message ``i`` reads or writes a destination made on demand."""
        return any(n in self.placeholders for n in self.writes.get(i, ()))

    def writes_live(self, i: int) -> bool:
        """Whether message ``i`` writes a destination the rollout serves as it is (not a
        placeholder: an opened tensor is the consumer's until it is handed over)."""
        return any(n not in self.placeholders for n in self.writes.get(i, ()))

    def open(self, i: int) -> None:
        """Open the placeholders message ``i`` writes (before it is posted)."""
        for name in self.writes.get(i, ()):
            if name in self.placeholders and self.params[name].is_meta:
                self.params[name] = self._call("open", name)
                self.bytes_open += self.params[name].nbytes

    def opened(self, i: int) -> bool:
        return not any(self.params[n].is_meta for n in self.writes.get(i, ()) if n in self.params)

    def done(self, i: int, ctx: TransportContext) -> None:
        """Message ``i`` is in place: hand over each destination it completed."""
        for name in self.writes.get(i, ()):
            self.left[name] -= 1
            if self.left[name] == 0:
                ctx.touched = True  # the consumer may install it live
                if name in self.placeholders:
                    self.bytes_open -= self.params[name].nbytes
                self._call("landed", name)

    def _call(self, what: str, name: str) -> Any:
        try:
            return getattr(self.landing, what)(name)
        except PolicyWorkerError:
            raise
        except Exception as exc:  # the consumer's own code (allocation, post-processing)
            step = "open a destination for" if what == "open" else "take over the landed"
            raise TransportError(f"rollout rank {self.rank}: the landing could not {step} {name!r}: "
                                 f"{type(exc).__name__}: {exc}", rank=self.rank, param=name) from exc


def recv_bulk(t: Any, ctx: TransportContext):
    """Receive every scheduled message; returns (bytes, buckets, version, failure).

    A protocol failure (bad header, checksum) does not stop the loop: the rest is
    drained into the ring without touching the weights, so the senders finish and
    every rank reaches the verdict round, where the failure is shared. A trainer
    that is gone (``PeerLost``) is skipped the same way, and so is a relay peer.

    A relayed refit's fan-out messages (:mod:`.relay`) are in the same schedule, in
    the same order; the bytes returned count them (the bulk check does not).

    With ``ctx.landing`` (:class:`_OnDemand`), a placeholder destination is opened just
    before the first message that writes it is posted, and every destination is handed
    over once its last message is done; a failure there (the consumer's allocation or
    post-processing) is this rank's failure, drained like the others. Messages that
    touch an on-demand destination never use the kept spans (their tensors are new).
    What is open at once stays within the ring's bytes (``staging`` × ``bucket_bytes``):
    before opening more, the oldest messages are completed (so earlier destinations are
    handed over); a message whose own destinations exceed that opens alone.
    """
    from policyworker.transports.nccl_reshard.relay import land_fanout, post_fanout

    plan, params, ring = ctx.state.get("bulk_plan") or ctx.plan, ctx.params, ctx.state["ring"]
    deadline = t._deadline(ctx)
    hash63 = plan_hash63(plan)
    schedule = ctx.state["schedule"]
    inbox = _header_inbox(ctx, schedule)
    spans = ctx.state.setdefault("direct_spans", _DirectSpans()).check(plan, params, ring)
    demand = _OnDemand(ctx.landing, plan, schedule, params, ctx.rank) if ctx.landing is not None else None
    if demand is not None:
        params = demand.params
    pending: deque = deque()  # (work, msg, tensor, slot or None), key order
    batch: list = []
    free = list(range(len(ring)))
    total = buckets = 0
    version: int | None = None
    failure: ProtocolError | PlanMismatch | PeerLost | None = None
    lost: set[int] = set()  # gone senders: trainers (their rank), relays (train_world_size + rank)
    lost_dst: set[int] = set()  # gone fan-out receivers
    done: set[tuple] = set()  # keys of messages completed or skipped (a fan-out send waits for its bulk)
    relayed = 0
    expected = ctx.state["pair_bytes"]
    # Torn accounting: a receive posted straight into a live tensor can be written only
    # after its sender started this refit, i.e. after that sender's header arrived (one
    # ordered connection per pair). So "touched" = a direct receive from a sender whose
    # header completed — not merely posted: a refit that never came leaves v-1 intact.
    direct_srcs: set[int] = set()
    headers_seen: set[int] = set()

    def check_header(m: _Msg, tensor: torch.Tensor) -> None:
        nonlocal version
        row = m.group.read(tensor, deadline=deadline, what="reading a refit header")
        magic, v, nbytes, nb, h, ck = (int(x) for x in row.tolist())
        src = m.key[1]
        if magic != _HEADER_MAGIC:
            raise ProtocolError(f"bad refit header from train rank {src}", rank=ctx.rank, transport=t.name)
        if h != hash63:
            raise PlanMismatch(f"train rank {src} sends by another plan", rank=ctx.rank, transport=t.name)
        want = expected.get((src, m.key[2]), 0)
        if nbytes != want or nb != m.nbytes or ck != int(t.checksum):
            raise ProtocolError(
                f"train rank {src} announces {nbytes} B in {nb} buckets; expected {want} B in {m.nbytes}",
                rank=ctx.rank, transport=t.name,
            )
        if version is None:
            version = v
        elif v != version:
            raise ProtocolError(f"train ranks disagree on the version ({version} vs {v})",
                                rank=ctx.rank, transport=t.name)

    def open_for(i: int) -> bool:
        """Open message ``i``'s on-demand destinations; False (and the failure kept) if it cannot."""
        nonlocal failure
        if demand is None or failure is not None:
            return demand is None or demand.opened(i)
        try:
            demand.open(i)
        except PolicyWorkerError as exc:
            failure = exc
        return demand.opened(i)

    def finish() -> None:
        nonlocal total, buckets, failure, relayed
        work, m, tensor, slot = pending.popleft()
        index = positions[id(m)] if demand is not None else -1
        try:
            m.group.wait(work, deadline=deadline, what="relay fan-out" if m.relay else "reshard receive")
        except PeerLost as exc:
            if m.relay == "send":
                lost_dst.add(m.key[2])
            else:
                lost.add(m.key[1])
            failure = failure if isinstance(failure, PeerLost) else exc
        done.add(m.key)
        if slot is not None:
            free.append(slot)
        if failure is not None:
            return  # draining: bytes are discarded
        if m.relay is not None:
            if m.relay == "recv":
                ctx.touched = True  # live bytes from here on
                land_fanout(m, tensor, params, plan)
                relayed += m.nbytes
            hand_over(index)
            return
        try:
            if m.copies is None:
                headers_seen.add(m.key[1])
                if m.key[1] in direct_srcs:
                    ctx.touched = True
                check_header(m, tensor)
                return
            if slot is not None:
                if t.checksum:
                    got = int(tensor.narrow(0, m.nbytes, 8).view(torch.int64).item())
                    if got != bucket_crc(tensor.narrow(0, 0, m.nbytes)):
                        raise ProtocolError(
                            f"checksum mismatch in bucket {m.key[0]} from train rank {m.key[1]}",
                            rank=ctx.rank, transport=t.name,
                        )
                if demand is None or demand.writes_live(index):
                    ctx.touched = True  # (an opened tensor is not served before its hand-over)
                if (demand is not None and demand.on_demand(index)) \
                        or not spans.moves(plan, m.key, slot, m.copies, params, tensor, "dst"):
                    unpack(plan, m.copies, tensor, params)
        except (ProtocolError, PlanMismatch) as exc:
            failure = exc
            return
        total += m.nbytes
        buckets += 1
        hand_over(index)

    def hand_over(index: int) -> None:
        nonlocal failure
        if demand is None or failure is not None:
            return
        try:
            demand.done(index, ctx)
        except PolicyWorkerError as exc:
            failure = exc

    positions = {id(m): i for i, m in enumerate(schedule)} if demand is not None else {}
    budget = max(1, len(ring)) * t.bucket_bytes
    try:
        for i, m in enumerate(schedule):
            if m.relay is not None:
                if (m.key[2] in lost_dst) if m.relay == "send" else (m.key[1] in lost):
                    done.add(m.key)
                    continue
                if batch:
                    t._post(batch, "recv", pending)  # every earlier key is posted first
                while pending and len(pending) >= t.in_flight:
                    finish()
                while m.dep is not None and m.dep not in done and pending:
                    finish()  # a send forwards bytes that must have landed
                try:
                    if open_for(i):
                        work, buf = post_fanout(m, params, plan)
                    else:  # a destination that could not open: the peer still gets its bytes' worth
                        buf = torch.zeros(m.nbytes, dtype=torch.uint8, device=m.group.device)
                        work = (m.group.isend if m.relay == "send" else m.group.irecv)(buf, m.peer, tag=m.tag)
                except PeerLost as exc:  # gloo refuses a send to a peer already gone
                    (lost_dst if m.relay == "send" else lost).add(m.key[2] if m.relay == "send" else m.key[1])
                    failure = failure if isinstance(failure, PeerLost) else exc
                    done.add(m.key)
                    continue
                pending.append((work, m, buf, None))
                continue
            if m.key[1] in lost:
                done.add(m.key)
                continue
            kind = m.copies is not None
            t._make_room(batch, pending, kind, "recv", finish)
            if not kind:
                batch.append((m, inbox[i], None))
                continue
            fresh = demand is not None and demand.on_demand(i)
            if fresh and failure is None:
                need = demand.bytes_to_open(i)
                while need and failure is None and demand.bytes_open + need > budget and (pending or batch):
                    if batch:
                        t._post(batch, "recv", pending)
                    finish()  # hands earlier destinations over
            if not open_for(i) or t.checksum or failure is not None:
                direct = None
            elif fresh:  # new tensors each refit: worked out now, never kept
                direct = _direct_view(plan, m.copies, params, "dst")
            else:
                direct = spans.get(plan, i, m.copies, params, "dst")
            if direct is not None and ring and direct.device != ring[0].device:
                direct = None  # a destination off the comm device (host staging): through a bucket
            if direct is not None:
                if demand is None or demand.writes_live(i):  # into an opened tensor: not live yet
                    direct_srcs.add(m.key[1])
                    if m.key[1] in headers_seen:
                        ctx.touched = True  # bytes land in the live tensor from here on
                batch.append((m, direct, None))
            else:
                if not free:
                    t._post(batch, "recv", pending)
                    while not free:
                        finish()
                slot = free.pop()
                batch.append((m, t._buffer(ctx, slot, m.nbytes + (8 if t.checksum else 0)), slot))
        if batch:
            t._post(batch, "recv", pending)
        while pending:
            finish()
    finally:
        # Cut short (abort, deadline): a header that arrived but was not looked at yet
        # still means its sender's bytes may be landing.
        for work, m, _t, _slot in pending:
            if m.copies is None and _completed(work):
                headers_seen.add(m.key[1])
        if direct_srcs & headers_seen:
            ctx.touched = True
    want = sum(expected.values())
    if failure is None and total != want:
        failure = ProtocolError(f"refit received {total} of {want} bytes", rank=ctx.rank, transport=t.name)
    return total + relayed, buckets, version, failure
