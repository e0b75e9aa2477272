"""Asynchronous checkpoint save: snapshot, background write, atomic rename, errors."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from policyworker.workers import checkpoint
from policyworker.workers.checkpoint import TEMP_MARK, read_checkpoint, write_checkpoint
from policyworker.errors import CheckpointError, ConfigError, WorkerClosed
from policyworker.workers.torch_trainer import TorchPolicyWorker

from .test_torch_worker import TinyLM, perturb_, snapshot

GATE_TIMEOUT_S = 10.0


class GatedDump:
    """Replaces ``checkpoint._dump``: each write waits for ``release`` (bounded)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.calls = 0
        self._real = checkpoint._dump

    def __call__(self, payload, fileobj) -> None:
        self.calls += 1
        self.started.set()
        if not self.gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError("test gate never opened")
        self._real(payload, fileobj)

    def release(self) -> None:
        self.gate.set()


def files_in(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def assert_state_equal(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.mark.anyio
async def test_async_save_round_trips_bit_exact(tmp_path):
    model = TinyLM(tied=True)
    w = TorchPolicyWorker(model)
    try:
        perturb_(model)
        saved = snapshot(model)
        target = tmp_path / "step1.pt"
        await w.save_checkpoint(target)
        perturb_(model)  # training continues while the write runs
        await w.finalize_async_save()
        assert files_in(tmp_path) == ["step1.pt"]
        assert_state_equal(read_checkpoint(target), saved)
        await w.load_checkpoint(target)
        assert_state_equal(model.state_dict(), saved)
        assert model.head.weight is model.embed.weight  # load copies in place
        # A second save reuses the snapshot buffer instead of allocating again.
        ptrs = {k: t.data_ptr() for k, t in w._checkpointer.buffer.items()}
        await w.save_checkpoint(tmp_path / "step2.pt")
        await w.finalize_async_save()
        assert {k: t.data_ptr() for k, t in w._checkpointer.buffer.items()} == ptrs
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_save_returns_after_the_snapshot_and_writes_on_another_thread(tmp_path, monkeypatch):
    gated = GatedDump()
    monkeypatch.setattr(checkpoint, "_dump", gated)
    model = TinyLM()
    w = TorchPolicyWorker(model)
    try:
        saved = snapshot(model)
        target = tmp_path / "ckpt.pt"
        await w.save_checkpoint(target)  # returns although the write is held at the gate
        assert gated.started.wait(GATE_TIMEOUT_S)
        assert not target.exists()
        perturb_(model)
        # The refit executor is free while the writer thread is busy.
        ids = torch.randint(0, 32, (2, 5))
        await w.get_reference_policy_logprobs(data={"input_ids": ids, "input_lengths": torch.tensor([5, 3])})
        gated.release()
        await w.finalize_async_save()
        assert_state_equal(read_checkpoint(target), saved)
    finally:
        gated.release()
        await w.shutdown()


def _failing_dump(payload, fileobj) -> None:
    fileobj.write(b"PARTIAL-BYTES" * 100)  # the crash comes mid-file
    raise OSError(28, "No space left on device")


@pytest.mark.anyio
async def test_a_failed_write_surfaces_from_finalize_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_dump", _failing_dump)
    w = TorchPolicyWorker(TinyLM())
    try:
        target = tmp_path / "ckpt.pt"
        await w.save_checkpoint(target)
        with pytest.raises(CheckpointError) as info:
            await w.finalize_async_save()
        assert info.value.path == str(target)
        assert isinstance(info.value.__cause__, OSError)
        assert files_in(tmp_path) == []  # neither the final name nor a temp file
        await w.finalize_async_save()  # each failure is raised once
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_a_missing_directory_fails_the_write_not_the_caller(tmp_path):
    w = TorchPolicyWorker(TinyLM())
    try:
        await w.save_checkpoint(tmp_path / "no" / "such" / "dir" / "ckpt.pt")
        with pytest.raises(CheckpointError):
            await w.finalize_async_save()
        with pytest.raises(ConfigError):
            await w.save_checkpoint(12)
        with pytest.raises(ConfigError):
            await w.save_checkpoint("")
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_the_next_save_raises_an_unfinalized_failure_first(tmp_path, monkeypatch):
    real = checkpoint._dump

    def fail_only_a(payload, fileobj):
        (_failing_dump if ".a.pt" in fileobj.name else real)(payload, fileobj)

    monkeypatch.setattr(checkpoint, "_dump", fail_only_a)
    w = TorchPolicyWorker(TinyLM())
    try:
        await w.save_checkpoint(tmp_path / "a.pt")
        with pytest.raises(CheckpointError) as info:
            await w.save_checkpoint(tmp_path / "b.pt")
        assert info.value.path == str(tmp_path / "a.pt")
        assert files_in(tmp_path) == []  # b was not started
        await w.save_checkpoint(tmp_path / "b.pt")  # a retry goes through
        await w.finalize_async_save()
        assert files_in(tmp_path) == ["b.pt"]
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_a_second_save_waits_for_the_first_write(tmp_path, monkeypatch):
    gated = GatedDump()
    monkeypatch.setattr(checkpoint, "_dump", gated)
    model = TinyLM()
    w = TorchPolicyWorker(model)
    try:
        first = snapshot(model)
        await w.save_checkpoint(tmp_path / "1.pt")
        perturb_(model)
        second = snapshot(model)
        done = anyio.Event()

        async def save_again():
            # Two saves in flight at once: the second must not overwrite the snapshot
            # buffer while the first write still reads it.
            await w._run(w._snapshot, str(tmp_path / "2.pt"))
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(save_again)
            await anyio.sleep(0.3)
            assert not done.is_set()
            assert_state_equal(dict(w._checkpointer.buffer), first)
            gated.release()
        await w.finalize_async_save()
        assert_state_equal(read_checkpoint(tmp_path / "1.pt"), first)
        assert_state_equal(read_checkpoint(tmp_path / "2.pt"), second)
    finally:
        gated.release()
        await w.shutdown()


@pytest.mark.anyio
async def test_shutdown_waits_for_a_pending_save(tmp_path, monkeypatch):
    gated = GatedDump()
    monkeypatch.setattr(checkpoint, "_dump", gated)
    model = TinyLM()
    w = TorchPolicyWorker(model)
    saved = snapshot(model)
    target = tmp_path / "last.pt"
    await w.save_checkpoint(target)
    finished = anyio.Event()

    async def close():
        assert await w.shutdown() is True
        finished.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            await anyio.sleep(0.3)
            assert not finished.is_set() and not target.exists()
            gated.release()
    finally:
        gated.release()
    assert_state_equal(read_checkpoint(target), saved)
    assert not w.is_alive()
    with pytest.raises(WorkerClosed):
        await w.save_checkpoint(tmp_path / "late.pt")


@pytest.mark.anyio
async def test_shutdown_raises_an_unfinalized_failure_after_closing(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_dump", _failing_dump)
    w = TorchPolicyWorker(TinyLM())
    await w.save_checkpoint(tmp_path / "x.pt")
    with pytest.raises(CheckpointError):
        await w.shutdown()
    assert not w.is_alive()
    assert await w.shutdown() is True
    assert files_in(tmp_path) == []


@pytest.mark.anyio
async def test_finish_training_waits_for_the_save_and_frees_the_snapshot(tmp_path):
    w = TorchPolicyWorker(TinyLM())
    try:
        await w.save_checkpoint(tmp_path / "c.pt")
        await w.finish_training()
        assert (tmp_path / "c.pt").exists()
        assert w._checkpointer.buffer is None
    finally:
        await w.shutdown()


@pytest.mark.anyio
async def test_loading_a_mismatched_checkpoint_changes_nothing(tmp_path):
    model = TinyLM()
    w = TorchPolicyWorker(model)
    try:
        live = snapshot(model)
        other = {k: v for k, v in TinyLM(hidden=8).state_dict().items()}
        write_checkpoint(other, tmp_path / "other.pt")
        with pytest.raises(CheckpointError, match="does not match"):
            await w.load_checkpoint(tmp_path / "other.pt")
        write_checkpoint({"embed.weight": live["embed.weight"]}, tmp_path / "partial.pt")
        with pytest.raises(CheckpointError, match="missing"):
            await w.load_checkpoint(tmp_path / "partial.pt")
        torch.save({"weights": 1}, tmp_path / "foreign.pt")
        with pytest.raises(CheckpointError, match="not a policyworker checkpoint"):
            await w.load_checkpoint(tmp_path / "foreign.pt")
        with pytest.raises(CheckpointError):
            await w.load_checkpoint(tmp_path / "absent.pt")
        for name, value in model.state_dict().items():
            assert torch.equal(value, live[name])
    finally:
        await w.shutdown()


def test_a_failed_write_leaves_an_existing_file_untouched(tmp_path, monkeypatch):
    target = tmp_path / "keep.pt"
    old = {"w": torch.arange(4.0)}
    write_checkpoint(old, target)
    monkeypatch.setattr(checkpoint, "_dump", _failing_dump)
    with pytest.raises(CheckpointError):
        write_checkpoint({"w": torch.zeros(4)}, target)
    assert files_in(tmp_path) == ["keep.pt"]
    assert not any(TEMP_MARK in name for name in files_in(tmp_path))
    monkeypatch.undo()
    assert torch.equal(read_checkpoint(target)["w"], old["w"])
