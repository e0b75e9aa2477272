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
from policyworker.testing.delta_weights import perturb_, versioned_state
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
    {"delta": "yes"}, {"delta_max_fraction": 1.5}, {"delta_chain_fraction": -0.1}, {"delta_full_every": 0},
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


# -- delta mode -------------------------------------------------------------------------------
ASYNCIO = pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
CHANGED = 0.01


def _reference(version: int) -> dict[str, torch.Tensor]:
    """What the trainer holds at ``version`` in the delta tests, computed apart from it:
    weights(1), then ~1% of the elements' lowest bit flipped per version after it."""
    return versioned_state(weights(1), [0.0] + [CHANGED] * (version - 1))


def _disk_bytes(directory: str, version: int) -> int:
    vdir = os.path.join(directory, f"v{version:08d}")
    return sum(os.path.getsize(os.path.join(vdir, n)) for n in os.listdir(vdir))


async def _delta_step(trainer, rollouts, version, **refit):
    """The trainer publishes ``version`` (weights(1) perturbed) and every rollout in
    ``rollouts`` lands it; returns the reports."""
    with torch.no_grad():
        if version == 1:
            set_weights(trainer.model, 1)
        else:
            perturb_(dict(trainer.model.named_parameters()), CHANGED, version)
    sent = await trainer.refit("files", **refit)
    got = [await r.refit("files", refit_timeout_s=10.0) for r in rollouts]
    return sent, got


@ASYNCIO
@pytest.mark.timeout(60)
async def test_delta_versions_land_bit_exact_and_write_little(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, delta=True, keep=1, file_bytes=4096)
    full_bytes = sum(t.numel() * t.element_size() for t in weights(1).values())
    try:
        sent, (got,) = await _delta_step(trainer, [rollout], 1)
        assert sent.notes[0].startswith("full: no shadow") and sent.shadow_bytes == full_bytes
        assert exact(rollout.weights(), _reference(1))
        full_disk = _disk_bytes(d, 1)
        # a full version's manifest is what a writer without delta mode writes (no delta fields)
        with open(os.path.join(d, "v00000001", "manifest.json"), "rb") as f:
            assert b'"base"' not in f.read()
        for v in range(2, 6):
            sent, (got,) = await _delta_step(trainer, [rollout], v)
            assert sent.notes[0].startswith(f"delta over version {v - 1}"), sent.notes
            assert got.version == rollout.weight_version == v and not rollout.torn
            assert exact(rollout.weights(), _reference(v))
            # bytes written for a delta version, measured on disk: ~1.5% of the fp32 bytes at 1% changed
            written = _disk_bytes(d, v)
            assert sent.wire_bytes == got.wire_bytes <= written < 0.03 * full_disk, (written, full_disk)
            assert sent.bytes == got.bytes == full_bytes
            with open(os.path.join(d, f"v{v:08d}", "manifest.json"), "rb") as f:
                assert f'"base":{v - 1}'.encode() in f.read()
        # keep=1, yet the full version 1 and the deltas after it stay: a new rollout's chain
        assert committed(d) == [f"v{v:08d}" for v in range(1, 6)]
        # a per-refit full version on request; the next is a delta over it again
        sent, (got,) = await _delta_step(trainer, [rollout], 6, delta=False)
        assert sent.notes[0] == "full: the trainer asked for a full version" and "full + 0 delta" in got.notes[-1]
        assert exact(rollout.weights(), _reference(6)) and committed(d) == ["v00000006"]
        sent, (got,) = await _delta_step(trainer, [rollout], 7)
        assert sent.notes[0].startswith("delta over version 6") and exact(rollout.weights(), _reference(7))
        # every element changed: past delta_max_fraction, the version is full
        set_weights(trainer.model, 9)
        sent = await trainer.refit("files")
        got = await rollout.refit("files", refit_timeout_s=10.0)
        assert "over delta_max_fraction" in sent.notes[0] and got.version == 8 and exact(rollout.weights(), weights(9))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


@ASYNCIO
@pytest.mark.timeout(60)
async def test_delta_lagging_and_new_rollouts_land_the_newest_version(tmp_path):
    d = str(tmp_path / "refit")
    trainer, steady = await _attached(d, delta=True, delta_full_every=4)
    lagging = make_rollout()
    await lagging.attach_transport("files", directory=d, delta=True)
    try:
        await _delta_step(trainer, [steady, lagging], 1)
        for v in (2, 3):  # the lagging rollout misses these
            await _delta_step(trainer, [steady], v)
        # It holds version 1: it applies the deltas 2 and 3 to its own bytes (no full read).
        got = await lagging.refit("files", refit_timeout_s=10.0)
        assert got.version == 3 and "from version 1 + 2 delta(s)" in got.notes[-1]
        assert exact(lagging.weights(), _reference(3))
        # A new rollout reads the full version 1 and the deltas after it.
        new = make_rollout()
        await new.attach_transport("files", directory=d, delta=True)
        got = await new.refit("files", refit_timeout_s=10.0)
        assert got.version == 3 and "full + 2 delta(s)" in got.notes[-1] and exact(new.weights(), _reference(3))
        await new.shutdown()
        # delta_full_every=4: version 5 is full; the old chain is pruned (keep=2)
        sent, _ = await _delta_step(trainer, [steady, lagging], 4)
        assert sent.notes[0].startswith("delta")
        sent, got = await _delta_step(trainer, [steady, lagging], 5)
        assert sent.notes[0].startswith("full: a full version is due")
        assert all("full + 0 delta" in g.notes[-1] for g in got)
        assert committed(d) == ["v00000004", "v00000005"]
        assert exact(steady.weights(), _reference(5)) and exact(lagging.weights(), _reference(5))
    finally:
        for w in (trainer, steady, lagging):
            await w.shutdown()


