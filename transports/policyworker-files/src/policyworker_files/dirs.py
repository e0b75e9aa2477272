"""The shared directory's layout, and the filesystem steps that keep it consistent.

::

    <directory>/
      signature.json                    the writer's tensors (names, dtypes, shapes)
      v00000006/                        committed versions: complete, immutable
      v00000007/
        manifest.json                   written last; checksums of every file
        part-00000.safetensors          tensors in name order, <= file_bytes per file
        part-00001.safetensors
      v00000008/                        a delta version (delta mode): its manifest and
        manifest.json                   the encoded changed units, <= file_bytes per file
        delta-00000.bin
      .v00000009.tmp-r0-1f2e3d4c/       being written by rank 0 (or left by a crash)
      .v00000005.old-9a8b7c6d/          being pruned
      want-full-3a4b5c6d7e8f9a0b        a rollout asks for a full version (delta mode)

A name ``v<digits>`` exists only once every file of that version and its manifest
were written and fsync'd: the writer builds ``.v…tmp-…`` and renames it (one atomic
``rename(2)`` within the directory: the commit point). Pruning is the reverse: rename
to ``.v…old-…`` first, so a version disappears at once, then delete. Readers list only
``v<digits>`` names and never see a half-written or half-deleted version.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import sys

__all__ = [
    "MANIFEST",
    "SIGNATURE",
    "clean_stale",
    "clear_requests",
    "committed_versions",
    "full_requests",
    "fsync_dir",
    "prune",
    "read_small",
    "request_full",
    "tmp_name",
    "version_name",
    "write_atomic",
]

_log = logging.getLogger(__name__)

SIGNATURE = "signature.json"
MANIFEST = "manifest.json"
_COMMITTED = re.compile(r"v(\d{8,})\Z")
_OLD = re.compile(r"\.v\d{8,}\.old-[0-9a-f]+\Z")
_SIGNATURE_TMP = re.compile(r"\.signature\.json\.tmp-[0-9a-f]+\Z")
_REQUEST = re.compile(r"want-full-[0-9a-f]{16}\Z")


def version_name(version: int) -> str:
    return f"v{version:08d}"


def tmp_name(version: int, rank: int) -> str:
    """A fresh temporary name for ``version`` written by ``rank`` (hidden: starts with a dot)."""
    return f".{version_name(version)}.tmp-r{rank}-{secrets.token_hex(4)}"


def _own_tmp(rank: int) -> re.Pattern[str]:
    return re.compile(rf"\.v\d{{8,}}\.tmp-r{rank}-[0-9a-f]+\Z")


def committed_versions(directory: str) -> list[int]:
    """Committed versions in ``directory``, ascending (only ``v<digits>`` directories)."""
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _COMMITTED.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append(int(match.group(1)))
    return sorted(found)


def fsync_dir(path: str) -> None:
    """Make the entries of ``path`` (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(directory: str, name: str, data: bytes, *, fsync: bool) -> None:
    """Write ``directory/name`` so that readers see the old bytes or the new, never a mix."""
    tmp = os.path.join(directory, f".{name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        _remove_file(tmp)
        raise
    if fsync:
        fsync_dir(directory)


def read_small(path: str, *, limit: int) -> bytes:
    """The bytes of a small file (a manifest, the signature); ``ValueError`` past ``limit``."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return


def remove_tree(path: str) -> None:
    """Delete ``path`` (ours alone: a tmp or old name); failures are logged, not raised —
    the next ``clean_stale`` retries, and a leftover hidden directory harms no reader."""
    def log(func, target, exc):  # noqa: ARG001 - shutil's callback signature
        exc = exc[1] if isinstance(exc, tuple) else exc  # onerror passes exc_info, onexc the error
        if not isinstance(exc, FileNotFoundError):
            _log.warning("files transport: could not remove %s: %s", target, exc)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=log)
    else:
        shutil.rmtree(path, onerror=log)


def prune(directory: str, keep: int, *, protect_from: int | None = None) -> list[int]:
    """Remove all but the newest ``keep`` committed versions, and none from ``protect_from``
    on (delta mode: the newest full version and the deltas after it); return those removed."""
    removed = []
    for version in committed_versions(directory)[:-keep]:
        if protect_from is not None and version >= protect_from:
            continue
        hidden = os.path.join(directory, f".{version_name(version)}.old-{secrets.token_hex(4)}")
        try:
            os.rename(os.path.join(directory, version_name(version)), hidden)
        except FileNotFoundError:
            continue  # pruned by someone else meanwhile
        remove_tree(hidden)
        removed.append(version)
    if removed:
        fsync_dir(directory)
    return removed


def clean_stale(directory: str, rank: int, *, writer: bool) -> list[str]:
    """Delete what ``rank`` left behind (a crash mid-write): its temporary version
    directories, unfinished prunes and (the writer) a half-written signature; return
    their names. Other ranks' temporaries may still be in use: left alone."""
    own = _own_tmp(rank)
    stale, files = [], []
    with os.scandir(directory) as entries:
        for entry in entries:
            if (own.match(entry.name) or _OLD.match(entry.name)) and entry.is_dir(follow_symlinks=False):
                stale.append(entry.name)
            elif writer and _SIGNATURE_TMP.match(entry.name):
                files.append(entry.name)
    for name in stale:
        remove_tree(os.path.join(directory, name))
    for name in files:
        _remove_file(os.path.join(directory, name))
    return stale + files


def request_full(directory: str, note: str) -> str:
    """Ask the writer for a full version (delta mode): a new ``want-full-<hex>`` file;
    its name is the request, ``note`` (why) is for people. Returns the name."""
    name = f"want-full-{secrets.token_hex(8)}"
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, note.encode()[:4096])
    finally:
        os.close(fd)
    return name


def full_requests(directory: str) -> list[str]:
    """The pending ``want-full-*`` requests."""
    with os.scandir(directory) as entries:
        return sorted(e.name for e in entries if _REQUEST.match(e.name))


def clear_requests(directory: str, names: list[str]) -> None:
    """Delete requests a full version answered (others, made meanwhile, stay)."""
    for name in names:
        _remove_file(os.path.join(directory, name))
