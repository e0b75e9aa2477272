"""Relays for nccl_reshard: each byte crosses into a node once, then fans out inside it.

When the ranks of a refit span nodes, `connect` gathers every rank's node over the
update group (``POLICYWORKER_NODE``, else the host name; the same list on every rank)
and routes the plan by node (:func:`policyworker.layout.topology.relay_routes`). If
any copy would reach a node more than once, the refit runs the *first-hop plan* — the
plan's copies, each class sent once into each node that needs it, to that node's
*entry* rank (a generation rank that needs the bytes itself, so they land in its own
destination tensors); an ordinary `ReshardPlan` with its own hash, checked by every
rank's headers — and each entry forwards what it received to the ranks of its node
that need it, point to point over stage 0's group (it holds every generation rank),
under the same deadline and verdict.

**Pipelined.** The entry forwards each piece as soon as the bulk message that carries
it has landed, not after the whole bulk: a fan-out message is cut exactly like the
bulk's pieces of that class (``bucket_copies``: one piece per bucket-sized row block),
so each one depends on exactly one bulk message into its entry. The messages into an
entry whose classes fan out to at most ``k`` ranks are cut to ``bucket_bytes // k``
(:func:`~policyworker.layout.topology.relay_message_bytes`): the entry's last message,
forwarded once to each of ``k`` ranks after everything else came in, then costs at
most one bucket on its intra-node port — the relays' drain, which nothing overlaps.

**One global order, deadlock-free.** Every message of the refit has a key: a bulk
message ``(round, src, dst)`` (trainer ranks as ``src``), a fan-out message
``(round, train_world_size + entry, dst, route, piece)`` where ``round`` is the round
of the bulk message it depends on. So a fan-out message comes after its dependency and
after every bulk message of that round. Every rank issues its own messages (bulk
receives, fan-out sends and receives) in key order, with at most ``in_flight``
outstanding, completing the oldest first; before an entry posts a fan-out send, it
completes messages (oldest first) until that send's dependency has landed. Take the
smallest key ``m`` not yet complete, anywhere: each end of ``m`` has completed every
one of its messages with a smaller key, so neither end waits on anything before ``m``
(its window's oldest message is ``m`` or later, and ``m``'s dependency, a smaller key,
is complete): both post ``m`` and it completes. Hence every message completes.

**Bounded staging.** A fan-out receive lands in a buffer of at most ``bucket_bytes``,
copied into the destination tensors when it completes; a send reads the entry's
tensors (a packed copy of at most ``bucket_bytes`` when the region is strided). With
the window, at most ``in_flight`` such chunks exist per rank.

**Failures.** A relay that dies is a lost peer: the receives it owed fail (or time out),
the survivors skip its remaining messages and the verdict star makes every rank raise.
A fan-out receiver writes live bytes, so it is *touched* from its first landed chunk
on (a failure then leaves it torn, as a direct receive would).
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from policyworker.layout.apply import _region, bucket_copies
from policyworker.layout.plan import Copy, PlanBody, ReshardPlan, Transfer, dtype_size
from policyworker.layout.topology import RelayRoutes, relay_message_bytes, relay_routes
from policyworker.transports.nccl_reshard.schedule import _buckets, _Msg

__all__ = ["NODE_ENV", "Fanout", "gather_nodes", "land_fanout", "merge_fanouts", "node_name", "post_fanout",
           "relay_setup"]

NODE_ENV = "POLICYWORKER_NODE"
_TAG_FANOUT = 1 << 20


def node_name() -> str:
    """This process's node: ``$POLICYWORKER_NODE`` if set (a test or a fabric's own
    naming), else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def gather_nodes(update_group, train_world_size: int, node: str, deadline: float
                 ) -> tuple[list[int], list[int]]:
    """Every rank's node id (crc32 of its name), trainers then generation ranks."""
    mine = torch.tensor([zlib.crc32(node.encode())], dtype=torch.int64, device=update_group.device)
    out = [torch.zeros(1, dtype=torch.int64, device=update_group.device) for _ in range(update_group.world_size)]
    update_group.all_gather(out, mine, deadline=deadline)
    ids = [int(t.item()) for t in out]
    return ids[:train_world_size], ids[train_world_size:]


