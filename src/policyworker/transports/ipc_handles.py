"""Exporting and opening storages across processes of one host, with fixed functions.

* CUDA: ``UntypedStorage._share_cuda_()`` gives a CUDA IPC memory handle (plus
  torch's ref-counter file and event); the peer rebuilds the storage with
  ``UntypedStorage._new_shared_cuda(...)``. Opening costs milliseconds (it maps the
  whole allocator segment), so handles are opened once per peer and kept.
* CPU: the storage is moved into file_system-style shared memory
  (``_share_filename_cpu_()``, served by torch's shm manager) and the peer maps it
  with ``_new_shared_filename_cpu(manager, filename, size)``: a named file, so an
  unrelated process (no fd passing, no authkey) can open it. Moving a storage into
  shared memory changes its data pointer: callers compare :func:`storage_key`
  before and after and treat a change as a moved storage (re-export).

Handles are plain data (:mod:`.zmq_wire`); :func:`open_handle` dispatches on their
type to one of two fixed constructors, never to anything named by the peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import torch

from policyworker.config import torch_dtype
from policyworker.errors import ConfigError, TransportError
from policyworker.transports.zmq.wire import CudaHandle, ShmHandle, SourceRef, StorageHandle

__all__ = ["StorageKey", "export_storage", "flatten_into", "open_handle", "share_cpu", "source_view",
           "storage_key", "torch_dtype"]

#: (storage data pointer, storage bytes, device): a change means the storage moved.
StorageKey = tuple[int, int, str]


def storage_key(t: torch.Tensor) -> StorageKey:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes(), str(t.device))


#: Where torch's file_system sharing puts its files on Linux (containers often mount 64 MB).
SHM_DIR = "/dev/shm"


def check_shm_space(nbytes: int, *, what: str = "shared memory", path: str = SHM_DIR) -> None:
    """``ConfigError`` naming needed and available bytes when ``path`` cannot take ``nbytes``.

    Checked before moving storages there: past the mount's size the kernel answers a
    write into a shm file with SIGBUS, which kills the process with no Python error.
    No such mount (not Linux): nothing to check.
    """
    import os

    try:
        st = os.statvfs(path)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ConfigError(f"{what} needs {nbytes} bytes in {path}, only {free} are free "
                          f"(the mount is {st.f_blocks * st.f_frsize} bytes; containers default to 64 MB: "
                          f"raise --shm-size, or pass staged=True to move bytes through a small ring)")


def share_cpu(t: torch.Tensor) -> bool:
    """Move ``t``'s CPU storage into file_system shared memory; True if it moved.

    Idempotent: a storage already there stays put. Every tensor on that storage
    (views, the Parameter itself) follows, since the storage object is re-pointed.
    Raises ``ConfigError`` (needed and available bytes) when the shm mount is too small.
    """
    s = t.untyped_storage()
    if not s.is_shared():
        check_shm_space(s.nbytes(), what=f"sharing a {s.nbytes()}-byte CPU storage")
    before = s.data_ptr()
    s._share_filename_cpu_()
    return t.untyped_storage().data_ptr() != before


def export_storage(t: torch.Tensor, handle_id: int) -> StorageHandle:
    """A handle to the whole storage under ``t`` (CPU: call :func:`share_cpu` first)."""
    s = t.untyped_storage()
    if t.device.type == "cuda":
        (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = s._share_cuda_()
        return CudaHandle(id=handle_id, device=int(device), handle=bytes(handle), size=int(size),
                          offset=int(offset), ref_counter_handle=bytes(ref_handle),
                          ref_counter_offset=int(ref_offset), event_handle=bytes(event_handle or b""),
                          event_sync_required=bool(event_sync))
    if t.device.type == "cpu":
        manager, filename, size = s._share_filename_cpu_()
        return ShmHandle(id=handle_id, manager=bytes(manager), filename=bytes(filename), size=int(size))
    raise ConfigError(f"cannot export a storage on {t.device}")


def open_handle(h: StorageHandle, device: torch.device) -> torch.UntypedStorage:
    """The peer's storage behind ``h`` (the fixed rebuild functions; see module doc)."""
    try:
        if isinstance(h, CudaHandle):
            if device.type != "cuda":
                raise ConfigError(f"a CUDA handle reached a rollout on {device}")
            with torch.cuda.device(h.device):
                return torch.UntypedStorage._new_shared_cuda(
                    h.device, h.handle, h.size, h.offset, h.ref_counter_handle, h.ref_counter_offset,
                    h.event_handle, h.event_sync_required)
        if isinstance(h, ShmHandle):
            return torch.UntypedStorage._new_shared_filename_cpu(h.manager, h.filename, h.size)
    except (RuntimeError, OSError) as exc:
        raise TransportError(f"cannot open storage handle {h.id}: {exc}", transport="zmq") from exc
    raise ConfigError(f"unknown handle type {type(h).__name__}")


def source_view(storage: torch.UntypedStorage, ref: SourceRef, device: torch.device) -> torch.Tensor:
    """``ref``'s strided view of ``storage``; TransportError if it does not fit inside."""
    dtype = torch_dtype(ref.dtype)
    item = torch.empty((), dtype=dtype).element_size()
    if ref.shape and len(ref.stride) != len(ref.shape):
        raise TransportError(f"source {ref.name!r}: shape and stride ranks differ", transport="zmq", param=ref.name)
    last = ref.offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride)) if prod(ref.shape) else ref.offset
    if ref.offset < 0 or any(s < 0 for s in ref.stride) or (last + 1) * item > storage.nbytes():
        raise TransportError(f"source {ref.name!r} lies outside its storage", transport="zmq", param=ref.name)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, ref.offset, ref.shape, ref.stride)


def flatten_into(tensors: Sequence[torch.Tensor], *, device: torch.device, shared_cpu: bool) -> torch.Tensor:
    """Re-point ``tensors`` (distinct storages) to back-to-back views of one new buffer.

    Order is kept and there is no padding, so consecutive tensors are contiguous in
    the buffer. Values are copied; the tensor objects (Parameters too) stay the same
    objects, so optimizer state keyed by them survives. Returns the flat uint8 buffer.
    Costs one extra copy of the bytes, once, while the old storages are freed.
    """
    offsets, end = [], 0
    for t in tensors:
        if not t.is_contiguous():
            raise ConfigError("flatten_into needs contiguous tensors")
        item = t.element_size()
        end = -(-end // item) * item  # align to the item size only: no other padding
        offsets.append(end)
        end += t.numel() * item
    if shared_cpu:
        check_shm_space(end, what=f"flattening {len(tensors)} tensors into one shared buffer")
    flat = torch.empty(end, dtype=torch.uint8, device=device)
    if shared_cpu:
        share_cpu(flat)
    storage = flat.untyped_storage()
    with torch.no_grad():
        for t, offset in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            flat.narrow(0, offset, n).copy_(t.reshape(-1).view(torch.uint8))
            t.set_(storage, offset // t.element_size(), t.shape, t.stride())
    return flat

