"""The shared directory's layout, and the filesystem steps that keep it consistent.

::

    <directory>/
      signature.json                    the writer's tensors (names, dtypes, shapes)
      v00000006/                        committed versions: complete, immutable
      v00000007/
        manifest.json                   written last; checksums of every file
        part-00000.safetensors          tensors in name order, <= file_bytes per file
        part-00001.safetensors
      .v00000008.tmp-r0-1f2e3d4c/       being written by rank 0 (or left by a crash)
      .v00000005.old-9a8b7c6d/          being pruned

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
    "committed_versions",
    "fsync_dir",
    "prune",
    "read_small",
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


def prune(directory: str, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` committed versions; return the versions removed."""
    removed = []
    for version in committed_versions(directory)[:-keep]:
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