@dataclass(frozen=True, slots=True)
class Fanout:
    """One fan-out message: ``copy`` (source: the entry's tensors; destination: ``dst``'s)
    of ``nbytes`` from ``entry`` to ``dst``, after the bulk message ``dep`` into the entry.
    ``key``: its place in the refit's global order (see the module docstring)."""

    key: tuple[int, ...]
    dep: tuple[int, int, int]
    entry: int
    dst: int
    copy: Copy
    nbytes: int


def _index(plan: ReshardPlan) -> tuple[dict, dict]:
    """(class, src) -> (stage, src_tensor, src_at); (class, dst) -> (dst_tensor, dst_at)."""
    src_side: dict = {}
    dst_side: dict = {}
    for t in plan.transfers:
        for c in t.all_copies():
            key = (c.param, tuple(c.start), tuple(c.stop))
            src_side.setdefault((key, t.src), (t.stage, c.src_tensor, tuple(c.src_at)))
            dst_side.setdefault((key, t.dst), (c.dst_tensor, tuple(c.dst_at)))
    return src_side, dst_side


def _first_hop_plan(plan: ReshardPlan, routes: RelayRoutes, src_side: dict, dst_side: dict) -> ReshardPlan:
    params = plan.params
    by_pair: dict[tuple[int, int, int], list[Copy]] = {}
    for r in routes.routes:
        key = (r.param, r.start, r.stop)
        stage, s_tensor, s_at = src_side[(key, r.src)]
        d_tensor, d_at = dst_side[(key, r.entry)]
        by_pair.setdefault((stage, r.src, r.entry), []).append(
            Copy(r.param, r.start, r.stop, s_tensor, s_at, d_tensor, d_at))
    transfers = []
    for (stage, src, dst), copies in sorted(by_pair.items()):
        nbytes = sum(_box_bytes(c.start, c.stop, params[c.param].dtype) for c in copies)
        transfers.append(Transfer(stage=stage, src=src, dst=dst, nbytes=nbytes, copies=copies))
    b = plan.body
    body = PlanBody(format=b.format, train=b.train, gen=b.gen, train_world_size=b.train_world_size,
                    gen_world_size=b.gen_world_size, gen_fused=b.gen_fused, params=b.params,
                    tensor_names=b.tensor_names, sources=b.sources, dests=b.dests, transfers=transfers,
                    dest_format=b.dest_format)
    return ReshardPlan(body)


def _box_bytes(start: Sequence[int], stop: Sequence[int], dtype: str) -> int:
    n = dtype_size(dtype)
    for a, b in zip(start, stop):
        n *= b - a
    return n


def _pieces(plan: ReshardPlan, c: Copy, bucket_bytes: int) -> list[Copy]:
    """``c`` cut as the bulk cuts it (the same row blocks, whatever bucket they travel in)."""
    return [p for bucket in bucket_copies(plan, [c], bucket_bytes) for p in bucket]


def _caps(routes: RelayRoutes, bucket_bytes: int) -> dict[tuple[int, int], int]:
    """(src, entry) -> message size of every transfer into a relaying entry."""
    fan = routes.entry_fanouts()
    return {(r.src, r.entry): relay_message_bytes(bucket_bytes, fan[r.entry])
            for r in routes.routes if r.entry in fan}


