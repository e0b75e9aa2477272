"""Writing one version: safetensors files and a manifest in a temporary directory, then rename.

Order (each step durable before the next when ``fsync``): every file written, fsync'd
and checksummed → ``manifest.json`` written and fsync'd → the temporary directory
fsync'd → renamed to ``v<version>`` (the commit point) → the parent directory
fsync'd. A process that dies at any step before the rename leaves only its hidden
``.v….tmp-r<rank>-…`` directory, which its next ``connect`` deletes; an error raised
before the rename deletes it at once. A delta version (:func:`write_delta_version`)
takes the same steps with ``delta-*.bin`` files instead of safetensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from safetensors.torch import save_file

from policyworker.layout.delta import Encoded

from . import dirs
from .manifest import FORMAT, DeltaEntry, FileEntry, Manifest, TensorEntry, encode, new_checksum

__all__ = ["CHUNK_BYTES", "checksum_file", "file_groups", "write_delta_version", "write_version"]

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


def _commit(directory: str, version: int, rank: int, *, fsync: bool, stop: Callable[[], None],
            fill: Callable[[str], Manifest]) -> Manifest:
    """Build ``version`` in a temporary directory (``fill`` writes its files and returns
    the manifest), write the manifest, and commit it by rename (module docstring)."""
    tmp = os.path.join(directory, dirs.tmp_name(version, rank))
    final = os.path.join(directory, dirs.version_name(version))
    os.mkdir(tmp)
    try:
        manifest = fill(tmp)
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

    def fill(tmp: str) -> Manifest:
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
                entries += [TensorEntry(name=n, dtype=_dtype_name(t), shape=tuple(t.shape),
                                        nbytes=_nbytes(t), file=fname) for n, t in tensors.items()]
                del tensors
        return Manifest(format=FORMAT, version=version, writer_rank=rank, checksum=checksum,
                        files=tuple(files), tensors=tuple(entries), session=session)

    return _commit(directory, version, rank, fsync=fsync, stop=stop, fill=fill)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def write_delta_version(
    directory: str,
    version: int,
    base: int,
    encoded: Iterable[tuple[str, torch.Tensor, Encoded]],
    *,
    rank: int,
    checksum: str,
    file_bytes: int,
    fsync: bool,
    stop: Callable[[], None],
    session: str = "",
) -> Manifest:
    """Write and commit ``version`` as a delta over ``base``; return its manifest.

    ``encoded`` yields, in name order, each tensor with its changed units (encoded
    lazily: one blob in memory at a time); the blobs go back to back into
    ``delta-<n>.bin`` files of at most ``file_bytes`` (a larger blob gets its own).
    Every blob's length is a multiple of 8, so every offset is 8-aligned. Commit,
    ``stop`` and errors as :func:`write_version`.
    """

    def fill(tmp: str) -> Manifest:
        files: list[FileEntry] = []
        entries: list[TensorEntry] = []
        f = None
        fname, at = "", 0

        def close() -> None:
            f.flush()
            f.close()
            size, digest = checksum_file(os.path.join(tmp, fname), checksum, stop, fsync=fsync)
            files.append(FileEntry(name=fname, nbytes=size, checksum=digest))

        try:
            for name, t, enc in encoded:
                stop()
                n = enc.blob.numel()
                if f is None or (at and at + n > file_bytes):
                    if f is not None:
                        close()
                    fname, at = f"delta-{len(files):05d}.bin", 0
                    f = open(os.path.join(tmp, fname), "wb")
                if n:
                    f.write(memoryview(enc.blob.cpu().numpy()))
                entries.append(TensorEntry(
                    name=name, dtype=_dtype_name(t), shape=tuple(t.shape), nbytes=_nbytes(t), file=fname,
                    checksum=enc.checksum, delta=DeltaEntry(kind=enc.kind, count=enc.count, offset=at, nbytes=n)))
                at += n
            if f is not None:
                close()
                f = None
        finally:
            if f is not None:
                f.close()
        return Manifest(format=FORMAT, version=version, writer_rank=rank, checksum=checksum, files=tuple(files),
                        tensors=tuple(entries), session=session, base=base)

    return _commit(directory, version, rank, fsync=fsync, stop=stop, fill=fill)
