"""Topology-aware routes: each byte crosses into a node once, then fans out inside it.

`ReshardPlan` sends every generation rank its shard's bytes straight from a trainer.
When several generation ranks on one node need the same bytes (data-parallel
replicas, or kv heads replicated over tp), each of them pulls its own copy over the
node's network links. `relay_routes` routes the plan's copies by node instead:

* a copy class is one ``(param, box)`` of the plan with the generation ranks that need
  it and the training ranks that hold it (every source the plan used for it);
* per destination node, a class needed there is taken from a holder *on that node*
  when one exists (nothing crosses the network); otherwise it crosses once, from the
  holder whose outbound network load is smallest, to the *entry* rank of that node
  whose inbound load is smallest (so the bytes spread over the NICs of both nodes' ranks),
  and the entry relays it to the node's other ranks that need it (NVLink on GPUs,
  shared memory or loopback on CPU).

Objective: minimal cross-node bytes (each class at most once per destination node,
which no route can beat); tie-break: minimal total bytes (a rank receives a class
once, from one place). When every rank sits on one node the routes are the plan's
own transfers.

"Node" here is whatever shares the cheap links: a host (``POLICYWORKER_NODE`` or the
host name), or an NVLink domain in the fabric model (:mod:`.fabric`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from math import prod

from policyworker.errors import ConfigError
from policyworker.layout.plan import ReshardPlan, dtype_size

__all__ = ["Route", "RelayRoutes", "relay_message_bytes", "relay_routes"]


@dataclass(frozen=True, slots=True)
class Route:
    """One copy class into one node: ``src`` (training rank) sends ``nbytes`` once to
    ``entry`` (generation rank), which relays them to ``fanout``. ``cross`` says whether
    the first hop leaves the source's node."""

    param: int
    start: tuple[int, ...]
    stop: tuple[int, ...]
    nbytes: int
    src: int
    entry: int
    fanout: tuple[int, ...]
    cross: bool


@dataclass(slots=True)
class RelayRoutes:
    routes: list[Route] = field(default_factory=list)

    @property
    def cross_node_bytes(self) -> int:
        return sum(r.nbytes for r in self.routes if r.cross)

    @property
    def relayed_bytes(self) -> int:
        return sum(r.nbytes * len(r.fanout) for r in self.routes)

    def entry_fanouts(self) -> dict[int, int]:
        """Per relaying entry: the most ranks one of its classes fans out to."""
        fan: dict[int, int] = {}
        for r in self.routes:
            if r.fanout:
                fan[r.entry] = max(fan.get(r.entry, 0), len(r.fanout))
        return fan

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes * (1 + len(r.fanout)) for r in self.routes)

    def received_bytes(self, gen_world_size: int) -> list[int]:
        got = [0] * gen_world_size
        for r in self.routes:
            got[r.entry] += r.nbytes
            for d in r.fanout:
                got[d] += r.nbytes
        return got


#: The last plans' classes by plan hash: one plan's routes are asked for once per
#: fabric or node map (a MoE plan's walk takes seconds). Read-only to every caller.
_CLASSES_CACHE: dict[str, tuple] = {}
_CLASSES_KEEP = 2


def _classes(plan: ReshardPlan) -> tuple[dict[tuple[int, tuple[int, ...], tuple[int, ...]],
                                               tuple[int, set[int], set[int]]], list[tuple]]:
    """(param, start, stop) -> (bytes, holders, needers) over every copy of the plan, and
    its keys biggest class first (ties by key)."""
    got = _CLASSES_CACHE.get(plan.hash)
    if got is None:
        classes = _walk_classes(plan)
        got = _CLASSES_CACHE[plan.hash] = (classes, sorted(classes, key=lambda k: (-classes[k][0], k)))
        while len(_CLASSES_CACHE) > _CLASSES_KEEP:
            _CLASSES_CACHE.pop(next(iter(_CLASSES_CACHE)))
    return got


