"""SGLang's ``flattened_bucket`` format, built on the sending side only.

What SGLang expects (``UpdateWeightsFromTensorReqInput`` with
``load_format="flattened_bucket"``, SGLang releases whose ``FlattenedTensorBucket``
has ``supports_multi_dtypes = True``): ``serialized_named_tensors`` holds one entry per
engine tp rank; entry ``i`` is a ``MultiprocessingSerializer`` blob (``ForkingPickler``
output, base64 text over HTTP) of the dict::

    {"flattened_tensor": <uint8 tensor on tp rank i's device>,
     "metadata": [sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata(
                      name, shape: torch.Size, dtype: torch.dtype,
                      start_idx, end_idx, numel), ...]}

Indices are *byte* offsets into the uint8 tensor (``numel`` = ``end_idx - start_idx``
bytes); SGLang rebuilds each tensor as ``flat[start_idx:end_idx].view(dtype)
.reshape(shape)``. Several dtypes share one bucket. ``view(dtype)`` needs the slice to
start at a multiple of the element size, so each tensor starts at the next multiple
of its own element size; the padding between tensors is never read. Wherever SGLang's
own builder would produce a valid bucket, this layout is byte-identical to it.

SGLang's unpickler only admits allow-listed modules (``torch.``, ``multiprocessing.``,
``sglang.srt.weight_sync.tensor_bucket.``, ...), so the metadata must be pickled under
SGLang's class path. :class:`FlattenedTensorMetadata` is our own mirror of that
dataclass, and :func:`serialize_bucket` writes it under SGLang's name with a
pure-Python pickler whose ``save_global`` knows that one alias, so sglang need not be
installed on the trainer. CPU storages are shared by file name (torch's
``file_system`` strategy, reference-counted by ``torch_shm_manager``) rather than by
descriptor passing, so the buffer is never re-homed and no descriptor is parked in a
resource sharer when nobody decodes the blob.

Nothing here unpickles. Our own receivers (the in-process engine adapter) rebuild
tensors from typed handles (:class:`ShmHandle`, :class:`CudaIpcHandle`) with the fixed
functions :func:`open_buffer` and :func:`reconstruct`.

CUDA IPC handles cannot be opened in the process that exported them (the driver
refuses). The in-process adapter lives in a trainer process and receives that
process's own handle too, so :func:`export_buffer` remembers the CUDA buffers it
exported (weakly) and :func:`open_buffer` returns such a buffer itself.
"""

from __future__ import annotations

import base64
import copyreg
import hashlib
import io
import pickle
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import msgspec
import torch

from policyworker.errors import ConfigError, ProtocolError

__all__ = [
    "SGLANG_METADATA_CLASS",
    "SGLANG_METADATA_MODULE",
    "BucketLayout",
    "BufferHandle",
    "copy_tensors",
    "CudaIpcHandle",
    "FlattenedTensorMetadata",
    "ShmHandle",
    "export_buffer",
    "manifest_digest",
    "open_buffer",
    "pack_bucket",
    "pack_views",
    "plan_buckets",
    "reconstruct",
    "serialize_bucket",
    "to_base64",
]

SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"
SGLANG_METADATA_CLASS = "FlattenedTensorMetadata"

# dtypes a bucket may carry, by name: a receiver maps names through this table only.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
        torch.int16, torch.int32, torch.int64, torch.bool,
        *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
    )
}