def _fanouts(first: ReshardPlan, routes: RelayRoutes, dst_side: dict, bucket_bytes: int,
             caps: dict[tuple[int, int], int]) -> list[Fanout]:
    """Every fan-out message of the refit, in global key order (the same on every rank)."""
    n_train = first.body.train_world_size
    entries = {r.entry for r in routes.routes if r.fanout}
    # Where each piece of each class lands in its entry's bulk: (entry, param, start, stop) -> bulk key.
    landed: dict[tuple, tuple[int, int, int]] = {}
    for t in first.transfers:
        if t.dst not in entries:
            continue
        for rnd, bucket in enumerate(_buckets(first, t.all_copies(), caps.get((t.src, t.dst), bucket_bytes))):
            for p in bucket:
                landed[(t.dst, p.param, tuple(p.start), tuple(p.stop))] = (rnd, t.src, t.dst)
    out: list[Fanout] = []
    for i, r in enumerate(routes.routes):
        if not r.fanout:
            continue
        key = (r.param, r.start, r.stop)
        src_tensor, src_at = dst_side[(key, r.entry)]
        for d in r.fanout:
            d_tensor, d_at = dst_side[(key, d)]
            whole = Copy(r.param, r.start, r.stop, src_tensor, src_at, d_tensor, d_at)
            for k, c in enumerate(_pieces(first, whole, caps.get((r.src, r.entry), bucket_bytes))):
                dep = landed[(r.entry, c.param, tuple(c.start), tuple(c.stop))]
                nbytes = _box_bytes(c.start, c.stop, first.params[c.param].dtype)
                out.append(Fanout((dep[0], n_train + r.entry, d, i, k), dep, r.entry, d, c, nbytes))
    out.sort(key=lambda f: f.key)
    return out


def relay_setup(plan: ReshardPlan, train_nodes: Sequence[int], gen_nodes: Sequence[int],
                bucket_bytes: int) -> tuple[ReshardPlan, list[Fanout], dict[tuple[int, int], int]] | None:
    """The first-hop plan, the fan-out messages and the message size of each (src, entry)
    pair that differs from ``bucket_bytes``; None when nothing would be relayed."""
    if not plan.dest_format.passthrough:
        return None  # the sender converts copies (quantizes them, say): no bytes to forward as they are
    routes = relay_routes(plan, list(train_nodes), list(gen_nodes))
    if not routes.relayed_bytes:
        return None
    src_side, dst_side = _index(plan)
    first = _first_hop_plan(plan, routes, src_side, dst_side)
    caps = _caps(routes, bucket_bytes)
    return first, _fanouts(first, routes, dst_side, bucket_bytes, caps), caps


def merge_fanouts(schedule: list[_Msg], fanouts: Sequence[Fanout], rank: int, group, n_stage_trainers: int
                  ) -> list[_Msg]:
    """This generation rank's bulk ``schedule`` with its fan-out messages merged in, in key order."""
    out = list(schedule)
    for f in fanouts:
        if rank not in (f.entry, f.dst):
            continue
        send = f.entry == rank
        out.append(_Msg(f.key, group, n_stage_trainers + (f.dst if send else f.entry), _TAG_FANOUT, [f.copy],
                        f.nbytes, relay="send" if send else "recv", dep=f.dep if send else None))
    out.sort(key=lambda m: m.key)
    return out


def post_fanout(m: _Msg, params: dict[str, torch.Tensor], plan: ReshardPlan):
    """Post fan-out message ``m``: (work, buffer). A send reads the entry's tensors (its
    dependency landed); a receive lands in a buffer of ``m.nbytes``."""
    c = m.copies[0]
    names = plan.body.tensor_names
    if m.relay == "send":
        src = _region(params[names[c.src_tensor]], c.src_at, c.start, c.stop)
        buf = src.contiguous().view(-1).view(torch.uint8)
        return m.group.isend(buf, m.peer, tag=m.tag), buf
    buf = torch.empty(m.nbytes, dtype=torch.uint8, device=m.group.device)
    return m.group.irecv(buf, m.peer, tag=m.tag), buf


def land_fanout(m: _Msg, buf: torch.Tensor, params: dict[str, torch.Tensor], plan: ReshardPlan) -> None:
    """Copy a completed fan-out receive into this rank's destination tensors."""
    c = m.copies[0]
    view = _region(params[plan.body.tensor_names[c.dst_tensor]], c.dst_at, c.start, c.stop)
    view.copy_(buf.view(view.dtype).view(view.shape))
