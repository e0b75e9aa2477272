"""Reading one committed version: open it whole, verify it whole, then copy.

:func:`open_version` maps every file of a version (read-only data, private mapping):
once mapped, a file stays readable even if the writer prunes the version meanwhile,
so verification and copy read the very bytes that were checked.
:meth:`OpenVersion.verify` checks, before any destination is touched: the manifest
(self-digest, version, algorithm, file names), each file's size and checksum, and
each safetensors header against the manifest (names, dtypes, shapes, byte ranges)
and the manifest against the destinations (``PlanMismatch``). Anything else that is
wrong is a ``ProtocolError``. :meth:`OpenVersion.copy_into` then copies tensor by
tensor from the mapped bytes into the destinations (no staging copy). A delta version
(``manifest.base`` set) is verified the same way up to the files' checksums, then each
tensor's blob is checked against its destination (encoding, length, place in its
file); :meth:`OpenVersion.apply_into` writes the changed units into the destinations,
which must hold the base version (:mod:`.delta` checks the result by checksum).

The safetensors header is parsed here rather than through ``safetensors.safe_open``
because that needs a path, and a path can be pruned between verify and copy; the
format is a little-endian u64 header length, the JSON header, then the data.
"""

from __future__ import annotations

import math
import mmap
import os
import re
from collections.abc import Callable, Mapping

import msgspec
import torch

from policyworker.config import torch_dtype
from policyworker.errors import ConfigError, ProtocolError
from policyworker.layout import delta as _delta

from . import dirs
from .manifest import CHECKSUMS, Manifest, TensorEntry, check_against, decode, new_checksum, param_specs
from .writer import CHUNK_BYTES

__all__ = ["MAX_MANIFEST_BYTES", "OpenVersion", "SAFETENSORS_DTYPES", "open_version", "units"]

MAX_MANIFEST_BYTES = 64 << 20
_FILE_NAME = re.compile(r"part-\d{5}\.safetensors\Z")
_DELTA_NAME = re.compile(r"delta-\d{5}\.bin\Z")

#: safetensors dtype codes → torch dtype names (the dtypes this transport moves).
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


class _HeaderEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]


def _bad(message: str, **ctx) -> ProtocolError:
    return ProtocolError(message, transport="files", **ctx)


def _torch_dtype(name: str, *, what: str) -> torch.dtype:
    # A file naming a dtype nobody knows is a bad file here (ProtocolError), not bad config.
    try:
        return torch_dtype(name)
    except ConfigError as exc:
        raise _bad(f"{what}: {exc}") from None


class OpenVersion:
    """A committed version with every file mapped; see the module docstring."""

    def __init__(self, version: int, manifest: Manifest, maps: dict[str, mmap.mmap | bytearray]) -> None:
        self.version = version
        self.manifest = manifest
        self._maps = maps
        self._where: dict[str, tuple[str, int]] = {}  # tensor -> (file, absolute byte offset)

    def verify(self, dests: Mapping[str, torch.Tensor], stop: Callable[[], None]) -> None:
        """Check everything (module docstring); raise before touching anything."""
        what = f"version {self.version}"
        check_against(self.manifest.specs(), param_specs(dests), what=f"the manifest of {what}")
        for entry in self.manifest.files:
            hasher = new_checksum(self.manifest.checksum)
            view = memoryview(self._maps[entry.name])
            try:
                for start in range(0, len(view), CHUNK_BYTES):
                    stop()
                    hasher.update(view[start:start + CHUNK_BYTES])
            finally:
                view.release()
            if hasher.hexdigest() != entry.checksum:
                raise _bad(f"{what}: {entry.name} fails its {self.manifest.checksum} checksum (corrupt on disk)")
        if self.manifest.base is not None:
            self._check_deltas(what)
            return
        by_file: dict[str, dict[str, TensorEntry]] = {f.name: {} for f in self.manifest.files}
        for t in self.manifest.tensors:
            by_file[t.file][t.name] = t
        for fname, tensors in by_file.items():
            self._check_header(fname, tensors, what)

    @property
    def is_delta(self) -> bool:
        return self.manifest.base is not None

    def _check_deltas(self, what: str) -> None:
        for t in self.manifest.tensors:
            d = t.delta
            unit = _torch_dtype(t.dtype, what=f"{what}: {t.name}").itemsize
            n = math.prod(t.shape)
            try:
                want = _delta.blob_bytes(d.kind, n, d.count, unit)
            except ProtocolError:
                raise _bad(f"{what}: {t.name} has an unknown delta encoding {d.kind}", param=t.name) from None
            if (not 0 <= d.count <= n or (d.kind == _delta.NONE) != (d.count == 0) or d.nbytes != want
                    or d.offset % 8 or not 0 <= d.offset <= d.offset + d.nbytes <= len(self._maps[t.file])):
                raise _bad(f"{what}: {t.name}'s delta ({d.count} of {n} units as {d.kind}, {d.nbytes} bytes at "
                           f"{d.offset} in {t.file}) does not fit its tensor or file", param=t.name)

    def apply_into(self, dests: Mapping[str, torch.Tensor], stop: Callable[[], None]) -> int:
        """Write each verified delta into ``dests`` (holding the base); return the blob bytes read."""
        read = 0
        with torch.no_grad():
            for t in self.manifest.tensors:
                if t.name not in dests:
                    continue
                stop()
                d, dst = t.delta, dests[t.name]
                if d.kind == _delta.NONE:
                    continue
                blob = torch.frombuffer(self._maps[t.file], dtype=torch.uint8, count=d.nbytes, offset=d.offset)
                if dst.is_contiguous():
                    _delta.apply(units(dst), d.kind, d.count, blob.to(dst.device))
                else:  # the encoding indexes the tensor's elements in order: a contiguous copy
                    staged = dst.contiguous()
                    _delta.apply(units(staged), d.kind, d.count, blob.to(dst.device))
                    dst.copy_(staged)
                read += d.nbytes
                del blob
        return read

    def _check_header(self, fname: str, tensors: Mapping[str, TensorEntry], what: str) -> None:
        mm = self._maps[fname]
        size = len(mm)
        if size < 8:
            raise _bad(f"{what}: {fname} is too short for a safetensors file")
        n = int.from_bytes(mm[:8], "little")
        if n > size - 8:
            raise _bad(f"{what}: {fname} announces a {n}-byte header in a {size}-byte file")
        try:
            raw = msgspec.json.decode(mm[8:8 + n], type=dict[str, msgspec.Raw])
            raw.pop("__metadata__", None)
            header = {k: msgspec.json.decode(v, type=_HeaderEntry) for k, v in raw.items()}
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _bad(f"{what}: {fname} has a bad safetensors header: {exc}") from exc
        if set(header) != set(tensors):
            raise _bad(f"{what}: {fname} holds {sorted(header)[:5]}, the manifest says {sorted(tensors)[:5]}")
        data_start = 8 + n
        for name, entry in tensors.items():
            h = header[name]
            dtype = _torch_dtype(entry.dtype, what=f"{what}: {name}")
            begin, end = h.data_offsets
            if (SAFETENSORS_DTYPES.get(h.dtype) != entry.dtype or h.shape != entry.shape
                    or entry.nbytes != math.prod(entry.shape) * dtype.itemsize
                    or not 0 <= begin <= end <= size - data_start or end - begin != entry.nbytes):
                raise _bad(f"{what}: {name} in {fname} is {h.dtype}{list(h.shape)} at [{begin}, {end}), "
                           f"the manifest says {entry.dtype}{list(entry.shape)}, {entry.nbytes} bytes", param=name)
            self._where[name] = (fname, data_start + begin)

    def copy_into(self, dests: Mapping[str, torch.Tensor], stop: Callable[[], None]) -> int:
        """Copy every verified tensor into ``dests``; return the bytes copied."""
        copied = 0
        with torch.no_grad():
            for name, dst in dests.items():
                stop()
                fname, offset = self._where[name]
                if dst.numel() == 0:
                    continue
                src = torch.frombuffer(self._maps[fname], dtype=dst.dtype, count=dst.numel(), offset=offset)
                dst.copy_(src.view(dst.shape))
                copied += dst.numel() * dst.element_size()
                del src
        return copied

    def close(self) -> None:
        """Unmap the files. Called on the thread that verified and copied, after both:
        ``torch.frombuffer`` views hold no buffer export, so nothing may read them after."""
        for mm in self._maps.values():
            try:
                if isinstance(mm, mmap.mmap):
                    mm.close()
            except BufferError:
                continue  # a memoryview still exports it: it is unmapped when that goes
        self._maps = {}


