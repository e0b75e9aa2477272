"""Checkpoint files, and the asynchronous save: snapshot now, write in the background.

File format: ``torch.save`` of ``{"format": FORMAT, "state_dict": {name: CPU tensor}}``,
read back with ``weights_only=True`` so loading runs no code. Names that alias one
tensor (tied embeddings) share one snapshot tensor, and ``torch.save`` stores shared
storage once.

Atomicity: the bytes go to a hidden temp file in the destination's own directory
(``.<name>.tmp-<pid>-<token>``), are fsynced, and the temp file is renamed over the
destination with ``os.replace`` (atomic within one file system); the directory is
then fsynced so the rename itself survives a power loss. A write that fails removes
its temp file. A process killed mid-write can leave only a ``.tmp-`` file behind,
never a file at the destination that looks complete.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import secrets
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from policyworker.errors import CheckpointError

__all__ = ["FORMAT", "TEMP_MARK", "AsyncCheckpointWriter", "read_checkpoint", "write_checkpoint"]

_log = logging.getLogger(__name__)

FORMAT = "policyworker.workers.checkpoint/1"
TEMP_MARK = ".tmp-"


def _dump(payload: dict, fileobj) -> None:
    """Serialize ``payload`` into an open binary file (one seam, so tests can fail it)."""
    torch.save(payload, fileobj)


def _remove_temp(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass  # the failure happened before the temp file was created
    except OSError as exc:
        # The original write error is the one that matters; say what was left behind.
        _log.warning("could not remove temp checkpoint %s: %s", tmp, exc)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot fsync a directory; the rename still happened.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_checkpoint(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> str:
    """Write ``state`` (CPU tensors) to ``path`` atomically; return the absolute path.

    Blocking. Raises ``CheckpointError`` (the cause chained) if anything fails; then
    neither ``path`` (if it did not exist before: an old file there stays untouched)
    nor a temp file is left.
    """
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    renamed = False
    try:
        with open(tmp, "xb") as f:
            _dump({"format": FORMAT, "state_dict": dict(state)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        renamed = True
        _fsync_dir(directory)
    except Exception as exc:
        raise CheckpointError(f"writing checkpoint {path!r} failed: {type(exc).__name__}: {exc}", path=path) from exc
    finally:
        if not renamed:
            _remove_temp(tmp)
    return path


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state dict stored at ``path`` (CPU tensors). ``CheckpointError`` if unreadable."""
    path = os.fspath(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"reading checkpoint {path!r} failed: {type(exc).__name__}: {exc}", path=path) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or not isinstance(payload.get("state_dict"), dict):
        raise CheckpointError(f"{path!r} is not a policyworker checkpoint (format {FORMAT})", path=path)
    return payload["state_dict"]


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class AsyncCheckpointWriter:
    """One reused CPU snapshot buffer and one writer thread.

    :meth:`snapshot_and_submit` copies a state dict into the buffer and schedules its
    write; it returns the write's future. It must be called from one thread only
    (the worker's refit executor, which is what serializes it against refits and
    weight swaps). It first waits for the previous write, because that write reads
    the very buffer the new snapshot overwrites; the wait is for local I/O, which
    finishes or fails, not for a peer. Buffers are pinned when ``pin_memory`` is set
    (CUDA hosts), so device-to-host copies can run asynchronously.
    """

    def __init__(self, *, pin_memory: bool = False, thread_name: str = "policyworker-ckpt") -> None:
        self._pin = pin_memory
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._buffer: dict[str, torch.Tensor] | None = None
        self._last: Future | None = None

    @property
    def buffer(self) -> dict[str, torch.Tensor] | None:
        """The snapshot buffer (None until the first save or after :meth:`release_buffer`)."""
        return self._buffer

    def _wait_last(self) -> None:
        if self._last is not None:
            # Its error, if any, is reported through its own future, not here.
            concurrent.futures.wait([self._last])
            self._last = None

    def _fits(self, state: Mapping[str, torch.Tensor]) -> bool:
        buf = self._buffer
        return (
            buf is not None
            and list(buf) == list(state)
            and all(buf[k].shape == v.shape and buf[k].dtype == v.dtype for k, v in state.items())
        )

    def _allocate(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        by_alias: dict[tuple, torch.Tensor] = {}
        buf: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            key = _alias_key(t)
            if key not in by_alias:
                by_alias[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
            buf[name] = by_alias[key]
        return buf

    def snapshot_and_submit(self, state: Mapping[str, torch.Tensor], path: str) -> Future:
        """Copy ``state`` into the snapshot buffer, then write it to ``path`` in the background."""
        self._wait_last()
        if not self._fits(state):
            self._buffer = self._allocate(state)
        buf = self._buffer
        done: set[int] = set()
        cuda_devices: set[torch.device] = set()
        with torch.no_grad():
            for name, t in state.items():
                dst = buf[name]
                if id(dst) in done:  # an alias of a tensor already copied
                    continue
                done.add(id(dst))
                if t.is_cuda:
                    cuda_devices.add(t.device)
                dst.copy_(t.detach(), non_blocking=self._pin and t.is_cuda)
        for device in cuda_devices:
            # The async device-to-host copies must land before the writer reads them.
            torch.cuda.synchronize(device)
        self._last = self._writer.submit(write_checkpoint, buf, path)
        return self._last

    def release_buffer(self) -> None:
        """Drop the snapshot buffer (reallocated by the next save). Same thread as saves."""
        self._wait_last()
        self._buffer = None

    def close(self) -> None:
        """Stop the writer thread once its queued writes are done (does not wait)."""
        self._writer.shutdown(wait=False)
