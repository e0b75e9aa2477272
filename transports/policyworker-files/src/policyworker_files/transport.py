"""FilesTransport: refit through a directory that the trainer and the rollouts share.

Plan-less: the sender's ``ctx.params`` are its named tensors (a ``TorchPolicyWorker``'s
parameters), the receiver's its destinations (``RolloutWorker(params=...)``) with the
same names, dtypes and shapes. Layout on disk and commit protocol: ``dirs``.

Order of operations (the two sides never talk; the directory is the channel):

* ``connect`` — sender: create the directory, delete its own rank's leftover
  temporaries, continue the version numbering past the newest committed version
  (a restarted trainer does not rewrite old versions), and on the writer rank write
  ``signature.json`` (``PlanMismatch`` if committed versions of other tensors are
  there). Receiver: wait (``timeout_s``, abortable) for ``signature.json`` and compare
  it with its destinations — a mismatched pairing fails here, ``PlanMismatch``.
* ``send(ctx, v)`` — on ``writer_rank``: write ``v`` (``writer``), commit it by
  rename, prune to the newest ``keep``. A ``v`` not past the newest committed version
  is refused (``ConfigError``). Every other trainer rank writes nothing: its refit
  ``k`` of the writer's session (``signature.json``: session, base) waits until the
  writer published version ``base + k`` (that version or a newer one of the same
  session is committed), then reports it with 0 bytes — a rank that runs ahead of the
  writer waits (bounded, ``RefitTimeout``), one that starts late reports the versions
  the writer already published; a new writer session (the writer reconnected)
  re-bases it. The versions every trainer reports are the versions published.
* ``receive(ctx, v)`` — wait, polling every ``poll_s``, until a committed version
  ``>= v`` exists, then land the **newest** such version: a rollout that fell behind
  (its expected version already pruned) catches up instead of waiting forever, and
  its report says which version landed (the ledger commits that one). The wait is
  bounded by the refit's deadline while one is armed, else (none, or stood down by
  the controller) by ``timeout_s`` (``RefitTimeout``). The whole version is verified first (``reader``); only then is
  ``ctx.touched`` set and are the destinations overwritten, one file per executor
  step (an abort between files leaves the rollout torn).

Delta mode (``delta=True`` on every side; :mod:`.delta`): the writer publishes a
version as the changes since the one before when it can, and a rollout lands the
newest version through a chain of deltas from the version it holds or from the newest
full version; the result is checked by per-tensor checksums before the ledger commits.

``abort()`` (any thread) ends the current wait or hash loop within one poll and the
refit raises ``RefitAborted`` (``RefitTimeout`` when the deadline fired). Filesystem
and safetensors errors become ``TransportError``; a bad manifest, file or checksum is
a ``ProtocolError``.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError

from policyworker.config import positive_int, positive_seconds
from policyworker.errors import (
    ConfigError,
    PolicyWorkerError,
    ProtocolError,
    RefitAborted,
    RefitTimeout,
    TransportError,
)
from policyworker.transports.base import RefitReport, Transport, TransportContext

from . import delta as _delta
from . import dirs
from .manifest import CHECKSUMS, FORMAT, Manifest, Signature, check_against, decode, encode, param_specs
from .reader import SAFETENSORS_DTYPES, OpenVersion, open_version
from .writer import write_version

__all__ = ["FilesOptions", "FilesSetup", "FilesTransport"]

_log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class FilesSetup:
    """What ``attach_transport("files", **setup)`` accepts.

    ``directory``: the shared directory (created by the sender). ``keep``: committed
    versions kept after each write (older ones are pruned). ``writer_rank``: the
    trainer rank that writes. ``checksum``: ``"sha256"`` or ``"crc32"`` (zlib), per
    file. ``file_bytes``: tensor bytes per safetensors file at most. ``fsync``: make
    every step durable before the rename (off only for scratch directories).
    ``timeout_s``: bounds a receiver's waits (connect; a refit without a deadline).
    ``poll_s``: how often a waiting receiver looks again. ``delta`` (every side): the
    writer publishes deltas (:mod:`.delta`); ``delta_max_fraction``,
    ``delta_full_every`` and ``delta_chain_fraction`` (writer) say when a version is
    full anyway.
    """

    directory: str | os.PathLike[str] | None = None
    keep: int = 2
    writer_rank: int = 0
    checksum: str = "sha256"
    file_bytes: int = 1 << 30
    fsync: bool = True
    timeout_s: float = 60.0
    poll_s: float = 0.02
    delta: bool = False
    delta_max_fraction: float = 0.25
    delta_full_every: int | None = 32
    delta_chain_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.delta, bool):
            raise ConfigError(f"delta must be True or False, got {self.delta!r}", transport="files")
        for key in ("delta_max_fraction", "delta_chain_fraction"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"{key} must be in [0, 1], got {value!r}", transport="files")
        if self.delta_full_every is not None:
            positive_int(self.delta_full_every, "delta_full_every")
        if self.directory is not None:
            if not isinstance(self.directory, (str, os.PathLike)) or not os.fspath(self.directory):
                raise ConfigError(f"directory must be a path, got {self.directory!r}", transport="files")
            object.__setattr__(self, "directory", os.path.abspath(os.fspath(self.directory)))
        positive_int(self.keep, "keep")
        positive_int(self.writer_rank, "writer_rank", minimum=0)
        positive_int(self.file_bytes, "file_bytes")
        if self.checksum not in CHECKSUMS:
            raise ConfigError(f"checksum must be one of {', '.join(CHECKSUMS)}, got {self.checksum!r}",
                              transport="files")
        positive_seconds(self.timeout_s, "timeout_s", optional=False)
        positive_seconds(self.poll_s, "poll_s", optional=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class FilesOptions:
    """Per refit: ``delta=False`` (writer, delta mode) publishes this version full."""

    delta: bool | None = None


def _check_tensors(params: Mapping[str, torch.Tensor], role: str) -> None:
    """``ConfigError`` for what the files cannot carry: an unknown dtype, a sparse tensor,
    and (sender) two names over the same bytes."""
    if sys.byteorder != "little":
        raise ConfigError("the files transport needs a little-endian host (safetensors is little-endian)")
    if not params:
        raise ConfigError(f"the files transport has no tensors to {role}", transport="files")
    known = set(SAFETENSORS_DTYPES.values())
    spans: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for name, t in params.items():
        if str(t.dtype).removeprefix("torch.") not in known:
            raise ConfigError(f"{name}: dtype {t.dtype} is not one the files transport moves", transport="files",
                              param=name)
        if t.layout != torch.strided:
            raise ConfigError(f"{name}: a {t.layout} tensor cannot be written as safetensors", transport="files",
                              param=name)
        if role == "send" and t.numel():
            start = t.data_ptr()
            spans.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(
                (start, start + t.numel() * t.element_size(), name))
    for group in spans.values():
        group.sort()
        for (_, end, a), (start, _, b) in zip(group, group[1:]):
            if start < end:
                raise ConfigError(f"{a} and {b} share memory; send each tensor under one name", transport="files",
                                  param=b)


def _follow(state: dict[str, Any], signature: Signature) -> None:
    """A non-writer rank follows the writer session of ``signature``: its next refit
    reports ``base + 1``."""
    state["session"], state["base"], state["count"] = signature.session, signature.base, 0
    state["version"] = signature.base


class FilesTransport(Transport):
    """Refit through a shared directory; see the module docstring for the protocol."""

    name = "files"
    Setup = FilesSetup
    Options = FilesOptions
    needs_plan = False

    @classmethod
    def from_setup(cls, setup: FilesSetup) -> FilesTransport:
        return cls(setup)

    def __init__(self, setup: FilesSetup | None = None, /, **kwargs: Any) -> None:
        """``FilesTransport(FilesSetup(...))`` or ``FilesTransport(directory=..., keep=...)``."""
        if setup is None:
            from policyworker.config import parse

            setup = parse(FilesSetup, kwargs, what="setup of transport 'files'")
        elif kwargs or not isinstance(setup, FilesSetup):
            raise ConfigError("pass a FilesSetup or keyword arguments, not both", transport="files")
        if setup.directory is None:
            raise ConfigError("the files transport needs directory=...", transport="files")
        self.setup = setup
        self.directory: str = setup.directory  # type: ignore[assignment]
        self._cancel = threading.Event()
        self._closed = False

    # -- plumbing ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("the files transport is closed", transport=self.name)

    def _stopper(self, ctx: TransportContext) -> Callable[[], None]:
        deadline = ctx.deadline

        def stop() -> None:
            if deadline is not None:
                deadline.check()  # RefitTimeout once the deadline fired
            if self._cancel.is_set():
                raise RefitAborted("files transport: aborted", transport=self.name, rank=ctx.rank)

        return stop

    def _wait(self, ctx: TransportContext, probe: Callable[[], T | None], *, what: str) -> T:
        """Call ``probe`` every ``poll_s`` until it returns something; bounded and abortable.

        The bound is the refit's deadline while it is armed; without one — or once the
        controller stood it down — ``timeout_s`` from the start of the wait.
        """
        stop = self._stopper(ctx)
        fallback = time.monotonic() + self.setup.timeout_s
        while True:
            stop()
            found = probe()
            if found is not None:
                return found
            deadline = ctx.deadline
            until = deadline.at if deadline is not None and deadline.armed else fallback
            remaining = until - time.monotonic()
            if remaining <= 0:
                raise RefitTimeout(f"files transport: {what} did not appear in {self.directory} in time",
                                   transport=self.name, rank=ctx.rank)
            self._cancel.wait(min(self.setup.poll_s, remaining))

    async def _io(self, ctx: TransportContext, fn: Callable[..., T], *args: Any, what: str) -> T:
        """``fn`` on the refit executor; filesystem and safetensors errors translated."""
        try:
            return await ctx.blocking(fn, *args)
        except PolicyWorkerError:
            raise
        except (OSError, SafetensorError) as exc:
            raise TransportError(f"files transport: {what} in {self.directory} failed: {exc}",
                                 transport=self.name, rank=ctx.rank) from exc

    # -- the contract --------------------------------------------------------------------
    async def connect(self, ctx: TransportContext) -> None:
        self._check_open()
        self._cancel.clear()
        _check_tensors(ctx.params, ctx.role)
        ctx.state["directory"] = self.directory
        if ctx.role == "send" and self.setup.writer_rank >= ctx.world_size:
            raise ConfigError(f"writer_rank {self.setup.writer_rank} is outside this trainer world of "
                              f"{ctx.world_size}: no rank would write", transport=self.name, rank=ctx.rank)
        if ctx.role == "send" and ctx.rank == self.setup.writer_rank:
            # Continue the numbering: v <= newest would overwrite what rollouts may hold.
            base = await self._io(ctx, self._connect_sender, ctx, what="connect")
            ctx.state["version"] = base
        elif ctx.role == "send":
            await self._io(ctx, self._connect_sender, ctx, what="connect")
            signature = await self._io(ctx, self._await_signature, ctx, what="waiting for the writer's signature")
            check_against(signature.params, param_specs(ctx.params),
                          what=f"the writer's signature in {self.directory}")
            if signature.session != ctx.state.get("session"):
                _follow(ctx.state, signature)
        else:
            signature = await self._io(ctx, self._await_signature, ctx, what="waiting for the writer's signature")
            check_against(signature.params, param_specs(ctx.params),
                          what=f"the writer's signature in {self.directory}")
            if signature.delta != self.setup.delta:
                raise ConfigError(f"the writer in {self.directory} attached with delta={signature.delta}, this "
                                  f"rollout with delta={self.setup.delta}: give every side the same",
                                  transport=self.name, rank=ctx.rank)
            ctx.state["signature"] = signature

    def _connect_sender(self, ctx: TransportContext) -> int:
        """Create the directory, clean this rank's leftovers; on the writer, write the
        signature of a new session. Returns the version the writer numbers on from."""
        os.makedirs(self.directory, exist_ok=True)
        writer = ctx.rank == self.setup.writer_rank
        for name in dirs.clean_stale(self.directory, ctx.rank, writer=writer):
            _log.info("files transport: removed %s, left by an earlier writer of rank %d", name, ctx.rank)
        versions = dirs.committed_versions(self.directory)
        base = max(int(ctx.state.get("version", 0)), versions[-1] if versions else 0)
        if writer:
            session = secrets.token_hex(8)
            mine = Signature(format=FORMAT, writer_rank=ctx.rank, params=param_specs(ctx.params),
                             session=session, base=base, delta=self.setup.delta)
            path = os.path.join(self.directory, dirs.SIGNATURE)
            if versions and os.path.exists(path):
                theirs = decode(dirs.read_small(path, limit=64 << 20), Signature, what=path)
                check_against(theirs.params, mine.params,
                              what=f"versions {versions[0]}..{versions[-1]} already in {self.directory} "
                                   f"(give this trainer a fresh directory)")
            dirs.write_atomic(self.directory, dirs.SIGNATURE, encode(mine), fsync=self.setup.fsync)
            ctx.state["session"] = session
        return base

    def _await_signature(self, ctx: TransportContext) -> Signature:
        path = os.path.join(self.directory, dirs.SIGNATURE)

        def probe() -> bytes | None:
            try:
                return dirs.read_small(path, limit=64 << 20)
            except FileNotFoundError:
                return None

        data = self._wait(ctx, probe, what=f"{dirs.SIGNATURE} (no trainer has connected yet)")
        return decode(data, Signature, what=path)

    async def send(self, ctx: TransportContext, version: int) -> RefitReport:
        self._check_open()
        t0 = time.perf_counter()
        self._cancel.clear()
        if ctx.rank != self.setup.writer_rank:
            published = await self._io(ctx, self._await_published, ctx,
                                       what=f"waiting for the writer (rank {self.setup.writer_rank})")
            return RefitReport(transport=self.name, role="send", version=published, bytes=0,
                               seconds=time.perf_counter() - t0,
                               notes=(f"rank {ctx.rank} does not write; rank {self.setup.writer_rank} "
                                      f"published version {published}",))
        manifest, notes, shadow = await self._io(ctx, self._write, ctx, version, what=f"writing version {version}")
        try:
            pruned = await ctx.blocking(dirs.prune, self.directory, self.setup.keep,
                                        protect_from=_delta.protect_from(ctx.state))
            if pruned:
                notes += (f"pruned {', '.join(map(str, pruned))}",)
        except OSError as exc:  # the version is committed; an old one lingering is not a failed refit
            _log.warning("files transport: pruning %s failed (retried after the next write): %s", self.directory, exc)
            notes += (f"pruning failed: {exc}",)
        return RefitReport(transport=self.name, role="send", version=version, bytes=manifest.nbytes,
                           seconds=time.perf_counter() - t0, buckets=len(manifest.files), notes=notes,
                           wire_bytes=manifest.file_bytes if self.setup.delta else None, shadow_bytes=shadow)

    def _await_published(self, ctx: TransportContext) -> int:
        """A non-writer's refit: the version the writer published for it (see the module
        docstring). Waits, bounded and abortable, while the writer has not published it."""
        state = ctx.state
        path = os.path.join(self.directory, dirs.SIGNATURE)

        def probe() -> int | None:
            signature = decode(dirs.read_small(path, limit=64 << 20), Signature, what=path)
            if signature.session != state.get("session"):
                _follow(state, signature)  # the writer (re)connected: number on from its new base
            target = state["base"] + state["count"] + 1
            newer = [v for v in dirs.committed_versions(self.directory) if v >= target]
            if not newer:
                return None
            manifest_path = os.path.join(self.directory, dirs.version_name(newer[-1]), dirs.MANIFEST)
            try:
                manifest = decode(dirs.read_small(manifest_path, limit=64 << 20), Manifest, what=manifest_path)
            except FileNotFoundError:
                return None  # pruned meanwhile: look again
            return target if manifest.session == state["session"] else None

        published = self._wait(ctx, probe, what=f"the writer's (rank {self.setup.writer_rank}) version for "
                                                f"refit {state.get('count', 0) + 1} of its session")
        state["count"] += 1
        return published

    def _write(self, ctx: TransportContext, version: int):
        versions = dirs.committed_versions(self.directory)
        if versions and version <= versions[-1]:
            raise ConfigError(f"version {version} is not past {versions[-1]}, the newest in {self.directory}",
                              transport=self.name, rank=ctx.rank)
        s = self.setup
        if s.delta:
            manifest, note, shadow = _delta.publish(self.directory, s, ctx, version, self._stopper(ctx))
            return manifest, (note,), shadow
        manifest = write_version(self.directory, version, ctx.params, rank=ctx.rank, checksum=s.checksum,
                                 file_bytes=s.file_bytes, fsync=s.fsync, stop=self._stopper(ctx),
                                 session=ctx.state.get("session", ""))
        return manifest, (), 0

    async def receive(self, ctx: TransportContext, version: int) -> RefitReport:
        self._check_open()
        t0 = time.perf_counter()
        ctx.touched = False
        self._cancel.clear()
        try:
            return await self._receive(ctx, version, t0)
        except BaseException as exc:
            if ctx.touched is not False:
                _delta.received(ctx, None)  # no longer a base for a delta
            if isinstance(exc, ProtocolError) and self.setup.delta:
                # whatever was wrong (a corrupt file, a base gone, a bad result), a full version mends it
                await ctx.blocking(_delta.request_full, self.directory, f"version >= {version}: {exc}")
            raise

    async def _receive(self, ctx: TransportContext, version: int, t0: float) -> RefitReport:
        chain = await self._io(ctx, self._open_verified, ctx, version, what=f"receiving version {version}")
        stop = self._stopper(ctx)
        target = chain[-1]
        try:
            ctx.touched = True  # everything checked; from here on the live bytes change
            for opened in chain:
                groups: dict[str, list[str]] = {}
                for entry in opened.manifest.tensors:
                    groups.setdefault(entry.file, []).append(entry.name)
                step = opened.apply_into if opened.is_delta else opened.copy_into
                for names in groups.values():  # one file per step: an abort lands between files
                    await self._io(ctx, step, {n: ctx.params[n] for n in names}, stop,
                                   what=f"landing version {opened.version}")
            if target.is_delta:
                await self._io(ctx, _delta.check_result, target, ctx.params, stop,
                               what=f"checking version {target.version}")
        finally:
            # Unmapped on the refit executor, after any copy still running there.
            for opened in chain:
                if ctx.executor is not None:
                    ctx.executor.submit(opened.close)
                else:
                    opened.close()
        landed = target.version
        _delta.received(ctx, landed)
        notes = (f"caught up: expected {version}, the newest committed was {landed}",) if landed != version else ()
        wire = None
        if target.is_delta or self.setup.delta:
            wire = sum(o.manifest.file_bytes for o in chain)
            how = "full" if not chain[0].is_delta else f"from version {chain[0].manifest.base}"
            notes += (f"{how} + {sum(o.is_delta for o in chain)} delta(s), {wire} bytes read",)
        return RefitReport(transport=self.name, role="receive", version=landed, bytes=target.manifest.nbytes,
                           seconds=time.perf_counter() - t0, buckets=sum(len(o.manifest.files) for o in chain),
                           notes=notes, wire_bytes=wire)

    def _open_verified(self, ctx: TransportContext, version: int) -> list[OpenVersion]:
        """Wait for the newest committed version >= ``version``; map and verify it and the
        versions it needs (a delta's chain, :mod:`.delta`) before anything is touched."""
        stop = self._stopper(ctx)
        mine = _delta.held_base(ctx)

        def probe() -> list[OpenVersion] | None:
            listed = dirs.committed_versions(self.directory)
            newer = [v for v in listed if v >= version]
            if not newer:
                return None
            try:
                target = open_version(self.directory, newer[-1])
            except FileNotFoundError:
                return None  # pruned between the listing and the open: look again
            try:
                return _delta.open_chain(self.directory, target, listed, mine)
            except FileNotFoundError:
                target.close()
                return None
            except BaseException:
                target.close()
                raise

        chain = self._wait(ctx, probe, what=f"version {version} (or newer)")
        try:
            for opened in chain:
                opened.verify(ctx.params, stop)
        except BaseException:
            for opened in chain:
                opened.close()
            raise
        return chain

    def abort(self) -> None:
        self._cancel.set()

    async def aclose(self) -> None:
        self._closed = True
        self._cancel.set()