@dataclass(eq=True)
class FlattenedTensorMetadata:
    """Mirror of SGLang's dataclass (same fields, same order); pickled under SGLang's path."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """One bucket: its tensors' byte ranges in the flattened buffer, and its used bytes."""

    index: int
    metadata: tuple[FlattenedTensorMetadata, ...]
    nbytes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_buckets(named: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[BucketLayout]:
    """Greedy buckets in name order, each at most ``bucket_bytes`` (a bigger tensor goes alone).

    A function of names, shapes and dtypes only, so every rank holding the same
    manifest cuts the same buckets.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1024:
        raise ConfigError(f"bucket_bytes must be an int >= 1024, got {bucket_bytes!r}")
    buckets: list[BucketLayout] = []
    current: list[FlattenedTensorMetadata] = []
    offset = 0
    for name in sorted(named):
        t = named[name]
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise ConfigError(f"{name!r} has dtype {t.dtype}, which SGLang buckets here do not carry", param=name)
        size, align = _nbytes(t), t.element_size()
        start = -(-offset // align) * align
        if current and start + size > bucket_bytes:
            buckets.append(BucketLayout(len(buckets), tuple(current), offset))
            current, start = [], 0
        current.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, start, start + size, size))
        offset = start + size
    if current:
        buckets.append(BucketLayout(len(buckets), tuple(current), offset))
    return buckets


def manifest_digest(named: Mapping[str, torch.Tensor]) -> int:
    """63-bit digest of (name, shape, dtype) in name order: ranks of one engine must agree."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(named):
        t = named[name]
        h.update(f"{name}\0{tuple(t.shape)}\0{t.dtype}\n".encode())
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


def pack_views(layout: BucketLayout, buffer: torch.Tensor) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    """The bucket's non-empty tensors as (names, views of ``buffer``): built once per buffer."""
    names, views = [], []
    for meta in layout.metadata:
        if meta.numel:
            names.append(meta.name)
            views.append(buffer.narrow(0, meta.start_idx, meta.numel).view(meta.dtype).view(meta.shape))
    return tuple(names), tuple(views)


# Below this many bytes a tensor joins one batched copy; above it gets its own ``copy_``
# (a plain memcpy on the GPU, the fastest copy there is; its launch cost is noise there).
_BATCH_BELOW = 1 << 20


def copy_tensors(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair: big tensors one by one, small ones in one batched call."""
    small_d, small_s = [], []
    with torch.no_grad():
        for d, s in zip(dsts, srcs):
            if d.numel() * d.element_size() >= _BATCH_BELOW:
                d.copy_(s)
            else:
                small_d.append(d)
                small_s.append(s)
        if small_d:
            torch._foreach_copy_(small_d, small_s)


def pack_bucket(layout: BucketLayout, named: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> None:
    """Copy the bucket's tensors into ``buffer`` (uint8) at their byte ranges."""
    names, views = pack_views(layout, buffer)
    copy_tensors(views, [named[n] for n in names])


def reconstruct(buffer: torch.Tensor, metadata: Sequence[FlattenedTensorMetadata]) -> list[tuple[str, torch.Tensor]]:
    """SGLang's rebuild rule, as a fixed function: views of ``buffer`` (no copies)."""
    out = []
    for meta in metadata:
        if meta.start_idx < 0 or meta.end_idx > buffer.numel() or meta.end_idx - meta.start_idx != meta.numel:
            raise ProtocolError(f"{meta.name!r}: byte range [{meta.start_idx}, {meta.end_idx}) does not fit "
                                f"a {buffer.numel()}-byte bucket", param=meta.name)
        out.append((meta.name, buffer[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)))
    return out


# -- shared buffers and their handles -------------------------------------------------
class ShmHandle(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A CPU buffer in torch's shared memory (``file_system`` strategy)."""

    manager: bytes
    filename: bytes
    nbytes: int


class CudaIpcHandle(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A CUDA buffer's IPC handle (the fields of ``UntypedStorage._share_cuda_()``)."""

    device_uuid: str
    handle: bytes
    storage_nbytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    nbytes: int


BufferHandle = Union[ShmHandle, CudaIpcHandle]

# CUDA buffers this process exported, by handle: open_buffer hands them back as they
# are (a process cannot open its own CUDA IPC handle). Weak: the exporter owns them.
_LOCAL_CUDA: weakref.WeakValueDictionary[CudaIpcHandle, torch.Tensor] = weakref.WeakValueDictionary()


def export_buffer(nbytes: int, device: torch.device) -> tuple[torch.Tensor, BufferHandle]:
    """A uint8 buffer a peer process can open, and its handle. Allocated once, reused."""
    if device.type == "cuda":
        # At least one byte: an empty storage has no IPC handle.
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        fields = buf.untyped_storage()._share_cuda_()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle: BufferHandle = CudaIpcHandle(
            device_uuid=uuid, handle=bytes(fields[1]), storage_nbytes=int(fields[2]),
            storage_offset=int(fields[3]), ref_counter_handle=bytes(fields[4]),
            ref_counter_offset=int(fields[5]), event_handle=bytes(fields[6] or b""),
            event_sync_required=bool(fields[7]), nbytes=nbytes,
        )
        view = buf.narrow(0, 0, nbytes)
        _LOCAL_CUDA[handle] = view
        return view, handle
    if device.type != "cpu":
        raise ConfigError(f"sglang_ipc buffers live on cuda or cpu, not {device.type}")
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    # Re-homes the storage into shared memory now, before any view of it exists.
    manager, filename, size = buf.untyped_storage()._share_filename_cpu_()
    return buf.narrow(0, 0, nbytes), ShmHandle(manager=bytes(manager), filename=bytes(filename), nbytes=int(size))


def open_buffer(handle: BufferHandle) -> torch.Tensor:
    """The peer's buffer as a uint8 tensor in this process (fixed function, no unpickling)."""
    if isinstance(handle, ShmHandle):
        storage = torch.UntypedStorage._new_shared_filename_cpu(handle.manager, handle.filename, handle.nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    if isinstance(handle, CudaIpcHandle):
        local = _LOCAL_CUDA.get(handle)
        if local is not None:
            # Exported here: use it directly. torch counts one consumer per export and
            # keeps the block "in limbo" (never freed) until that consumer lets go;
            # this process holds the tensor itself, so it lets go of the count now.
            torch.UntypedStorage._release_ipc_counter_cuda(handle.ref_counter_handle, handle.ref_counter_offset)
            return local
        index = next((i for i in range(torch.cuda.device_count())
                      if str(torch.cuda.get_device_properties(i).uuid) == handle.device_uuid), None)
        if index is None:
            raise ProtocolError(f"no visible CUDA device has uuid {handle.device_uuid}")
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(
                index, handle.handle, handle.storage_nbytes, handle.storage_offset,
                handle.ref_counter_handle, handle.ref_counter_offset,
                handle.event_handle or None, handle.event_sync_required,
            )
        t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage)
        return t.narrow(0, 0, handle.nbytes)
    raise ProtocolError(f"unknown buffer handle {type(handle).__name__}")


# -- the SGLang blob (sender only) --------------------------------------------------
def _reduce_cpu_storage(storage):
    """torch's ``file_system`` reduction of a CPU storage, whatever the global strategy."""
    from torch.multiprocessing import reductions

    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)
    manager, filename, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the decoder's rebuild_storage_filename drops it again
    reductions.shared_cache[filename] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), manager, filename, size)


def _dispatch_table() -> dict:
    import multiprocessing.reduction as mpr

    import torch.multiprocessing  # noqa: F401 - registers torch's reducers with ForkingPickler

    table = dict(copyreg.dispatch_table)
    table.update(mpr.ForkingPickler._extra_reducers)
    table[torch.UntypedStorage] = _reduce_cpu_storage
    return table


class _SglangPickler(pickle._Pickler):  # the Python pickler: its save_global can be taught an alias
    dispatch_table: dict = {}

    def save_global(self, obj, name=None):
        if obj is FlattenedTensorMetadata:
            self.write(pickle.GLOBAL + f"{SGLANG_METADATA_MODULE}\n{SGLANG_METADATA_CLASS}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


def serialize_bucket(flat: torch.Tensor, metadata: Sequence[FlattenedTensorMetadata]) -> bytes:
    """The ``MultiprocessingSerializer`` blob of one tp rank's bucket (raw bytes).

    ``flat`` is the used part of this rank's buffer; the blob carries its IPC /
    shared-memory handle, not its bytes.
    """
    if not _SglangPickler.dispatch_table:
        _SglangPickler.dispatch_table = _dispatch_table()
    out = io.BytesIO()
    _SglangPickler(out, protocol=pickle.DEFAULT_PROTOCOL).dump(
        {"flattened_tensor": flat, "metadata": list(metadata)}
    )
    return out.getvalue()


def to_base64(blob: bytes) -> str:
    """The text form SGLang's HTTP route takes (``MultiprocessingSerializer(output_str=True)``)."""
    return base64.b64encode(blob).decode("ascii")
