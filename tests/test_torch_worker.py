"""TorchPolicyWorker: reference-policy logprobs, training chores, profiling."""

from __future__ import annotations

import copy
import json
import os
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from policyworker.errors import ConfigError
from policyworker.workers.torch_trainer import TorchPolicyWorker

VOCAB = 32


class TinyLM(nn.Module):
    """A causal LM small enough to reason about: position i sees the mean of tokens <= i."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 16, *, seed: int = 0, tied: bool = False,
                 hf_output: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.drop = nn.Dropout(0.5)  # must be off during reference forwards
        self.hf_output = hf_output
        self.fail = False

    def forward(self, input_ids: torch.Tensor):
        if self.fail:
            raise RuntimeError("forward failed on purpose")
        x = self.embed(input_ids)
        steps = torch.arange(1, input_ids.shape[1] + 1, dtype=x.dtype).unsqueeze(-1)
        x = torch.cumsum(x, dim=1) / steps
        logits = self.head(self.drop(torch.tanh(self.mix(x))))
        return SimpleNamespace(logits=logits) if self.hf_output else logits


def direct_logprobs(model: nn.Module, state: dict, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The contract, computed the obvious way on a copy of the model holding ``state``."""
    clone = copy.deepcopy(model)
    clone.load_state_dict(state)
    clone.eval()
    with torch.no_grad():
        out = clone(ids.clamp(min=0))
        logits = out if isinstance(out, torch.Tensor) else out.logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    result = torch.zeros(ids.shape, dtype=torch.float32)
    result[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    keep = (positions < lengths.unsqueeze(1)) & (positions > 0)
    return torch.where(keep, result, 0.0)


def make_batch(batch: int = 5, seq: int = 12, *, seed: int = 1, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    lengths = torch.randint(2, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    return ids, lengths


def perturb_(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.anyio
async def test_reference_logprobs_match_a_direct_computation_on_the_reference_weights():
    model = TinyLM()
    reference = snapshot(model)
    w = TorchPolicyWorker(model, micro_batch_size=2)
    try:
        perturb_(model)  # training moved on: live weights differ from the reference
        ids, lengths = make_batch()
        out = await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths})
        got = out["reference_logprobs"]
        assert type(out) is dict and set(out) == {"reference_logprobs"}
        assert got.shape == ids.shape and got.dtype == torch.float32 and got.device.type == "cpu"
        torch.testing.assert_close(got, direct_logprobs(model, reference, ids, lengths), rtol=0, atol=1e-5)
        # A wrong swap (live weights used) would match this instead.
        assert not torch.allclose(got, direct_logprobs(model, snapshot(model), ids, lengths), atol=1e-3)
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_explicit_reference_state_dict_on_the_models_tiny_preset():
    from policyworker.models import get_preset
    from policyworker.models.toy_model import build_model

    config = get_preset("tiny")
    model = build_model(config, seed=0)
    reference = snapshot(build_model(config, seed=1))
    w = TorchPolicyWorker(model, reference_state_dict=reference, micro_batch_size=3)
    try:
        live = snapshot(model)
        ids, lengths = make_batch(4, 10, vocab=config.vocab_size)
        got = (await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths}))[
            "reference_logprobs"
        ]
        torch.testing.assert_close(got, direct_logprobs(model, reference, ids, lengths), rtol=0, atol=1e-5)
        assert_same_weights(model, live)
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_hf_style_output_and_tied_weights():
    model = TinyLM(tied=True, hf_output=True)
    reference = snapshot(model)
    w = TorchPolicyWorker(model)
    try:
        perturb_(model)
        assert model.head.weight is model.embed.weight
        ids, lengths = make_batch(3, 8)
        got = (await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths}))[
            "reference_logprobs"
        ]
        torch.testing.assert_close(got, direct_logprobs(model, reference, ids, lengths), rtol=0, atol=1e-5)
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_position_zero_and_padding_are_zero_and_padding_values_are_ignored():
    model = TinyLM()
    w = TorchPolicyWorker(model)
    try:
        seq = 6
        ids = torch.randint(0, VOCAB, (4, seq))
        lengths = torch.tensor([0, 1, 3, seq])
        padded = ids.clone()
        for b, n in enumerate(lengths.tolist()):
            padded[b, n:] = -100  # a typical label pad; never reaches the model
        got = (await w.get_reference_policy_logprobs(data={"input_ids": padded, "input_lengths": lengths}))[
            "reference_logprobs"
        ]
        assert torch.all(got[:, 0] == 0)
        assert torch.all(got[0] == 0) and torch.all(got[1] == 0)
        assert torch.all(got[2, 3:] == 0) and torch.all(got[2, 1:3] < 0)
        assert torch.all(got[3, 1:] < 0)
        clean = (await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths}))[
            "reference_logprobs"
        ]
        torch.testing.assert_close(got, clean, rtol=0, atol=1e-6)
        empty = (await w.get_reference_policy_logprobs(
            data={"input_ids": torch.zeros(0, seq, dtype=torch.long), "input_lengths": torch.zeros(0, dtype=torch.long)}
        ))["reference_logprobs"]
        assert empty.shape == (0, seq)
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_live_weights_mode_and_grads_survive_the_swap_and_the_backup_is_reused():
    model = TinyLM()
    w = TorchPolicyWorker(model)
    try:
        perturb_(model)
        model.train()
        model.mix.eval()  # a part kept in eval on purpose keeps its own mode
        model(torch.randint(0, VOCAB, (2, 4))).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        live = snapshot(model)
        ids, lengths = make_batch()
        data = {"input_ids": ids, "input_lengths": lengths}
        first = (await w.get_reference_policy_logprobs(data=data))["reference_logprobs"]
        assert_same_weights(model, live)
        backup_ptrs = [t.data_ptr() for t in w._backup]
        param_ptrs = [p.data_ptr() for p in model.parameters()]
        second = (await w.get_reference_policy_logprobs(data=data))["reference_logprobs"]
        assert torch.equal(first, second)  # dropout was off, same reference both times
        assert_same_weights(model, live)
        assert [t.data_ptr() for t in w._backup] == backup_ptrs  # allocated once
        assert [p.data_ptr() for p in model.parameters()] == param_ptrs  # copied in place
        assert model.training and model.drop.training and not model.mix.training
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, grads[n]), n
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_live_weights_are_restored_when_the_forward_raises():
    model = TinyLM()
    w = TorchPolicyWorker(model)
    try:
        perturb_(model)
        live = snapshot(model)
        model.fail = True
        ids, lengths = make_batch()
        with pytest.raises(RuntimeError, match="on purpose"):
            await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths})
        assert_same_weights(model, live)
        assert model.training
        model.fail = False
        await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths})
        assert_same_weights(model, live)
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_results_do_not_depend_on_the_micro_batch_size():
    from policyworker.models import get_preset
    from policyworker.models.toy_model import build_model

    config = get_preset("tiny")
    w = TorchPolicyWorker(build_model(config, seed=0), micro_batch_size=8)
    try:
        ids, lengths = make_batch(7, 16, vocab=config.vocab_size)
        data = {"input_ids": ids, "input_lengths": lengths}
        base = (await w.get_reference_policy_logprobs(data=data))["reference_logprobs"]
        for mbs in (1, 3, 7):
            other = (await w.get_reference_policy_logprobs(data=data, micro_batch_size=mbs))["reference_logprobs"]
            torch.testing.assert_close(other, base, rtol=0, atol=1e-5)  # the documented tolerance
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_bf16_weights_give_float32_logprobs_close_to_the_direct_computation():
    from policyworker.models import get_preset
    from policyworker.models.toy_model import build_model

    config = get_preset("tiny")
    model = build_model(config, seed=0, dtype=torch.bfloat16)
    reference = snapshot(model)
    w = TorchPolicyWorker(model, micro_batch_size=2)
    try:
        perturb_(model)
        ids, lengths = make_batch(5, 12, vocab=config.vocab_size)
        got = (await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths}))[
            "reference_logprobs"
        ]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, direct_logprobs(model, reference, ids, lengths), rtol=0, atol=2e-2)
        assert w.get_gpu_info()["model_dtype"] == "bfloat16"
    finally:
        await w.shutdown()