def units(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as one flat tensor of its element-size units (the delta's view)."""
    return t.detach().reshape(-1).view(_delta.unit_dtype(t.element_size()))


def _safe_name(fname: str, what: str, delta: bool) -> str:
    if not (_DELTA_NAME if delta else _FILE_NAME).match(fname):
        raise _bad(f"{what}: the manifest names a file {fname!r} outside this version's layout")
    return fname


def open_version(directory: str, version: int) -> OpenVersion:
    """Map committed ``version``: ``FileNotFoundError`` if it was pruned meanwhile (retry
    with a newer one), ``ProtocolError`` if its manifest or file sizes are wrong."""
    what = f"version {version}"
    root = os.path.join(directory, dirs.version_name(version))
    try:
        data = dirs.read_small(os.path.join(root, dirs.MANIFEST), limit=MAX_MANIFEST_BYTES)
    except ValueError as exc:
        raise _bad(f"{what}: {exc}") from exc
    manifest = decode(data, Manifest, what=f"the manifest of {what}")
    if manifest.version != version:
        raise _bad(f"{what}: its manifest says version {manifest.version}")
    if manifest.checksum not in CHECKSUMS:
        raise _bad(f"{what}: unknown checksum algorithm {manifest.checksum!r}")
    delta = manifest.base is not None
    files = {_safe_name(f.name, what, delta): f for f in manifest.files}
    if delta and not 0 <= manifest.base < version:
        raise _bad(f"{what}: a delta over version {manifest.base}, not an earlier one")
    if any((t.delta is None or t.checksum is None) if delta else t.delta is not None for t in manifest.tensors):
        raise _bad(f"{what}: the manifest mixes full tensors and deltas")
    names = [t.name for t in manifest.tensors]
    if len(files) != len(manifest.files) or len(set(names)) != len(names):
        raise _bad(f"{what}: the manifest lists a file or a tensor twice")
    if any(t.file not in files for t in manifest.tensors):
        raise _bad(f"{what}: the manifest places a tensor in a file it does not list")
    maps: dict[str, mmap.mmap | bytearray] = {}
    try:
        for fname, entry in files.items():
            fd = os.open(os.path.join(root, fname), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if size != entry.nbytes:
                    raise _bad(f"{what}: {fname} has {size} bytes, the manifest says {entry.nbytes}")
                if size == 0 and not delta:
                    raise _bad(f"{what}: {fname} is empty")
                if size == 0:  # a delta file of unchanged tensors only (nothing to map)
                    maps[fname] = bytearray()
                    continue
                # ACCESS_COPY: a private mapping, writable in memory only, so torch.frombuffer
                # takes it without a warning; the file itself is never written.
                maps[fname] = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
    except BaseException:
        for mm in maps.values():
            if isinstance(mm, mmap.mmap):
                mm.close()
        raise
    return OpenVersion(version, manifest, maps)