def _walk_classes(plan: ReshardPlan) -> dict[tuple[int, tuple[int, ...], tuple[int, ...]],
                                              tuple[int, set[int], set[int]]]:
    params = plan.params
    out: dict[tuple, tuple[int, set[int], set[int]]] = {}
    for t in plan.transfers:
        src, dst = t.src, t.dst
        # A run's repetitions share their boxes: walk (param, start, stop) without
        # expanding the run into copies (a MoE plan holds a million of them).
        boxes = [(c.param, tuple(c.start), tuple(c.stop), 0, 1) for c in t.copies]
        boxes += [(c.param, tuple(c.start), tuple(c.stop), run.param_step, run.count)
                  for run in t.runs for c in run.block]
        for param, start, stop, step, count in boxes:
            for p in range(param, param + step * count, step) if count > 1 else (param,):
                key = (p, start, stop)
                got = out.get(key)
                if got is None:
                    n = prod(b - a for a, b in zip(start, stop)) * dtype_size(params[p].dtype)
                    got = out[key] = (n, set(), set())
                got[1].add(src)
                got[2].add(dst)
    return out


def relay_message_bytes(bucket_bytes: int, fanout: int) -> int:
    """The most bytes of one message into an entry that forwards it to ``fanout`` ranks.

    The entry forwards a message once it landed, ``fanout`` copies through its one
    intra-node port; cut to ``bucket_bytes // fanout``, the last message's forwarding
    (the relays' drain, which nothing can overlap) costs at most one bucket on that
    port, as a direct send of one bucket would.
    """
    return max(1, bucket_bytes // max(1, fanout))


def relay_routes(plan: ReshardPlan, train_nodes: Sequence[Hashable],
                 gen_nodes: Sequence[Hashable]) -> RelayRoutes:
    """Routes for ``plan`` given the node of every training and generation rank.

    Deterministic: the same plan and nodes give the same routes on every rank (classes
    and candidates are visited in sorted order; ties go to the lowest rank).
    """
    body = plan.body
    if len(train_nodes) != body.train_world_size or len(gen_nodes) != body.gen_world_size:
        raise ConfigError(f"nodes given for {len(train_nodes)} training / {len(gen_nodes)} generation ranks; "
                          f"the plan has {body.train_world_size} / {body.gen_world_size}")
    net_out = [0] * body.train_world_size      # bytes leaving each trainer's node link
    net_in = [0] * body.gen_world_size         # bytes entering each generation rank from off-node
    local_out = [0] * body.train_world_size    # bytes a trainer sends inside its node
    relay_out = [0] * body.gen_world_size      # bytes a generation rank forwards
    routes = RelayRoutes()
    add = routes.routes.append
    classes, order = _classes(plan)
    # Classes of a MoE share a few (holders, needers) sets: group them once per set.
    shapes: dict[tuple[frozenset[int], frozenset[int]], tuple] = {}

    def shape(holders: set[int], needers: set[int]) -> tuple:
        key = (frozenset(holders), frozenset(needers))
        got = shapes.get(key)
        if got is None:
            by_node: dict[Hashable, list[int]] = {}
            for d in sorted(needers):
                by_node.setdefault(gen_nodes[d], []).append(d)
            hs = sorted(holders)
            got = shapes[key] = (hs, [(by_node[n], [h for h in hs if train_nodes[h] == n])
                                      for n in sorted(by_node, key=repr)])
        return got

    # Biggest classes first: greedy balancing places the large pieces while every port
    # is still open, the small ones fill the gaps.
    for key in order:
        nbytes, holders, needers = classes[key]
        hs, nodes = shape(holders, needers)
        param, start, stop = key
        for ranks, near in nodes:
            if near:
                # Same node: every needer takes it from the least loaded near holder,
                # as the plan would (no relay: nothing crosses the network).
                for d in ranks:
                    h = min(near, key=lambda r: (local_out[r], r))
                    local_out[h] += nbytes
                    add(Route(param, start, stop, nbytes, h, d, (), False))
                continue
            src = hs[0] if len(hs) == 1 else min(hs, key=lambda r: (net_out[r], r))
            if len(ranks) == 1:
                entry, fanout = ranks[0], ()
            else:
                entry = min(ranks, key=lambda r: (net_in[r], relay_out[r], r))
                fanout = tuple(d for d in ranks if d != entry)
            net_out[src] += nbytes
            net_in[entry] += nbytes
            relay_out[entry] += nbytes * len(fanout)
            add(Route(param, start, stop, nbytes, src, entry, fanout, True))
    return routes
