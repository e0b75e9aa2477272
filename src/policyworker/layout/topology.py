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
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from policyworker.errors import ConfigError
from policyworker.layout.classes import CopyClasses, copy_classes
from policyworker.layout.plan import ReshardPlan

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


class RelayRoutes:
    """A plan's routes in route order, kept as columns: route ``j`` takes class
    ``classes.key(cls[j])`` from training rank ``src[j]`` to ``entry[j]``, which relays
    it to ``fanouts[fan[j]]``; ``fan[j] == 0`` marks a route that stays on its node.

    A MoE plan has a million routes and the fabric model only sums them per link:
    `routes` builds the `Route` objects on first use, the sums read the columns.
    """

    def __init__(self, classes: CopyClasses, cls: list[int], src: list[int], entry: list[int],
                 fan: list[int], fanouts: list[tuple[int, ...]]) -> None:
        self._classes = classes
        self._cls, self._src, self._entry, self._fan = cls, src, entry, fan
        self._fanouts = fanouts

    @cached_property
    def routes(self) -> list[Route]:
        c, fanouts = self._classes, self._fanouts
        param, box, boxes, nbytes = c.param, c.box, c.boxes, c.nbytes
        out = []
        add = out.append
        for i, s, e, f in zip(self._cls, self._src, self._entry, self._fan):
            start, stop = boxes[box[i]]
            add(Route(param[i], start, stop, nbytes[i], s, e, fanouts[f], f != 0))
        return out

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, ...]:
        """(bytes, src, entry, fan id, fan-out length) per route."""
        fan = np.asarray(self._fan, np.int64)
        lengths = np.asarray([len(f) for f in self._fanouts], np.int64)
        return (self._classes.nbytes_array[np.asarray(self._cls, np.int64)],
                np.asarray(self._src, np.int64), np.asarray(self._entry, np.int64), fan, lengths[fan])

    def _hops(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(entry, fan-out rank, bytes) of every relayed hop, in route then fan-out order."""
        n, _, entry, fan, length = self._arrays
        relayed = np.flatnonzero(length > 0)
        lengths = length[relayed]
        # Fan-out ranks of every relayed route, back to back: fan-out f sits at
        # members[offsets[f]:offsets[f] + len(f)].
        members = np.asarray([d for f in self._fanouts for d in f], np.int64)
        offsets = np.cumsum([0] + [len(f) for f in self._fanouts[:-1]], dtype=np.int64)
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return (np.repeat(entry[relayed], lengths), members[np.repeat(offsets[fan[relayed]], lengths) + within],
                np.repeat(n[relayed], lengths))

    @property
    def cross_node_bytes(self) -> int:
        n, _, _, fan, _ = self._arrays
        return int(n[fan != 0].sum())

    @property
    def relayed_bytes(self) -> int:
        n, _, _, _, length = self._arrays
        return int((n * length).sum())

    def entry_fanouts(self) -> dict[int, int]:
        """Per relaying entry: the most ranks one of its classes fans out to."""
        _, _, entry, _, length = self._arrays
        relayed = length > 0
        fan: dict[int, int] = {}
        if relayed.any():
            entries, first, inverse = np.unique(entry[relayed], return_index=True, return_inverse=True)
            most = np.zeros(len(entries), np.int64)
            np.maximum.at(most, inverse, length[relayed])
            for k in np.argsort(first, kind="stable").tolist():
                fan[int(entries[k])] = int(most[k])
        return fan

    @property
    def total_bytes(self) -> int:
        n, _, _, _, length = self._arrays
        return int((n * (1 + length)).sum())

    def received_bytes(self, gen_world_size: int) -> list[int]:
        n, _, entry, _, _ = self._arrays
        got = np.zeros(gen_world_size, np.int64)
        np.add.at(got, entry, n)
        _, dst, hop_n = self._hops()
        np.add.at(got, dst, hop_n)
        return got.tolist()

    def flows(self) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int],
                             dict[tuple[int, int], int]]:
        """Bytes per (src, entry) of first hops, per (src, entry) of the relayed ones
        among them, and per (entry, fan-out rank) of relay hops; each dict in the order
        its pairs first occur in the routes."""
        n, src, entry, _, length = self._arrays
        relayed = length > 0
        hop_entry, hop_dst, hop_n = self._hops()
        return (_sums(src, entry, n), _sums(src[relayed], entry[relayed], n[relayed]),
                _sums(hop_entry, hop_dst, hop_n))


def _sums(a: np.ndarray, b: np.ndarray, n: np.ndarray) -> dict[tuple[int, int], int]:
    """``n`` summed per ``(a, b)``, pairs in order of first occurrence."""
    if not len(n):
        return {}
    width = int(b.max()) + 1
    pair = a * width + b
    size = int(pair.max()) + 1
    total = np.zeros(size, np.int64)
    np.add.at(total, pair, n)
    first = np.full(size, len(pair), np.int64)
    np.minimum.at(first, pair, np.arange(len(pair), dtype=np.int64))
    seen = np.flatnonzero(first < len(pair))
    seen = seen[np.argsort(first[seen], kind="stable")]
    return {(p // width, p % width): t for p, t in zip(seen.tolist(), total[seen].tolist())}


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
    local_out = [0] * body.train_world_size    # bytes a trainer sends inside its node
    # Per generation rank: (bytes entering it from off-node, bytes it forwards), the
    # key an entry is chosen by.
    intake = [(0, 0)] * body.gen_world_size
    classes = copy_classes(plan)
    fanouts: list[tuple[int, ...]] = [(), ()]   # fan id 0: a route inside a node; 1: none
    fan_ids: dict[tuple[int, ...], int] = {(): 1}

    def fan_id(fanout: tuple[int, ...]) -> int:
        got = fan_ids.get(fanout)
        if got is None:
            got = fan_ids[fanout] = len(fanouts)
            fanouts.append(fanout)
        return got

    # What each (holders, needers) set means on these nodes, worked out once per set:
    # per needing node (in sorted order), its needers and either the holders on it or,
    # when it has several needers, each candidate entry's fan id.
    per_set = []
    for hs, needers in classes.sets:
        by_node: dict[Hashable, list[int]] = {}
        for d in needers:
            by_node.setdefault(gen_nodes[d], []).append(d)
        groups = []
        for node in sorted(by_node, key=repr):
            ranks = by_node[node]
            near = [h for h in hs if train_nodes[h] == node]
            if near:
                groups.append((False, ranks, near))
            else:
                groups.append((True, ranks, {e: fan_id(tuple(d for d in ranks if d != e)) for e in ranks}
                               if len(ranks) > 1 else None))
        per_set.append((hs, groups))
    fan_len = [len(f) for f in fanouts]

    cls: list[int] = []
    srcs: list[int] = []
    entries: list[int] = []
    fans: list[int] = []
    add_cls, add_src, add_entry, add_fan = cls.append, srcs.append, entries.append, fans.append
    # Biggest classes first: greedy balancing places the large pieces while every port
    # is still open, the small ones fill the gaps. Candidates are listed in rank order,
    # so `min` by load alone breaks ties to the lowest rank.
    for i, (nbytes, s) in enumerate(zip(classes.nbytes, classes.set_of)):
        hs, groups = per_set[s]
        for cross, ranks, how in groups:
            if not cross:
                # Same node: every needer takes it from the least loaded near holder,
                # as the plan would (no relay: nothing crosses the network).
                for d in ranks:
                    h = how[0] if len(how) == 1 else min(how, key=local_out.__getitem__)
                    local_out[h] += nbytes
                    add_cls(i)
                    add_src(h)
                    add_entry(d)
                    add_fan(0)
                continue
            src = hs[0] if len(hs) == 1 else min(hs, key=net_out.__getitem__)
            if how is None:
                entry, fid = ranks[0], 1
            else:
                entry = min(ranks, key=intake.__getitem__)
                fid = how[entry]
            net_out[src] += nbytes
            got, relayed = intake[entry]
            intake[entry] = (got + nbytes, relayed + nbytes * fan_len[fid])
            add_cls(i)
            add_src(src)
            add_entry(entry)
            add_fan(fid)
    return RelayRoutes(classes, cls, srcs, entries, fans, fanouts)
