"""What is on disk besides the tensors: the manifest of a version and the writer's signature.

Both are JSON written by msgspec and decoded into typed structs, once, at the edge: a
file that does not decode, or whose self-digest does not match, is a
``ProtocolError``. The digest is the sha256 of the struct encoded with ``digest=""``
(msgspec's encoding is deterministic), so a flipped byte anywhere in the manifest —
a shape digit, a file checksum — is caught before any tensor is read.

* :class:`Signature` (``signature.json``, written by the writer at connect): every
  tensor's name, dtype and shape, and the writer's session and base version. A
  receiver compares it with its destinations at connect, so a mismatched pairing
  fails there (``PlanMismatch``); a trainer rank that does not write numbers its
  refits from it.
* :class:`Manifest` (``v<version>/manifest.json``, written last, inside the version's
  temporary directory): the version, the checksum algorithm, every file with its byte
  count and checksum, every tensor with its file, dtype, shape and byte count. A
  *delta* version (``base`` set) holds, per tensor, where its encoded changed units lie
  in a ``delta-*.bin`` file (:class:`DeltaEntry`) and the checksum
  (:func:`policyworker.layout.delta.checksum`) of the bytes a reader must end with.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import msgspec

from policyworker.errors import ConfigError, PlanMismatch, ProtocolError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHECKSUMS",
    "FORMAT",
    "DeltaEntry",
    "FileEntry",
    "Manifest",
    "ParamSpec",
    "Signature",
    "TensorEntry",
    "check_against",
    "decode",
    "encode",
    "new_checksum",
    "param_specs",
]

FORMAT = 1
CHECKSUMS = ("sha256", "crc32")


class ParamSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tensor as both sides must agree on it. ``dtype`` is torch's name (``"bfloat16"``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class Signature(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The writer's tensors, and its session: ``session`` is new at every connect of the
    writer, ``base`` the version it numbers on from (its refit ``k`` writes ``base + k``);
    trainer ranks that do not write take their version numbers from these. ``delta``: the
    writer attached in delta mode (a rollout must too)."""

    format: int
    writer_rank: int
    params: tuple[ParamSpec, ...]
    session: str = ""
    base: int = 0
    delta: bool = False
    digest: str = ""


class DeltaEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tensor's changed units in a delta file: ``kind`` and ``count`` as
    :mod:`policyworker.layout.delta` encodes them, ``nbytes`` of blob at ``offset``."""

    kind: int
    count: int
    offset: int
    nbytes: int


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``checksum``/``delta``: set in a delta version only (see the module docstring)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    checksum: int | None = None
    delta: DeltaEntry | None = None


class FileEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    nbytes: int
    checksum: str


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One committed version; ``session`` is the writer session (``Signature.session``) that
    wrote it; ``base``: the version a delta version applies to (None: a full version)."""

    format: int
    version: int
    writer_rank: int
    checksum: str
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    session: str = ""
    base: int | None = None
    digest: str = ""

    @property
    def nbytes(self) -> int:
        """Tensor bytes a reader holds after this version."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        """Bytes of its files on disk (what a reader reads)."""
        return sum(f.nbytes for f in self.files)

    def specs(self) -> tuple[ParamSpec, ...]:
        return tuple(ParamSpec(name=t.name, dtype=t.dtype, shape=t.shape) for t in self.tensors)


def param_specs(params: Mapping[str, torch.Tensor]) -> tuple[ParamSpec, ...]:
    """The specs of ``params``, sorted by name (the order files and manifests use)."""
    return tuple(
        ParamSpec(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
        for name, t in sorted(params.items())
    )


# Fields of delta mode, left out of the JSON while unset: a full version's manifest and a
# signature without delta stay byte for byte what writers without delta mode write (so
# either reads the other's), and a delta manifest is refused by a reader that predates it.
_DELTA_FIELDS = {"base": None, "delta": False}
_DELTA_TENSOR_FIELDS = {"checksum": None, "delta": None}


def _builtins(struct: Signature | Manifest) -> dict:
    out = msgspec.to_builtins(struct)
    for key, unset in _DELTA_FIELDS.items():
        if key in out and out[key] == unset:
            del out[key]
    for t in out.get("tensors", ()):
        for key, unset in _DELTA_TENSOR_FIELDS.items():
            if t.get(key, unset) == unset:
                t.pop(key, None)
    return out


def _digest(struct: Signature | Manifest) -> str:
    return hashlib.sha256(msgspec.json.encode(_builtins(msgspec.structs.replace(struct, digest="")))).hexdigest()


def encode(struct: Signature | Manifest) -> bytes:
    """JSON bytes of ``struct`` with its self-digest filled in."""
    return msgspec.json.encode(_builtins(msgspec.structs.replace(struct, digest=_digest(struct))))


def decode(data: bytes, kind: type[Signature] | type[Manifest], *, what: str) -> Signature | Manifest:
    """Decode and self-check ``data``; ``ProtocolError`` naming ``what`` otherwise."""
    try:
        struct = msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"{what} is not a valid {kind.__name__}: {exc}", transport="files") from exc
    if struct.format != FORMAT:
        raise ProtocolError(f"{what} has format {struct.format}, this reader knows {FORMAT}", transport="files")
    if struct.digest != _digest(struct):
        raise ProtocolError(f"{what} fails its own digest (corrupt or edited)", transport="files")
    return struct


def check_against(theirs: Iterable[ParamSpec], mine: Iterable[ParamSpec], *, what: str) -> None:
    """``PlanMismatch`` unless both sides hold the same names, dtypes and shapes."""
    a = {p.name: p for p in theirs}
    b = {p.name: p for p in mine}
    problems = [f"{n}: only in {what}" for n in sorted(set(a) - set(b))]
    problems += [f"{n}: missing from {what}" for n in sorted(set(b) - set(a))]
    for n in sorted(set(a) & set(b)):
        if a[n] != b[n]:
            problems.append(f"{n}: {what} has {a[n].dtype}{list(a[n].shape)}, here {b[n].dtype}{list(b[n].shape)}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        name = problems[0].split(":", 1)[0]
        raise PlanMismatch(f"the tensors here do not match {what}: {shown}", transport="files", param=name)


class _Crc32:
    """``zlib.crc32`` behind hashlib's update/hexdigest interface."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_checksum(algorithm: str):
    """A fresh hasher (``update`` / ``hexdigest``) for ``algorithm`` in :data:`CHECKSUMS`."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "crc32":
        return _Crc32()
    raise ConfigError(f"checksum must be one of {', '.join(CHECKSUMS)}, got {algorithm!r}", transport="files")
