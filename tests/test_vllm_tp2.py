"""tp=2 trainers -> a real vLLM engine at tp=2 with one kv head (replicated on both ranks),
tied embeddings (vLLM's lm_head borrows embed_tokens) and a padded vocabulary; and every
failure path of test_vllm.py at tp=2, where each vLLM call must answer for itself."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from . import vllm_failure_cases as cases  # noqa: E402
from .vllm_engine import TINY_QWEN3, vllm_world  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    # Small buckets: a refit is dozens of messages, so a trainer can die in the middle.
    with vllm_world(tmp_path_factory, tp=2, config=dict(TINY_QWEN3, num_key_value_heads=1, tie_word_embeddings=True),
                    reshard_options={"bucket_bytes": 64 << 10}) as w:
        yield w


@pytest.mark.timeout(300)
def test_three_refits_into_vllm_tp2_generate_like_hf(world):
    previous = world.tokens()
    assert previous == world.oracle(0)
    world.history[0] = previous
    # Commit by copying into vLLM's live tensors (the CUDA-graph / compiled-model way);
    # test_vllm.py covers the default (swap) on this eager CPU engine.
    replies = world.connect(version=0, commit="copy")
    assert all(r["ok"] for r in replies), replies
    for version in (1, 2, 3):
        error, replies = world.refit(version)
        assert error is None
        assert [r["version"] for r in replies] == [version, version], replies
        got = world.tokens()
        assert got == world.oracle(version)
        assert got != previous
        assert world.llm.get_weight_version() == str(version)
        previous = world.history[version] = got
        world.version = version


@pytest.mark.timeout(240)
def test_tp2_refused_version_then_the_next_call_answers_for_itself(world):
    cases.refused_version(world)


@pytest.mark.timeout(240)
def test_tp2_failed_commit_then_the_next_refit_commits(world):
    cases.failed_commit(world)


@pytest.mark.timeout(240)
def test_tp2_deadline_then_recovery_commits(world):
    cases.deadline(world)


@pytest.mark.timeout(300)
def test_tp2_trainer_killed_mid_refit_then_replacement_commits(world):
    cases.dead_trainer(world)


@pytest.mark.timeout(240)
def test_tp2_init_without_trainers_is_bounded_and_typed_then_recovery_commits(world):
    cases.init_without_trainers(world)


@pytest.mark.timeout(240)
def test_tp2_postprocess_failing_on_one_rank_swaps_nothing_then_commits(world):
    cases.postprocess_fails_on_one_rank(world)


@pytest.mark.timeout(240)
def test_tp2_swap_failing_on_one_rank_is_torn_everywhere_until_a_full_refit(world):
    cases.swap_fails_on_one_rank(world)


@pytest.mark.timeout(240)
def test_tp2_staging_none_torn_on_every_rank_until_a_full_refit(world):
    # No staging set: a trainer killed mid-refit leaves both ranks torn; a full refit
    # heals them (tokens == HF's). ("device" is the default here: the cases above.)
    cases.staging_modes(world, modes=("none",))
    replies = world.connect(version=world.version)  # back to "auto"
    assert all(r["ok"] for r in replies), replies


@pytest.mark.timeout(150)
def test_tp2_staging_none_a_layer_failing_mid_landing_is_torn_on_every_rank_until_a_full_refit(world):
    cases.landing_fails_on_one_rank(world)
    replies = world.connect(version=world.version)  # back to "auto"
    assert all(r["ok"] for r in replies), replies
