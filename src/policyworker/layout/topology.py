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

#: Fixed routes' loads: (visit, rank, bytes) lists (see `_Ways.fixed_loads`).
_Fixed = tuple[list[int], list[int], list[int]]
#: The largest (visits x ranks) table fixed loads are summed in.
_DENSE = 1 << 22


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

    def __init__(self, classes: CopyClasses, cls: np.ndarray, src: np.ndarray, entry: np.ndarray,
                 fan: np.ndarray, fanouts: list[tuple[int, ...]]) -> None:
        self._classes = classes
        self._cls, self._src, self._entry, self._fan = cls, src, entry, fan
        self._fanouts = fanouts

    @cached_property
    def routes(self) -> list[Route]:
        c, fanouts = self._classes, self._fanouts
        param, box, boxes, nbytes = c.param, c.box, c.boxes, c.nbytes
        out = []
        add = out.append
        for i, s, e, f in zip(self._cls.tolist(), self._src.tolist(), self._entry.tolist(), self._fan.tolist()):
            start, stop = boxes[box[i]]
            add(Route(param[i], start, stop, nbytes[i], s, e, fanouts[f], f != 0))
        return out

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, ...]:
        """(bytes, src, entry, fan id, fan-out length) per route."""
        lengths = np.asarray([len(f) for f in self._fanouts], np.int64)
        return (self._classes.nbytes_array[self._cls], self._src, self._entry, self._fan, lengths[self._fan])

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
    classes = copy_classes(plan)
    ways = _Ways(classes, train_nodes, gen_nodes)
    local_out = [0] * body.train_world_size    # bytes a trainer sends inside its node
    net_out = [0] * body.train_world_size      # bytes leaving each trainer's node link
    # Per generation rank: (bytes entering it from off-node, bytes it forwards), the
    # key an entry is chosen by.
    intake = [(0, 0)] * body.gen_world_size
    fan_len = [len(f) for f in ways.fanouts]
    srcs: list[int] = []
    entries: list[int] = []
    fans: list[int] = []
    add_src, add_entry, add_fan = srcs.append, entries.append, fans.append
    # Biggest classes first: greedy balancing places the large pieces while every port
    # is still open, the small ones fill the gaps. Only the classes with a choice to
    # make are visited here; before each, the loads take in the fixed routes' bytes of
    # the classes before it (a class's fixed routes never load what its own choices
    # read: those are ranks of other nodes, or sources of a class with one holder).
    # Candidates are listed in rank order, so `min` by load alone breaks ties to the
    # lowest rank.
    choosing, fixed_local, fixed_net, fixed_intake = ways.fixed_loads()
    (lk, lr, lv), (nk, nr, nv), (ik, ir, iv) = fixed_local, fixed_net, fixed_intake
    li = ni = ii = 0
    nbytes, set_of, choices = classes.nbytes, classes.set_of, ways.choices
    for j, i in enumerate(choosing):
        while lk[li] == j:
            local_out[lr[li]] += lv[li]
            li += 1
        while nk[ni] == j:
            net_out[nr[ni]] += nv[ni]
            ni += 1
        while ik[ii] == j:
            got, relayed = intake[ir[ii]]
            intake[ir[ii]] = (got + iv[ii], relayed)
            ii += 1
        n = nbytes[i]
        hs, groups = choices[set_of[i]]
        for near, count, entry_of in groups:
            if near:
                # Same node: every needer takes it from the least loaded near holder,
                # as the plan would (no relay: nothing crosses the network).
                for _ in range(count):
                    h = min(near, key=local_out.__getitem__)
                    local_out[h] += n
                    add_src(h)
                continue
            if len(hs) > 1:
                src = min(hs, key=net_out.__getitem__)
                net_out[src] += n
                add_src(src)
            if entry_of is not None:
                entry = min(entry_of, key=intake.__getitem__)
                fid = entry_of[entry]
                got, relayed = intake[entry]
                intake[entry] = (got + n, relayed + n * fan_len[fid])
                add_entry(entry)
                add_fan(fid)
    return ways.routes(srcs, entries, fans)


