"""Relayed refits over gloo with fake nodes: each byte crosses into a node once.

Trainers on node "a", rollouts on "b" (and "c"): the plan is routed by node
(layout/topology.py), trainers send each copy class once per destination node, an
entry rollout relays it to its node's peers. Bit-exact against weights built here
from the seed; the bytes that left the trainers' node equal the routes' cross-node
minimum (each class once per node that needs it); a relay that dies mid-refit makes
every survivor raise a typed error and nobody commits.
"""

from __future__ import annotations

import time

import pytest
import torch

from policyworker.runtime.procs import free_port, run_world
from policyworker.layout import build_plan
from policyworker.layout.topology import relay_routes

from .refit_world import RefitSpec, refit_rank

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def _world(spec: RefitSpec, timeout_s: float = 120) -> list[dict]:
    spec.update_port = free_port()
    spec.stage_ports = [free_port() for _ in range(spec.train_par.pp)]
    spec.train_port = free_port()
    n = spec.train_par.world_size + spec.gen_par.world_size
    return run_world(refit_rank, n, (spec,), timeout_s=timeout_s)


def _cross_node_minimum(spec: RefitSpec) -> int:
    """Bytes a class must cross into the rollouts' nodes: computed from the plan here."""
    t, g = spec.train_par, spec.gen_par
    plan = build_plan(spec.config, t, spec.gen, t.world_size, g.world_size, dtype=torch.float32)
    need: dict = {}
    for tr in plan.transfers:
        for c in tr.all_copies():
            key = (c.param, tuple(c.start), tuple(c.stop))
            n = 4  # float32
            for a, b in zip(c.start, c.stop):
                n *= b - a
            need.setdefault(key, [n, set()])[1].add(spec.nodes[t.world_size + tr.dst])
    return sum(n * len(nodes) for n, nodes in need.values()), plan


@pytest.mark.parametrize("gen,gen_nodes", [
    ("tp=2,dp=2", ["b", "b", "b", "b"]),            # two replicas on one node: one relay each class
    ("tp=1,dp=4", ["b", "b", "c", "c"]),            # two nodes, two replicas each
])
def test_relayed_refit_is_bit_exact_and_crosses_each_node_once(gen, gen_nodes):
    spec = RefitSpec(preset="tiny", train="tp=2", gen=gen, refits=2, nodes=["a", "a", *gen_nodes])
    minimum, plan = _cross_node_minimum(spec)
    results = _world(spec)
    n_train = spec.train_par.world_size
    sent = [r["outcomes"] for r in results[:n_train]]
    assert all(o["ok"] for outs in sent for o in outs), sent
    for v in range(spec.refits):
        # every trainer byte left node "a": their sum is what crossed the network
        assert sum(outs[v]["bytes"] for outs in sent) == minimum < plan.total_bytes
    for r in results[n_train:]:
        outs = r["outcomes"]
        assert [o.get("exact") for o in outs] == [True] * spec.refits, outs
        assert r["weight_version"] == spec.refits
        assert all(o["bytes"] == r["recv_expected"] for o in outs)  # its whole shard, bulk + relay


def test_one_node_sends_the_plan_unrouted():
    spec = RefitSpec(preset="tiny", train="tp=2", gen="tp=2,dp=2", refits=1, nodes=["a"] * 6)
    _, plan = _cross_node_minimum(spec)
    results = _world(spec)
    assert sum(r["outcomes"][0]["bytes"] for r in results[:2]) == plan.total_bytes
    assert all(r["outcomes"][0].get("exact") for r in results[2:])


def test_a_relay_killed_mid_refit_fails_every_survivor_and_nobody_commits():
    spec = RefitSpec(preset="tiny", train="tp=2", gen="tp=2,dp=2", refits=2, nodes=["a", "a", "b", "b", "b", "b"],
                     refit_timeout_s=20.0, timeout_s=30.0)
    train, gen = spec.train_par, spec.gen_par
    plan = build_plan(spec.config, train, spec.gen, train.world_size, gen.world_size)
    routes = relay_routes(plan, ["a", "a"], ["b"] * 4)
    entry = next(r.entry for r in routes.routes if r.fanout)
    spec.die_in_fanout = (entry, 2)
    began = time.monotonic()
    results = run_world_allowing_exit(spec, 2 + entry)
    assert time.monotonic() - began < 100
    for i, r in enumerate(results):
        if i == 2 + entry:
            assert r is None  # the relay exited (code 17)
            continue
        outs = r["outcomes"]
        assert outs[0]["ok"] and not outs[1]["ok"], outs
        assert outs[1]["error"] in ("PeerLost", "RefitTimeout", "TransportError"), outs
        if i >= 2:
            assert r["weight_version"] == 1  # v2 committed nowhere
            assert outs[1]["torn"] == (r.get("serves_after_failure") == "TornWeights")


def run_world_allowing_exit(spec: RefitSpec, dead: int) -> list:
    from policyworker.runtime.procs import start_world

    spec.update_port = free_port()
    spec.stage_ports = [free_port() for _ in range(spec.train_par.pp)]
    n = spec.train_par.world_size + spec.gen_par.world_size
    world = start_world(refit_rank, n, (spec,))
    out = world.collect(90, allow_dead=[dead])
    assert world.procs[dead].exitcode == 17
    return [out.get(r) for r in range(n)]