@ASYNCIO
@pytest.mark.timeout(60)
async def test_corrupt_delta_fails_untouched_and_the_next_version_is_full(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, delta=True)
    try:
        await _delta_step(trainer, [rollout], 1)
        await _delta_step(trainer, [], 2)
        flip_byte(os.path.join(d, "v00000002", "delta-00000.bin"), -3)
        with pytest.raises(ProtocolError):
            await rollout.refit("files", refit_timeout_s=10.0)
        # refused before anything was applied: not torn, version 1's bytes; a request for a full version
        assert not rollout.torn and rollout.weight_version == 1 and exact(rollout.weights(), _reference(1))
        assert len([n for n in listing(d) if n.startswith("want-full-")]) == 1
        sent, (got,) = await _delta_step(trainer, [rollout], 3)
        assert sent.notes[0] == "full: 1 rollout request(s) for a full version"
        assert got.version == 3 and "full + 0 delta" in got.notes[-1] and exact(rollout.weights(), _reference(3))
        assert not [n for n in listing(d) if n.startswith("want-full-")]  # answered
        sent, (got,) = await _delta_step(trainer, [rollout], 4)
        assert sent.notes[0].startswith("delta over version 3") and exact(rollout.weights(), _reference(4))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


@ASYNCIO
@pytest.mark.timeout(60)
async def test_delta_onto_other_bytes_fails_its_checksum_torn_then_full(tmp_path):
    """A rollout whose bytes are not the base (changed behind the ledger's back): the
    delta applies, the checksums refuse the result, the rollout is torn (live bytes
    were written), and the writer's next version is full and lands."""
    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, delta=True)
    try:
        await _delta_step(trainer, [rollout], 1)
        name = sorted(rollout.params)[0]
        with torch.no_grad():
            rollout.params[name].view(-1)[-1] += 1.0
        await _delta_step(trainer, [], 2)
        with pytest.raises(ProtocolError) as info:
            await rollout.refit("files", refit_timeout_s=10.0)
        assert info.value.param == name and rollout.torn and rollout.weight_version == 1
        sent, (got,) = await _delta_step(trainer, [rollout], 3)
        assert sent.notes[0].startswith("full: 1 rollout request")
        assert not rollout.torn and rollout.weight_version == 3 and exact(rollout.weights(), _reference(3))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


@ASYNCIO
@pytest.mark.timeout(60)
async def test_check_transport_in_delta_mode(tmp_path):
    # delta_max_fraction=1: the suite's refits change every element, and still go as deltas
    factory = _pair_factory(str(tmp_path), MIXED, delta=True, delta_max_fraction=1.0, file_bytes=64, timeout_s=10.0)
    result = await check_transport(factory, refits=3)
    assert [r.version for r in result.reports] == [1, 1, 2, 2, 3, 3]
    assert [r.notes[0].split(" ")[0] for r in result.reports[::2]] == ["full:", "delta", "delta"]
    assert result.receive_steps > 2 and result.torn_checked


@ASYNCIO
async def test_delta_sides_must_agree(tmp_path):
    d = str(tmp_path / "refit")
    trainer, rollout = make_trainer(), make_rollout()
    try:
        results = await asyncio.gather(trainer.attach_transport("files", directory=d, delta=True),
                                       rollout.attach_transport("files", directory=d), return_exceptions=True)
        assert results[0] is None and isinstance(results[1], ConfigError)
    finally:
        await trainer.shutdown()
        await rollout.shutdown()


@ASYNCIO
@pytest.mark.timeout(60)
async def test_a_failed_delta_write_commits_nothing_and_the_next_version_is_full(tmp_path, monkeypatch):
    import policyworker_files.writer as writer

    d = str(tmp_path / "refit")
    trainer, rollout = await _attached(d, delta=True, file_bytes=4096)
    real, calls = writer.checksum_file, []

    def fail_on_the_second_file(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        return real(*args, **kwargs)

    try:
        await _delta_step(trainer, [rollout], 1)
        monkeypatch.setattr(writer, "checksum_file", fail_on_the_second_file)
        with pytest.raises(TransportError):
            await _delta_step(trainer, [], 2)
        monkeypatch.setattr(writer, "checksum_file", real)
        assert "delta-00001.bin" in calls[-1] and listing(d) == ["signature.json", "v00000001"]  # no half version
        # the shadow was half refreshed: it counts for nothing, the next version is full
        sent, (got,) = await _delta_step(trainer, [rollout], 3)
        assert sent.version == 2 and sent.notes[0].startswith("full: no shadow")
        assert got.version == 2 and exact(rollout.weights(), _reference(3))
    finally:
        await trainer.shutdown()
        await rollout.shutdown()
