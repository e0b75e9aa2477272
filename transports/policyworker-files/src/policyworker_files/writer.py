"""Writing one version: safetensors files and a manifest in a temporary directory, then rename.

Order (each step durable before the next when ``fsync``): every file written, fsync'd
and checksummed → ``manifest.json`` written and fsync'd → the temporary directory
fsync'd → renamed to ``v<version>`` (the commit point) → the parent directory
fsync'd. A process that dies at any step before the rename leaves only its hidden
``.v….tmp-r<rank>-…`` directory, which its next ``connect`` deletes; an error raised
before the rename deletes it at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

import torch
from safetensors.torch import save_file

from . import dirs
from .manifest import FORMAT, FileEntry, Manifest, TensorEntry, encode, new_checksum

__all__ = ["CHUNK_BYTES", "checksum_file", "file_groups", "write_version"]

#: Bytes hashed between two checks of the abort flag.
CHUNK_BYTES = 8 << 20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def file_groups(params: Mapping[str, torch.Tensor], file_bytes: int) -> Iterator[list[str]]:
    """Names in sorted order, cut into files of at most ``file_bytes`` tensor bytes
    (a larger tensor gets a file of its own)."""
    group: list[str] = []
    size = 0
    for name in sorted(params):
        n = _nbytes(params[name])
        if group and size + n > file_bytes:
            yield group
            group, size = [], 0
        group.append(name)
        size += n
    if group:
        yield group


def checksum_file(path: str, algorithm: str, stop: Callable[[], None], *, fsync: bool) -> tuple[int, str]:
    """(size, checksum) of the file at ``path``, fsync'd first when ``fsync``."""
    hasher = new_checksum(algorithm)
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        if fsync:
            os.fsync(f.fileno())
        while True:
            stop()
            n = f.readinto(buf)
            if not n:
                break
            hasher.update(view[:n])
            size += n
    return size, hasher.hexdigest()


def _write_file(path: str, tensors: Mapping[str, torch.Tensor]) -> None:
    # safetensors writes straight from each tensor's memory (non-CPU tensors are copied
    # to the host one at a time), so the staging cost is at most one tensor.
    save_file(dict(tensors), path)


def write_version(
    directory: str,
    version: int,
    params: Mapping[str, torch.Tensor],
    *,
    rank: int,
    checksum: str,
    file_bytes: int,
    fsync: bool,
    stop: Callable[[], None],
    session: str = "",
) -> Manifest:
    """Write and commit ``version`` of ``params`` into ``directory``; return its manifest.

    ``stop()`` raises to abandon the write (an abort); it is called between files and
    hash chunks, and once more right before the rename. Raises ``FileExistsError``
    when ``v<version>`` appeared meanwhile (another writer) and ``OSError`` on I/O.
    """
    tmp = os.path.join(directory, dirs.tmp_name(version, rank))
    final = os.path.join(directory, dirs.version_name(version))
    os.mkdir(tmp)
    try:
        files: list[FileEntry] = []
        entries: list[TensorEntry] = []
        with torch.no_grad():
            for index, names in enumerate(file_groups(params, file_bytes)):
                stop()
                fname = f"part-{index:05d}.safetensors"
                path = os.path.join(tmp, fname)
                tensors = {n: params[n].detach().contiguous() for n in names}
                _write_file(path, tensors)
                size, digest = checksum_file(path, checksum, stop, fsync=fsync)
                files.append(FileEntry(name=fname, nbytes=size, checksum=digest))
                entries += [TensorEntry(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                                        nbytes=_nbytes(t), file=fname) for n, t in tensors.items()]
                del tensors
        manifest = Manifest(format=FORMAT, version=version, writer_rank=rank, checksum=checksum,
                            files=tuple(files), tensors=tuple(entries), session=session)
        with open(os.path.join(tmp, dirs.MANIFEST), "wb") as f:
            f.write(encode(manifest))
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if fsync:
            dirs.fsync_dir(tmp)
        stop()
        if os.path.exists(final):
            raise FileExistsError(f"{final} was committed by another writer meanwhile")
        os.rename(tmp, final)  # the commit point
    except BaseException:
        dirs.remove_tree(tmp)
        raise
    if fsync:
        dirs.fsync_dir(directory)
    return manifest
