"""Parallelism: the rank map, expert groups, parsing and validation."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.errors import ConfigError
from policyworker.layout import Parallelism, RankCoords


def test_rank_formula_and_coords_round_trip() -> None:
    par = Parallelism(tp=2, pp=3, dp=2)
    assert par.world_size == 12
    for stage in range(3):
        for dp in range(2):
            for tp in range(2):
                rank = par.rank_of(pp_stage=stage, dp_rank=dp, tp_rank=tp)
                assert rank == ((stage * 2) + dp) * 2 + tp
                c = par.coords(rank)
                assert (c.pp_stage, c.dp_rank, c.tp_rank) == (stage, dp, tp)


def test_stage_ranks_are_contiguous() -> None:
    par = Parallelism(tp=2, pp=2, dp=2)
    assert list(par.stage_ranks(0)) == [0, 1, 2, 3]
    assert list(par.stage_ranks(1)) == [4, 5, 6, 7]
    with pytest.raises(ConfigError):
        par.stage_ranks(2)


def test_expert_groups_carved_from_dp() -> None:
    # ep divides dp: Megatron's layout, experts keep the tp sharding.
    par = Parallelism(tp=2, dp=4, ep=2)
    assert (par.etp, par.edp) == (2, 2)
    for rank in range(par.world_size):
        c = par.coords(rank)
        assert c.ep_rank == c.dp_rank % 2
        assert c.etp_rank == c.tp_rank
        assert c.edp_rank == c.dp_rank // 2


def test_expert_groups_span_tp() -> None:
    # ep == dp * tp: every rank holds whole experts (vLLM's expert parallel).
    par = Parallelism(tp=4, ep=4)
    assert (par.etp, par.edp) == (1, 1)
    assert [par.coords(r).ep_rank for r in range(4)] == [0, 1, 2, 3]
    # ep between: dp=2, tp=4, ep=4 -> etp=2.
    par = Parallelism(tp=4, dp=2, ep=4)
    assert (par.etp, par.edp) == (2, 1)
    assert [par.coords(r).ep_rank for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@given(tp=st.integers(1, 4), pp=st.integers(1, 3), dp=st.integers(1, 4), data=st.data())
@settings(max_examples=60, deadline=None)
def test_coords_bijective(tp: int, pp: int, dp: int, data: st.DataObject) -> None:
    ep = data.draw(st.sampled_from([e for e in range(1, dp * tp + 1) if (dp * tp) % e == 0]))
    par = Parallelism(tp=tp, pp=pp, dp=dp, ep=ep)
    seen = set()
    expert_slots = set()
    for rank in range(par.world_size):
        c = par.coords(rank)
        assert isinstance(c, RankCoords) and c.rank == rank
        assert par.rank_of(pp_stage=c.pp_stage, dp_rank=c.dp_rank, tp_rank=c.tp_rank) == rank
        seen.add((c.pp_stage, c.dp_rank, c.tp_rank))
        assert 0 <= c.ep_rank < ep and 0 <= c.etp_rank < par.etp and 0 <= c.edp_rank < par.edp
        expert_slots.add((c.pp_stage, c.edp_rank, c.ep_rank, c.etp_rank))
    assert len(seen) == par.world_size
    # (edp, ep, etp) is also a bijection onto each stage's ranks.
    assert len(expert_slots) == par.world_size
    assert par.etp * par.ep * par.edp == dp * tp


def test_parse() -> None:
    assert Parallelism.parse("tp=2,pp=2,dp=1") == Parallelism(tp=2, pp=2)
    assert Parallelism.parse(" dp=2 , TP=4 ") == Parallelism(tp=4, dp=2)
    assert Parallelism.parse("") == Parallelism()
    assert Parallelism.parse(str(Parallelism(tp=2, dp=2, ep=2))) == Parallelism(2, 1, 2, 2)
    for bad in ("tp=2,tp=2", "xx=2", "tp", "tp=two", "tp=0", "tp=-1", "ep=3,dp=2"):
        with pytest.raises(ConfigError):
            Parallelism.parse(bad)


def test_validation_messages() -> None:
    with pytest.raises(ConfigError, match="tp must be a positive int"):
        Parallelism(tp=0)
    with pytest.raises(ConfigError, match="positive int"):
        Parallelism(tp=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ep=3 must divide dp\\*tp=4"):
        Parallelism(tp=2, dp=2, ep=3)
    with pytest.raises(ConfigError, match="does not match"):
        Parallelism(tp=2, pp=2).check_world_size(3, side="train")
    Parallelism(tp=2, pp=2).check_world_size(4)
    with pytest.raises(ConfigError):
        Parallelism(tp=2).coords(2)
    with pytest.raises(ConfigError):
        Parallelism(tp=2).rank_of(tp_rank=2)


def test_frozen_and_slotted() -> None:
    par = Parallelism(tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        par.tp = 4  # type: ignore[misc]
    assert not hasattr(par, "__dict__")
    assert hash(par) == hash(Parallelism(tp=2))
