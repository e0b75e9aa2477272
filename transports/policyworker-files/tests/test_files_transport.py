"""The files transport in one process: the conformance suite, then the workers' road
(``attach_transport`` / ``refit``) with corrupt files, timeouts, aborts, pruning and
mismatched peers. Every weight check is bit for bit."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time

import anyio
import pytest
import torch

from files_helpers import committed, exact, flip_byte, listing, make_rollout, make_trainer, set_weights, weights
from policyworker import RolloutWorker
from policyworker.errors import (
    ConfigError,
    PlanMismatch,
    ProtocolError,
    RefitAborted,
    RefitTimeout,
    TornWeights,
    TransportError,
)
from policyworker.models import get_preset
from policyworker.models.toy_model import build_model
from policyworker.registry import default_registry
from policyworker.testing import TransportPair, check_transport, plain_pair
from policyworker.runtime.watchdog import process_watchdog
from policyworker_files import FilesTransport
from policyworker_files.reader import OpenVersion

pytestmark = pytest.mark.anyio


def _pair_factory(root, params, **setup):
    """A conformance factory: real workers that attach the plugin by its entry-point name,
    as a user does. Each pair gets a directory of its own: the suite asks for fresh pairs
    (a never-sent version must not find the versions an earlier pair committed)."""
    count = itertools.count()

    async def factory() -> TransportPair:
        directory = os.path.join(root, f"pair-{next(count)}")
        return plain_pair("files", params, setup={"directory": directory, **setup})

    return factory


MIXED = {
    "a.weight": torch.zeros(7, 5),
    "b.weight": torch.zeros(3, 4, dtype=torch.bfloat16),
    "c.bias": torch.zeros(11, dtype=torch.float16),
    "d.index": torch.zeros(6, dtype=torch.int64),
    "e.empty": torch.zeros(0, 4),
}
BACKENDS = [pytest.param(("asyncio", {}), id="asyncio"), pytest.param(("trio", {}), id="trio")]


@pytest.mark.parametrize("anyio_backend", BACKENDS)
@pytest.mark.parametrize("checksum", ["sha256", "crc32"])
async def test_check_transport(tmp_path, checksum):
    factory = _pair_factory(str(tmp_path), MIXED, checksum=checksum, file_bytes=64, timeout_s=10.0)
    result = await check_transport(factory, refits=3)
    assert [r.version for r in result.reports] == [1, 1, 2, 2, 3, 3]
    assert committed(str(tmp_path / "pair-0")) == ["v00000002", "v00000003"]  # keep=2
    # One verify step, then one copy step per file (file_bytes=64: several files): cuts
    # between files leave written bytes behind, and the suite saw them torn.
    assert result.receive_steps > 2 and result.torn_checked
    assert all(c["torn"] for c in result.cuts if c["changed"])


async def test_entry_point_is_the_plugin():
    assert default_registry().load("files") is FilesTransport


async def _attached(directory, *, rollout=None, **setup):
    trainer = make_trainer()
    rollout = rollout or make_rollout()
    await asyncio.gather(trainer.attach_transport("files", directory=directory, **setup),
                         rollout.attach_transport("files", directory=directory, **setup))
    return trainer, rollout


async def _step(trainer, rollout, version, **refit):
    set_weights(trainer.model, version)
    sent = await trainer.refit("files")
    got = await rollout.refit("files", refit_timeout_s=10.0, **refit)
    return sent, got


async def test_workers_refit_bit_exact_and_prune(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, keep=3, file_bytes=50_000)
    try:
        for v in range(1, 6):
            sent, got = await _step(trainer, rollout, v)
            assert (sent.version, got.version, rollout.weight_version) == (v, v, v)
            assert sent.bytes == got.bytes == sum(t.numel() * t.element_size() for t in weights(v).values())
            assert sent.buckets == got.buckets > 1
            assert exact(rollout.weights(), weights(v))
        # keep=3: exactly the newest three versions, and nothing hidden left behind
        assert listing(d) == ["signature.json", "v00000003", "v00000004", "v00000005"]
        assert trainer.transport_version("files") == 5
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


@pytest.mark.parametrize("where", ["data", "header", "manifest"])
async def test_corrupt_version_is_refused_untouched(tmp_path, where):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d)
    try:
        await _step(trainer, rollout, 1)
        set_weights(trainer.model, 2)
        await trainer.refit("files")
        vdir = os.path.join(d, "v00000002")
        if where == "manifest":
            flip_byte(os.path.join(vdir, "manifest.json"), 40)
        else:
            flip_byte(os.path.join(vdir, "part-00000.safetensors"), -3 if where == "data" else 12)
        with pytest.raises(ProtocolError):
            await rollout.refit("files", refit_timeout_s=10.0)
        # verified before anything was copied: not torn, still version 1, v1's bytes
        assert not rollout.torn and rollout.weight_version == 1
        assert exact(rollout.weights(), weights(1))
        # the next good version lands (catching up past the corrupt one)
        sent, got = await _step(trainer, rollout, 3)
        assert got.version == 3 and exact(rollout.weights(), weights(3))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_never_written_version_times_out_inside_the_deadline(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d)
    try:
        await _step(trainer, rollout, 1)
        t0 = time.monotonic()
        with pytest.raises(RefitTimeout):
            await rollout.refit("files", refit_timeout_s=0.5)
        assert time.monotonic() - t0 < 0.5 + 5.0  # bounded by the deadline (generous slack: shared CPU)
        assert rollout.weight_version == 1 and not rollout.torn
        assert exact(rollout.weights(), weights(1))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_setup_timeout_bounds_a_refit_without_deadline(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, timeout_s=0.3)
    try:
        with pytest.raises(RefitTimeout):
            await rollout.refit("files")
        assert rollout.weight_version == 0 and not rollout.torn
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_after_a_stand_down_the_setup_timeout_bounds_the_wait(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, timeout_s=60.0)
    deadline_s = 1.0
    outcome = {}

    async def receive():
        outcome["report"] = await rollout.refit("files", refit_timeout_s=deadline_s)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            with anyio.fail_after(10):
                while process_watchdog().armed_count(rollout) == 0:
                    await anyio.sleep(0.005)
            assert rollout.stand_down_refit_watchdog() == 1
            await anyio.sleep(deadline_s * 1.5)  # past the stood-down deadline: the wait goes on
            set_weights(trainer.model, 1)
            await trainer.refit("files")
        assert outcome["report"].version == rollout.weight_version == 1
        assert exact(rollout.weights(), weights(1))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_abort_from_another_thread_cuts_the_wait(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, timeout_s=60.0)
    transport = rollout.attachment("files").transport
    timer = threading.Timer(0.2, transport.abort)
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(RefitAborted) as info:
            await rollout.refit("files")
        assert not isinstance(info.value, RefitTimeout)
        assert time.monotonic() - t0 < 30.0
        assert rollout.weight_version == 0 and not rollout.torn
        await _step(trainer, rollout, 1)  # the transport works again after an abort
        assert exact(rollout.weights(), weights(1))
    finally:
        timer.cancel()
        await trainer.shutdown()
        await rollout.shutdown()


async def test_cancelled_refit_keeps_the_old_version(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d)
    try:
        await _step(trainer, rollout, 1)
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.3):
                await rollout.refit("files")
        assert rollout.weight_version == 1 and not rollout.torn
        assert exact(rollout.weights(), weights(1))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_abort_mid_copy_leaves_the_rollout_torn(tmp_path, monkeypatch):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d)
    transport = rollout.attachment("files").transport
    real = OpenVersion.copy_into

    def one_tensor_then_abort(self, dests, stop):
        first = dict(list(dests.items())[:1])
        real(self, first, stop)
        transport.abort()
        return real(self, dests, stop)

    try:
        await _step(trainer, rollout, 1)
        set_weights(trainer.model, 2)
        await trainer.refit("files")
        monkeypatch.setattr(OpenVersion, "copy_into", one_tensor_then_abort)
        with pytest.raises(RefitAborted):
            await rollout.refit("files", refit_timeout_s=10.0)
        assert rollout.torn and rollout.weight_version == 1
        with pytest.raises(TornWeights):
            rollout.weights()
        monkeypatch.setattr(OpenVersion, "copy_into", real)
        sent, got = await _step(trainer, rollout, 3)
        assert not rollout.torn and rollout.weight_version == 3 and exact(rollout.weights(), weights(3))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_a_rollout_that_fell_behind_catches_up(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, keep=2)
    try:
        for v in (1, 2, 3):
            set_weights(trainer.model, v)
            await trainer.refit("files")
        assert committed(d) == ["v00000002", "v00000003"]  # the expected v1 is gone
        got = await rollout.refit("files", refit_timeout_s=10.0)
        assert got.version == rollout.weight_version == 3 and "caught up" in got.notes[0]
        assert exact(rollout.weights(), weights(3))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_reading_while_the_writer_commits_and_prunes(tmp_path):
    """keep=1 and a writer going flat out: versions vanish while the rollout lists,
    opens and hashes them. Whatever lands must be one whole version, bit for bit."""
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, keep=1, fsync=False, file_bytes=60_000)
    last = 8
    landed = []

    async def write_all():
        for v in range(1, last + 1):
            set_weights(trainer.model, v)
            await trainer.refit("files")

    async def read_until_last():
        while rollout.weight_version < last:
            got = await rollout.refit("files", refit_timeout_s=30.0)
            assert exact(rollout.weights(), weights(got.version)), got.version
            landed.append(got.version)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(write_all)
            tg.start_soon(read_until_last)
        assert landed == sorted(set(landed)) and landed[-1] == last
        assert committed(d) == [f"v{last:08d}"]
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_mismatched_rollout_fails_at_connect(tmp_path):
    d = str(tmp_path / "refit")
    trainer = make_trainer()
    bad = {name: torch.zeros_like(p.detach()) for name, p in trainer.model.named_parameters()}
    name = sorted(bad)[3]
    bad[name] = torch.zeros(bad[name].numel() + 1)
    rollout = RolloutWorker(params=bad, device="cpu")
    try:
        results = await asyncio.gather(trainer.attach_transport("files", directory=d),
                                       rollout.attach_transport("files", directory=d), return_exceptions=True)
        assert results[0] is None
        assert isinstance(results[1], PlanMismatch) and results[1].param == name
        assert torch.count_nonzero(rollout.params[name]) == 0
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_a_trainer_of_another_model_is_refused_an_old_directory(tmp_path):
    d = str(tmp_path / "refit")
    trainer = make_trainer()
    await trainer.attach_transport("files", directory=d)
    await trainer.refit("files")
    await trainer.shutdown()
    other = make_trainer_of(get_preset("tiny").with_(hidden_size=get_preset("tiny").hidden_size * 2))
    try:
        with pytest.raises(PlanMismatch):
            await other.attach_transport("files", directory=d)
    finally:
        await other.shutdown()


def make_trainer_of(config):
    from policyworker import TorchPolicyWorker

    return TorchPolicyWorker(build_model(config, seed=0), device="cpu")


async def test_restarted_trainer_continues_the_numbering(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d)
    try:
        await _step(trainer, rollout, 1)
        await _step(trainer, rollout, 2)
        await trainer.shutdown()
        trainer = make_trainer()
        await trainer.attach_transport("files", directory=d)
        assert trainer.transport_version("files") == 2
        sent, got = await _step(trainer, rollout, 3)
        assert sent.version == got.version == 3 and exact(rollout.weights(), weights(3))
        with pytest.raises(ConfigError):
            await trainer.refit("files", version=3)  # not past the newest committed
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


async def test_only_the_writer_rank_writes(tmp_path):
    d = str(tmp_path / "refit")
    writer = make_trainer(rank=0, world_size=2)
    other = make_trainer(rank=1, world_size=2)
    rollout = make_rollout()
    try:
        await asyncio.gather(writer.attach_transport("files", directory=d),
                             other.attach_transport("files", directory=d),
                             rollout.attach_transport("files", directory=d))
        set_weights(other.model, 7)  # rank 1's weights never reach the directory
        set_weights(writer.model, 1)
        # Rank 1 runs ahead of the writer: it waits for the version it reports.
        quiet = asyncio.ensure_future(other.refit("files", refit_timeout_s=10.0))
        await asyncio.sleep(0.3)
        assert not quiet.done() and committed(d) == []
        sent = await writer.refit("files")
        quiet = await quiet
        assert sent.version == 1 and sent.bytes > 0
        assert (quiet.version, quiet.bytes) == (1, 0) and "published version 1" in quiet.notes[0]
        await rollout.refit("files", refit_timeout_s=10.0)
        assert exact(rollout.weights(), weights(1))
        # No writer refit: rank 1's next refit is refused in time, typed, reporting nothing.
        with pytest.raises(RefitTimeout):
            await other.refit("files", refit_timeout_s=0.5)
        assert other.transport_version("files") == 1
    finally:
        for w in (writer, other, rollout):
            await w.shutdown()


@pytest.mark.parametrize("setup", [
    {"keep": 0}, {"checksum": "md5"}, {"file_bytes": 0}, {"timeout_s": 0}, {"poll_s": -1.0},
    {"writer_rank": -1}, {"directory": 123}, {"directory": None}, {"bogus": 1}, {"keep": "2"},
])
async def test_bad_setup_is_a_config_error_at_attach(tmp_path, setup):
    setup = {"directory": str(tmp_path / "refit"), **setup}
    rollout = make_rollout()
    try:
        with pytest.raises(ConfigError):
            await rollout.attach_transport("files", **setup)
        assert not os.path.exists(tmp_path / "refit")
    finally:
        await rollout.shutdown()


async def test_bad_setup_is_refused_at_construction(tmp_path):
    # The deprecated transport_options= spelling still checks a plugin's setup when given (and warns).
    with pytest.raises(ConfigError), pytest.warns(DeprecationWarning, match="attach_transport"):
        make_rollout_with_options({"files": {"directory": str(tmp_path), "keep": 0}})
    with pytest.raises(ConfigError):
        FilesTransport(directory=str(tmp_path), checksum="md5")


def make_rollout_with_options(options):
    return RolloutWorker(params={"w": torch.zeros(2)}, device="cpu", transport_options=options)


async def test_a_writer_rank_outside_the_world_is_refused(tmp_path):
    trainer = make_trainer()
    try:
        with pytest.raises(ConfigError):
            await trainer.attach_transport("files", directory=str(tmp_path / "refit"), writer_rank=1)
    finally:
        await trainer.shutdown()


async def test_connect_cleans_only_its_own_rank_leftovers(tmp_path):
    d = tmp_path / "refit"
    for name in (".v00000001.tmp-r0-00aa11bb", ".v00000001.tmp-r1-22cc33dd", ".v00000004.old-44ee55ff"):
        (d / name).mkdir(parents=True)
        (d / name / "part-00000.safetensors").write_bytes(b"partial")
    (d / ".signature.json.tmp-66aa77bb").write_bytes(b"{")
    trainer = make_trainer()
    try:
        await trainer.attach_transport("files", directory=str(d))
        # rank 0's temporary, the unfinished prune and the half signature are gone; rank 1's stays
        assert listing(str(d)) == [".v00000001.tmp-r1-22cc33dd", "signature.json"]
    finally:
        await trainer.shutdown()


async def test_filesystem_errors_are_transport_errors(tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_bytes(b"x")
    trainer = make_trainer()
    try:
        with pytest.raises(TransportError) as info:
            await trainer.attach_transport("files", directory=str(not_a_dir))
        assert isinstance(info.value.__cause__, OSError) and info.value.transport == "files"
    finally:
        await trainer.shutdown()
