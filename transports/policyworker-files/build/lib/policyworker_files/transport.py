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
* ``send(ctx, v)`` — only on ``writer_rank`` (other ranks report 0 bytes for ``v``):
  write ``v`` (``writer``), commit it by rename, prune to the newest ``keep``. A
  ``v`` not past the newest committed version is refused (``ConfigError``).
* ``receive(ctx, v)`` — wait, polling every ``poll_s``, until a committed version
  ``>= v`` exists, then land the **newest** such version: a rollout that fell behind
  (its expected version already pruned) catches up instead of waiting forever, and
  its report says which version landed (the ledger commits that one). The wait is
  bounded by the refit's deadline while one is armed, else (none, or stood down by
  the controller) by ``timeout_s`` (``RefitTimeout``). The whole version is verified first (``reader``); only then is
  ``ctx.touched`` set and are the destinations overwritten.

``abort()`` (any thread) ends the current wait or hash loop within one poll and the
refit raises ``RefitAborted`` (``RefitTimeout`` when the deadline fired). Filesystem
and safetensors errors become ``TransportError``; a bad manifest, file or checksum is
a ``ProtocolError``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError

from policyworker.config import positive_int, positive_seconds
from policyworker.errors import ConfigError, PolicyWorkerError, RefitAborted, RefitTimeout, TransportError
from policyworker.transports.base import RefitReport, Transport, TransportContext

from . import dirs
from .manifest import CHECKSUMS, FORMAT, Signature, check_against, decode, encode, param_specs
from .reader import SAFETENSORS_DTYPES, OpenVersion, open_version
from .writer import write_version

__all__ = ["FilesSetup", "FilesTransport"]

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
    ``poll_s``: how often a waiting receiver looks again.
    """

    directory: str | os.PathLike[str] | None = None
    keep: int = 2
    writer_rank: int = 0
    checksum: str = "sha256"
    file_bytes: int = 1 << 30
    fsync: bool = True
    timeout_s: float = 60.0
    poll_s: float = 0.02

    def __post_init__(self) -> None:
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


class FilesTransport(Transport):
    """Refit through a shared directory; see the module docstring for the protocol."""

    name = "files"
    Setup = FilesSetup
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
        if ctx.role == "send":
            newest = await self._io(ctx, self._connect_sender, ctx, what="connect")
            # Continue the numbering: v <= newest would overwrite what rollouts may hold.
            ctx.state["version"] = max(int(ctx.state.get("version", 0)), newest)
        else:
            signature = await self._io(ctx, self._await_signature, ctx, what="waiting for the writer's signature")
            check_against(signature.params, param_specs(ctx.params),
                          what=f"the writer's signature in {self.directory}")
            ctx.state["signature"] = signature

    def _connect_sender(self, ctx: TransportContext) -> int:
        os.makedirs(self.directory, exist_ok=True)
        writer = ctx.rank == self.setup.writer_rank
        for name in dirs.clean_stale(self.directory, ctx.rank, writer=writer):
            _log.info("files transport: removed %s, left by an earlier writer of rank %d", name, ctx.rank)
        versions = dirs.committed_versions(self.directory)
        if writer:
            mine = Signature(format=FORMAT, writer_rank=ctx.rank, params=param_specs(ctx.params))
            path = os.path.join(self.directory, dirs.SIGNATURE)
            if versions and os.path.exists(path):
                theirs = decode(dirs.read_small(path, limit=64 << 20), Signature, what=path)
                check_against(theirs.params, mine.params,
                              what=f"versions {versions[0]}..{versions[-1]} already in {self.directory} "
                                   f"(give this trainer a fresh directory)")
            dirs.write_atomic(self.directory, dirs.SIGNATURE, encode(mine), fsync=self.setup.fsync)
        return versions[-1] if versions else 0

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
        if ctx.rank != self.setup.writer_rank:
            return RefitReport(transport=self.name, role="send", version=version, bytes=0,
                               seconds=time.perf_counter() - t0,
                               notes=(f"rank {ctx.rank} does not write; rank {self.setup.writer_rank} does",))
        self._cancel.clear()
        manifest = await self._io(ctx, self._write, ctx, version, what=f"writing version {version}")
        notes: tuple[str, ...] = ()
        try:
            pruned = await ctx.blocking(dirs.prune, self.directory, self.setup.keep)
            if pruned:
                notes = (f"pruned {', '.join(map(str, pruned))}",)
        except OSError as exc:  # the version is committed; an old one lingering is not a failed refit
            _log.warning("files transport: pruning %s failed (retried after the next write): %s", self.directory, exc)
            notes = (f"pruning failed: {exc}",)
        return RefitReport(transport=self.name, role="send", version=version, bytes=manifest.nbytes,
                           seconds=time.perf_counter() - t0, buckets=len(manifest.files), notes=notes)

    def _write(self, ctx: TransportContext, version: int):
        versions = dirs.committed_versions(self.directory)
        if versions and version <= versions[-1]:
            raise ConfigError(f"version {version} is not past {versions[-1]}, the newest in {self.directory}",
                              transport=self.name, rank=ctx.rank)
        s = self.setup
        return write_version(self.directory, version, ctx.params, rank=ctx.rank, checksum=s.checksum,
                             file_bytes=s.file_bytes, fsync=s.fsync, stop=self._stopper(ctx))

    async def receive(self, ctx: TransportContext, version: int) -> RefitReport:
        self._check_open()
        t0 = time.perf_counter()
        ctx.touched = False
        self._cancel.clear()
        landed, nbytes, files = await self._io(ctx, self._land, ctx, version, what=f"receiving version {version}")
        notes = (f"caught up: expected {version}, the newest committed was {landed}",) if landed != version else ()
        return RefitReport(transport=self.name, role="receive", version=landed, bytes=nbytes,
                           seconds=time.perf_counter() - t0, buckets=files, notes=notes)

    def _land(self, ctx: TransportContext, version: int) -> tuple[int, int, int]:
        stop = self._stopper(ctx)

        def probe() -> OpenVersion | None:
            newer = [v for v in dirs.committed_versions(self.directory) if v >= version]
            if not newer:
                return None
            try:
                return open_version(self.directory, newer[-1])
            except FileNotFoundError:
                return None  # pruned between the listing and the open: look again

        opened = self._wait(ctx, probe, what=f"version {version} (or newer)")
        try:
            opened.verify(ctx.params, stop)
            ctx.touched = True  # everything checked; from here on the live bytes change
            nbytes = opened.copy_into(ctx.params, stop)
        finally:
            opened.close()
        return opened.version, nbytes, len(opened.manifest.files)

    def abort(self) -> None:
        self._cancel.set()

    async def aclose(self) -> None:
        self._closed = True
        self._cancel.set()