def _bad_inputs():
    ids, lengths = make_batch(3, 6)
    return {
        "not a mapping": ([ids, lengths], None),
        "no input_ids": ({"input_lengths": lengths}, None),
        "no input_lengths": ({"input_ids": ids}, None),
        "ids not a tensor": ({"input_ids": ids.tolist(), "input_lengths": lengths}, None),
        "float ids": ({"input_ids": ids.float(), "input_lengths": lengths}, None),
        "1-d ids": ({"input_ids": ids[0], "input_lengths": lengths[:1]}, None),
        "2-d lengths": ({"input_ids": ids, "input_lengths": lengths.unsqueeze(1)}, None),
        "float lengths": ({"input_ids": ids, "input_lengths": lengths.float()}, None),
        "lengths of the wrong size": ({"input_ids": ids, "input_lengths": lengths[:2]}, None),
        "length above S": ({"input_ids": ids, "input_lengths": torch.tensor([6, 7, 2])}, None),
        "negative length": ({"input_ids": ids, "input_lengths": torch.tensor([6, -1, 2])}, None),
        "negative token inside a sequence": (
            {"input_ids": torch.where(torch.arange(6) == 1, -5, ids), "input_lengths": lengths}, None),
        "micro_batch_size 0": ({"input_ids": ids, "input_lengths": lengths}, 0),
        "micro_batch_size -2": ({"input_ids": ids, "input_lengths": lengths}, -2),
        "micro_batch_size True": ({"input_ids": ids, "input_lengths": lengths}, True),
        "micro_batch_size 2.0": ({"input_ids": ids, "input_lengths": lengths}, 2.0),
    }


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(_bad_inputs()))
async def test_bad_inputs_raise_config_error_and_change_nothing(case):
    data, mbs = _bad_inputs()[case]
    model = TinyLM()
    w = TorchPolicyWorker(model)
    try:
        perturb_(model)
        live = snapshot(model)
        with pytest.raises(ConfigError):
            await w.get_reference_policy_logprobs(data=data, micro_batch_size=mbs)
        assert_same_weights(model, live)
        assert w._backup is None  # rejected before any weight moved
        assert w.is_alive()
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_token_beyond_the_vocab_is_a_config_error_when_the_model_says_its_vocab():
    from policyworker.models import get_preset
    from policyworker.models.toy_model import build_model

    config = get_preset("tiny")
    w = TorchPolicyWorker(build_model(config, seed=0))
    try:
        ids = torch.full((1, 4), config.vocab_size)
        with pytest.raises(ConfigError, match="vocab_size"):
            await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": torch.tensor([4])})
    finally:
        await w.shutdown()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"micro_batch_size": 0},
        {"reference_state_dict": {"embed.weight": torch.zeros(VOCAB, 16)}},  # lacks the rest
        {"reference_state_dict": {**TinyLM().state_dict(), "nope.weight": torch.zeros(1)}},
        {"reference_state_dict": {**TinyLM().state_dict(), "mix.bias": torch.zeros(3)}},
        {"reference_state_dict": {**TinyLM().state_dict(), "mix.bias": [0.0] * 16}},
        {"reference_state_dict": [("embed.weight", torch.zeros(VOCAB, 16))]},
    ],
    ids=["mbs0", "missing", "unknown", "shape", "not-a-tensor", "not-a-mapping"],
)
def test_bad_constructor_arguments_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        TorchPolicyWorker(TinyLM(), **kwargs)
    with pytest.raises(ConfigError):
        TorchPolicyWorker("not a module")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_profile_captures_the_forward_on_the_executor_thread():
    w = TorchPolicyWorker(TinyLM(), device="cpu")  # a CUDA worker profiles into nsys instead
    try:
        executor_tid = await w._run(threading.get_native_id)
        w.start_gpu_profiling()
        ids, lengths = make_batch()
        await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths})
        path = w.stop_gpu_profiling()
        assert path and os.path.exists(path)
        with open(path) as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        softmax = [e for e in events if "log_softmax" in str(e.get("name"))]
        assert softmax, "the reference forward is missing from the trace"
        assert any(e.get("tid") == executor_tid for e in softmax)
        assert any(e.get("name") == "aten::embedding" for e in events)
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_gpu_info_has_model_facts_and_peak_memory_resets():
    model = TinyLM(tied=True)
    w = TorchPolicyWorker(model, device="cpu")
    try:
        info = w.get_gpu_info()
        unique = list(model.parameters())
        assert info["model_param_count"] == sum(p.numel() for p in unique)
        assert info["model_param_bytes"] == 4 * info["model_param_count"]
        assert info["model_dtype"] == "float32" and info["model_dtypes"] == ["float32"]
        assert info["reference_weights_bytes"] == info["model_param_bytes"]
        assert info["reference_weights_pinned"] is torch.cuda.is_available()
        w.reset_peak_memory_stats()
        peak = w.get_gpu_info()["peak_memory_bytes"]
        assert isinstance(peak, int) and peak > 0
        json.dumps(info)  # plain data a controller can ship anywhere
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_finish_training_drops_grads_and_buffers_and_logprobs_still_work():
    model = TinyLM()
    w = TorchPolicyWorker(model)
    try:
        model(torch.randint(0, VOCAB, (2, 4))).sum().backward()
        ids, lengths = make_batch()
        data = {"input_ids": ids, "input_lengths": lengths}
        before = (await w.get_reference_policy_logprobs(data=data))["reference_logprobs"]
        assert w._backup is not None
        await w.finish_training()
        assert w._backup is None
        assert all(p.grad is None for p in model.parameters())
        after = (await w.get_reference_policy_logprobs(data=data))["reference_logprobs"]
        assert torch.equal(before, after)
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_refit_needs_a_plan_and_groups_and_for_demo_builds_a_working_worker():
    w = TorchPolicyWorker.for_demo(rank=1, world_size=2, timeout_s=5.0)
    try:
        assert (w.rank, w.world_size, w.timeout_s) == (1, 2, 5.0)
        with pytest.raises(ConfigError, match="prepare_nccl_reshard_refit_info"):
            await w.nccl_reshard_refit()
        info = await w.prepare_nccl_reshard_refit_info("tp=2", "tp=1", 2, 1)
        assert info["hash"] and info["train_world_size"] == 2
        with pytest.raises(ConfigError, match="init_nccl_reshard_comm_group"):
            await w.nccl_reshard_refit()
        with pytest.raises(ConfigError):
            await w.prepare_nccl_reshard_refit_info("tp=3", "tp=1", 3, 1)  # tp=3 does not divide 4 heads
        ids, lengths = make_batch(2, 5, vocab=256)
        out = await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": lengths})
        assert out["reference_logprobs"].shape == (2, 5)
    finally:
        assert await w.shutdown() is True
    assert not w.is_alive()
