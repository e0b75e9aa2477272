"""tp=2 trainers -> a real vLLM engine at tp=2 with one kv head (replicated on both ranks),
tied embeddings (vLLM's lm_head borrows embed_tokens) and a padded vocabulary."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from .vllm_engine import TINY_QWEN3, vllm_world  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with vllm_world(tmp_path_factory, tp=2,
                    config=dict(TINY_QWEN3, num_key_value_heads=1, tie_word_embeddings=True)) as w:
        yield w


@pytest.mark.timeout(300)
def test_three_refits_into_vllm_tp2_generate_like_hf(world):
    previous = world.tokens()
    assert previous == world.oracle(0)
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
        previous = got
