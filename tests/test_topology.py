"""Topology-aware routes: each copy class crosses into a node at most once."""

from __future__ import annotations

import pytest

from policyworker.layout import Parallelism, build_plan
from policyworker.layout.fabric import Fabric, fabric_report, load_fabric
from policyworker.layout.topology import relay_routes
from policyworker.models import get_preset

pytestmark = pytest.mark.timeout(120)


def _plan(train: str, gen: str, preset: str = "tiny"):
    t, g = Parallelism.parse(train), Parallelism.parse(gen)
    return build_plan(get_preset(preset), t, g, t.world_size, g.world_size)


def _needs(plan):
    """(param, start, stop) -> (bytes, holders, needers), computed here independently."""
    out = {}
    for t in plan.transfers:
        for c in t.all_copies():
            key = (c.param, tuple(c.start), tuple(c.stop))
            n = 1
            for a, b in zip(c.start, c.stop):
                n *= b - a
            n *= {"bfloat16": 2, "float16": 2, "float32": 4}[plan.params[c.param].dtype]
            got = out.setdefault(key, [n, set(), set()])
            got[1].add(t.src)
            got[2].add(t.dst)
    return out


@pytest.mark.parametrize("train,gen,train_nodes,gen_nodes", [
    ("tp=2", "tp=2,dp=2", [0, 0], [1, 1, 1, 1]),           # two replicas on one node
    ("tp=2,pp=2", "tp=2,dp=4", [0] * 4, [1] * 4 + [2] * 4),  # two gen nodes, two replicas each
    ("tp=2", "tp=1,dp=4", [0, 1], [0, 0, 1, 1]),           # a holder on each gen node: nothing crosses
])
def test_each_class_crosses_into_a_node_once_and_everyone_gets_everything(train, gen, train_nodes, gen_nodes):
    plan = _plan(train, gen)
    routes = relay_routes(plan, train_nodes, gen_nodes)
    needs = _needs(plan)
    # minimum cross-node bytes: a class crosses into node N iff some rank on N needs it
    # and no holder sits on N
    minimum = 0
    for nbytes, holders, needers in needs.values():
        nodes = {gen_nodes[d] for d in needers}
        minimum += nbytes * sum(1 for n in nodes if not any(train_nodes[h] == n for h in holders))
    assert routes.cross_node_bytes == minimum
    # every needer receives each of its classes exactly once (entry or fan-out), same node for relays
    got = {}
    for r in routes.routes:
        for d in (r.entry, *r.fanout):
            key = (r.param, r.start, r.stop, d)
            assert key not in got
            got[key] = r
            assert gen_nodes[d] == gen_nodes[r.entry]
        assert r.src in needs[(r.param, r.start, r.stop)][1]
    assert set(got) == {(*k, d) for k, (_, _, needers) in needs.items() for d in needers}
    assert sum(routes.received_bytes(plan.body.gen_world_size)) == plan.total_bytes


def test_one_node_is_the_plan():
    plan = _plan("tp=2,pp=2", "tp=2,dp=2")
    routes = relay_routes(plan, [0] * 4, [0] * 4)
    assert routes.cross_node_bytes == 0 and routes.relayed_bytes == 0
    assert routes.total_bytes == plan.total_bytes


def test_fabric_model_qwen3_8b_on_h100_meets_its_goal():
    """qwen3-8b, trainers tp=4,pp=2 on one node, 4 tp=2 replicas on the next (a model)."""
    plan = build_plan(get_preset("qwen3-8b"), Parallelism.parse("tp=4,pp=2"), Parallelism.parse("tp=2,dp=4"), 8, 8)
    report = fabric_report(plan, load_fabric("benchmarks/fabrics/h100-8x.json"))
    topo = report["topology"]
    model = report["broadcast"]["model_bytes"]
    assert topo["bytes_by_kind"]["nic"] == model == topo["cross_node_bytes"]   # the model crosses once
    assert topo["bound_s"] <= 0.045
    assert topo["bound_s"] <= report["plan"]["bound_s"] and topo["bound_s"] <= report["broadcast"]["bound_s"]
    # Every byte is relayed: the last piece leaves its entry after the whole intake, so the
    # relay path (intake + one bucket over NVLink) sets the bound.
    assert topo["bound_s"] == topo["relay_path_s"] > topo["ports_bound_s"]


def test_fabric_model_charges_the_relay_fill_only_where_the_relay_path_bounds():
    """tp=2 -> tp=8 on the next node: only kv heads and norms are relayed (a small part of
    each entry's intake), so the ports bound the refit and the relays' fill hides under them."""
    plan = build_plan(get_preset("small"), Parallelism.parse("tp=2"), Parallelism.parse("tp=8"), 2, 8)
    report = fabric_report(plan, Fabric(gpus_per_node=8, nvlink_gbps=450, nic_gbps=50))
    topo = report["topology"]
    assert 0 < topo["relayed_bytes"] < plan.total_bytes / 8
    assert topo["relay_path_s"] < topo["ports_bound_s"] == topo["bound_s"]
    assert topo["bound_s"] <= report["plan"]["bound_s"]


def test_nodes_must_cover_the_plan():
    plan = _plan("tp=2", "tp=2")
    from policyworker.errors import ConfigError

    with pytest.raises(ConfigError):
        relay_routes(plan, [0], [0, 0])