class _Ways:
    """What each (holders, needers) set of a plan's classes means on given nodes,
    worked out once per set: the routes of its classes as a template, with -1 where
    a route's source or entry is chosen by load, the load each fixed route adds, and
    the choices.

    Per needing node (sorted), either a holder sits on it (routes inside the node: a
    fixed one from a lone near holder, else a choice among the near holders per
    needer) or the class crosses once: from its lone holder or a choice among its
    holders, to its lone needer there or a choice of entry among the needers, which
    relays to the others.
    """

    LOCAL, NET, INTAKE = 0, 1, 2

    def __init__(self, classes: CopyClasses, train_nodes: Sequence[Hashable],
                 gen_nodes: Sequence[Hashable]) -> None:
        self.classes = classes
        self.fanouts: list[tuple[int, ...]] = [(), ()]   # fan id 0: inside a node; 1: no relay
        fan_ids: dict[tuple[int, ...], int] = {(): 1}
        slots: list[tuple[int, int, int]] = []           # (src, entry, fan id); -1: chosen
        first: list[int] = []
        fixed: list[tuple[int, int, int]] = []            # (load, rank, bytes per class byte)
        fixed_first: list[int] = []
        self.choices: list[tuple[tuple[int, ...], list[tuple]]] = []
        for hs, needers in classes.sets:
            first.append(len(slots))
            fixed_first.append(len(fixed))
            by_node: dict[Hashable, list[int]] = {}
            for d in needers:
                by_node.setdefault(gen_nodes[d], []).append(d)
            groups: list[tuple] = []
            for node in sorted(by_node, key=repr):
                ranks = by_node[node]
                near = [h for h in hs if train_nodes[h] == node]
                if len(near) == 1:
                    fixed.append((self.LOCAL, near[0], len(ranks)))
                    slots.extend((near[0], d, 0) for d in ranks)
                    continue
                if near:
                    groups.append((near, len(ranks), None))
                    slots.extend((-1, d, 0) for d in ranks)
                    continue
                src = hs[0] if len(hs) == 1 else -1
                if src >= 0:
                    fixed.append((self.NET, src, 1))
                if len(ranks) == 1:
                    fixed.append((self.INTAKE, ranks[0], 1))
                    slots.append((src, ranks[0], 1))
                    if src < 0:
                        groups.append((None, 1, None))
                    continue
                entry_of = {}
                for e in ranks:
                    fanout = tuple(d for d in ranks if d != e)
                    fid = fan_ids.get(fanout)
                    if fid is None:
                        fid = fan_ids[fanout] = len(self.fanouts)
                        self.fanouts.append(fanout)
                    entry_of[e] = fid
                groups.append((None, 1, entry_of))
                slots.append((src, -1, -1))
            self.choices.append((hs, groups))
        first.append(len(slots))
        fixed_first.append(len(fixed))
        self._slots = np.asarray(slots, np.int64).reshape(-1, 3)
        self._first = np.asarray(first, np.int64)
        self._fixed = np.asarray(fixed, np.int64).reshape(-1, 3)
        self._fixed_first = np.asarray(fixed_first, np.int64)
        self._choosing_set = np.asarray([bool(g) for _, g in self.choices], bool)

    def fixed_loads(self) -> tuple[list[int], _Fixed, _Fixed, _Fixed]:
        """The classes with a choice (in class order), and per load (LOCAL, NET,
        INTAKE): (visit, rank, bytes) summed per visit and rank, in visit order and
        ending with a visit that never comes: what the fixed routes add before the
        class ``choosing[visit]`` is visited."""
        c = self.classes
        set_of = c.set_of_array
        choosing = np.flatnonzero(self._choosing_set[set_of])
        counts = (self._fixed_first[1:] - self._fixed_first[:-1])[set_of]
        cls = np.repeat(np.arange(len(c), dtype=np.int64), counts)
        rows = self._fixed[np.repeat(self._fixed_first[:-1][set_of], counts) + _within(counts)]
        visit = np.searchsorted(choosing, cls, side="right")
        nbytes = c.nbytes_array[cls] * rows[:, 2]
        keep = visit < len(choosing)
        width = int(rows[:, 1].max(initial=0)) + 1
        # Summed per (visit, rank) in a dense table where that is small (few visits:
        # a million fixed routes become a few thousand sums); else each one as it is
        # (in visit order already: classes are in order).
        dense = (len(choosing) + 1) * width <= _DENSE
        out = []
        for load in (self.LOCAL, self.NET, self.INTAKE):
            mine = keep & (rows[:, 0] == load)
            keys, add = visit[mine] * width + rows[mine, 1], nbytes[mine]
            if dense:
                total = np.zeros(len(choosing) * width, np.int64)
                np.add.at(total, keys, add)
                keys = np.flatnonzero(total)
                add = total[keys]
            out.append(((keys // width).tolist() + [len(choosing)], (keys % width).tolist(), add.tolist()))
        return (choosing.tolist(), *out)

    def routes(self, srcs: list[int], entries: list[int], fans: list[int]) -> RelayRoutes:
        """Every class's template filled with the choices made (in route order)."""
        c = self.classes
        set_of = c.set_of_array
        counts = (self._first[1:] - self._first[:-1])[set_of]
        cls = np.repeat(np.arange(len(c), dtype=np.int64), counts)
        slots = self._slots[np.repeat(self._first[:-1][set_of], counts) + _within(counts)]
        src, entry, fan = (np.ascontiguousarray(slots[:, k]) for k in range(3))
        src[src < 0] = srcs
        entry[entry < 0] = entries
        fan[fan < 0] = fans
        return RelayRoutes(c, cls, src, entry, fan, self.fanouts)


def _within(counts: np.ndarray) -> np.ndarray:
    """0 .. count - 1 for each count, back to back."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
