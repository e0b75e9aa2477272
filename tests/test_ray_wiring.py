"""policyworker.integrations.ray: stores, ports and stage ranks derived from the layouts (no Ray needed)."""

from __future__ import annotations

import pytest

from policyworker.errors import ConfigError
from policyworker.integrations.ray import RefitWiring, store_hosts
from policyworker.layout import Parallelism


def test_store_hosts_are_rank_0_and_each_stages_first_trainer():
    assert store_hosts("tp=2") == {0: ["update", "stage0"]}
    assert store_hosts("tp=2,pp=2") == {0: ["update", "stage0"], 2: ["stage1"]}


def test_wiring_matches_the_documented_rank_order():
    train, gen = Parallelism.parse("tp=2,pp=2"), Parallelism.parse("tp=1,dp=2")
    wiring = RefitWiring.build(train, gen, {0: ("10.0.0.1", [5000, 5001]), 2: ("10.0.0.2", [6000])})
    assert wiring.world_size == 6
    for rank in range(4):
        t = wiring.trainer(rank)
        stage = train.coords(rank).pp_stage
        assert (t.ip, t.port, t.world_size, t.train_world_size) == ("10.0.0.1", 5000, 6, 4)
        assert t.stage_ips == ("10.0.0.1", "10.0.0.2") and t.stage_ports == (5001, 6000)
        assert (t.pp_size, t.stage, t.sub_world_size) == (2, stage, 2 + 2)
        assert t.rank_in_group == list(train.stage_ranks(stage)).index(rank)
    r = wiring.rollout()
    assert (r.ip, r.port, r.world_size, r.train_world_size) == ("10.0.0.1", 5000, 6, 4)
    assert r.stage_ports == (5001, 6000) and r.trainers_per_stage == (2, 2)


def test_missing_or_short_port_choices_are_config_errors():
    with pytest.raises(ConfigError, match="hosts"):
        RefitWiring.build("tp=2,pp=2", "tp=2", {0: ("h", [1, 2])})
    with pytest.raises(ConfigError, match="chose 1 ports"):
        RefitWiring.build("tp=2", "tp=2", {0: ("h", [1])})
    with pytest.raises(ConfigError, match="layout string"):
        store_hosts(2)
