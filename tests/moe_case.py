"""The tiny Qwen3-MoE the MoE refit tests serve, and their checks (shared by the tp=1 and EP modules)."""

from __future__ import annotations

from typing import Any

from .vllm_engine import TINY_QWEN3

# 8 experts, top-2; moe_intermediate_size 64 splits into 32-row halves at tp=2, the
# CPU MoE kernel's alignment (no padding).
TINY_QWEN3_MOE = dict(TINY_QWEN3, num_key_value_heads=2, moe_intermediate_size=64, num_experts=8,
                      num_experts_per_tok=2)


def minimum_bytes(world: Any, gen_tp: int) -> int:
    """The bytes vLLM's ranks need, from the Hugging Face model: everything once, and what
    every vLLM rank holds whole (norms, the router) once more per further rank."""
    model = world.hf(0)
    total = 0
    for name, p in model.named_parameters():
        whole = name.endswith("norm.weight") or name.endswith("mlp.gate.weight")
        total += p.numel() * p.element_size() * (gen_tp if whole else 1)
    return total


def refits_generate_like_hf(world: Any, train: str, gen_tp: int, refits: int = 2, **init: Any) -> None:
    """Trainers of layout ``train`` connect and refit ``refits`` new versions (router
    included); after each, vLLM's greedy tokens are Hugging Face's and not the previous
    version's; the plan moves exactly the bytes vLLM's ranks need. ``init``: more
    ``init_info`` keys (``staging``)."""
    if world.version == 0:
        before = world.tokens()
        assert before == world.oracle(0)
        world.history[0] = before
    if world.spec.train != train:
        world.use_trainers(train)
    v = world.version
    replies = world.connect(version=v, **init)
    assert all(r["ok"] for r in replies), replies
    assert len({r["hash"] for r in replies}) == 1
    assert {r["total_bytes"] for r in replies} == {minimum_bytes(world, gen_tp)}
    for version in range(v + 1, v + 1 + refits):
        error, replies = world.refit(version)
        assert error is None, error
        assert [r["version"] for r in replies] == [version] * world.spec.n_train, replies
        assert sum(r["bytes"] for r in replies) == minimum_bytes(world, gen_tp)
        got = world.tokens()
        assert got == world.oracle(version)
        assert got != world.history[version - 1]
        assert world.llm.get_weight_version() == str(version)
        world.history[version] = got
        world.version = version
