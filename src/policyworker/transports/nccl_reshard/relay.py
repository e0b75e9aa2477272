"""Relays for nccl_reshard: each byte crosses into a node once, then fans out inside it.

When the ranks of a refit span nodes, `connect` gathers every rank's node over the
update group (``POLICYWORKER_NODE``, else the host name; the same list on every rank)
and routes the plan by node (:func:`policyworker.layout.topology.relay_routes`). If
any copy would reach a node more than once, the refit runs in two phases on the same
groups and under the same deadline and verdict:

1. **bulk**: the *first-hop plan* — the plan's copies, each class sent once into each
   node that needs it, to that node's *entry* rank (a generation rank that needs the
   bytes itself, so they land in its own destination tensors). It is an ordinary
   `ReshardPlan` (its own hash, checked by every rank's headers) run by the usual
   schedule.
2. **fan-out**: each entry forwards what it received to the ranks of its node that need
   it, point to point over stage 0's group (it holds every generation rank), in one
   global order ``(route, chunk, destination)`` that every rank derives from the
   routes, with at most ``in_flight`` messages outstanding and chunks of at most
   ``bucket_bytes`` (bounded staging). A relay that dies is a lost peer: the fan-out
   receivers' works fail or time out, and the verdict star makes every rank raise.

A fan-out receiver writes live bytes, so it is *touched* from its first chunk on (a
failure then leaves it torn, as a direct receive would).
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from policyworker.layout.apply import _region
from policyworker.layout.plan import Copy, PlanBody, ReshardPlan, Transfer, dtype_size
from policyworker.layout.topology import RelayRoutes, relay_routes

__all__ = ["NODE_ENV", "Fanout", "gather_nodes", "node_name", "relay_setup", "run_fanout"]

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
    """One fan-out message: ``nbytes`` of ``copy``'s rows [row0, row1) from ``entry`` to ``dst``."""

    key: tuple[int, int, int]
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


def _fanouts(plan: ReshardPlan, routes: RelayRoutes, dst_side: dict, bucket_bytes: int) -> list[Fanout]:
    """Every fan-out message of the refit, in global key order (the same on every rank)."""
    out: list[Fanout] = []
    params = plan.params
    for i, r in enumerate(routes.routes):
        if not r.fanout:
            continue
        key = (r.param, r.start, r.stop)
        src_tensor, src_at = dst_side[(key, r.entry)]
        row = _box_bytes((0, *r.start[1:]), (1, *r.stop[1:]), params[r.param].dtype)
        rows_per = max(1, bucket_bytes // max(1, row))
        for k, row0 in enumerate(range(r.start[0], r.stop[0], rows_per)):
            row1 = min(r.stop[0], row0 + rows_per)
            start, stop = (row0, *r.start[1:]), (row1, *r.stop[1:])
            shift = row0 - r.start[0]
            for d in r.fanout:
                d_tensor, d_at = dst_side[(key, d)]
                c = Copy(r.param, start, stop, src_tensor, (src_at[0] + shift, *src_at[1:]),
                         d_tensor, (d_at[0] + shift, *d_at[1:]))
                out.append(Fanout((i, k, d), r.entry, d, c, row * (row1 - row0)))
    return out


def relay_setup(plan: ReshardPlan, train_nodes: Sequence[int], gen_nodes: Sequence[int],
                bucket_bytes: int) -> tuple[ReshardPlan, list[Fanout]] | None:
    """The first-hop plan and the fan-out messages, or None when nothing would be relayed."""
    if not plan.dest_format.passthrough:
        return None  # the sender converts copies (quantizes them, say): no bytes to forward as they are
    routes = relay_routes(plan, list(train_nodes), list(gen_nodes))
    if not routes.relayed_bytes:
        return None
    src_side, dst_side = _index(plan)
    return _first_hop_plan(plan, routes, src_side, dst_side), _fanouts(plan, routes, dst_side, bucket_bytes)


def run_fanout(fanouts: Sequence[Fanout], rank: int, group, n_stage_trainers: int,
               params: dict[str, torch.Tensor], plan: ReshardPlan, in_flight: int, deadline: float,
               on_touch) -> int:
    """This generation rank's part of the fan-out; returns the bytes it received.

    Posts its messages in global key order with at most ``in_flight`` outstanding: the
    smallest pending message is then posted on both of its ends, so it completes.
    """
    names = plan.body.tensor_names
    mine = [f for f in fanouts if f.entry == rank or f.dst == rank]
    pending: list[tuple] = []
    received = 0

    def settle(item) -> int:
        work, f, buf = item
        group.wait(work, deadline=deadline, what="relay fan-out")
        if f.dst == rank:
            view = _region(params[names[f.copy.dst_tensor]], f.copy.dst_at, f.copy.start, f.copy.stop)
            on_touch()
            view.copy_(buf.view(view.dtype).view(view.shape))
            return f.nbytes
        return 0

    for f in mine:
        if len(pending) >= in_flight:
            received += settle(pending.pop(0))
        peer = n_stage_trainers + (f.dst if f.entry == rank else f.entry)
        if f.entry == rank:
            src = _region(params[names[f.copy.src_tensor]], f.copy.src_at, f.copy.start, f.copy.stop)
            buf = src.contiguous().view(-1).view(torch.uint8)
            work = group.isend(buf, peer, tag=_TAG_FANOUT)
        else:
            buf = torch.empty(f.nbytes, dtype=torch.uint8, device=group.device)
            work = group.irecv(buf, peer, tag=_TAG_FANOUT)
        pending.append((work, f, buf))
    while pending:
        received += settle(pending.pop(0))
    return received
