"""Wire messages of the ``zmq`` transport (colocated trainer ⇄ rollout).

Everything that crosses the ZMQ socket is one of these ``policyworker.wire.Message``
subclasses, msgpack-encoded with a ``type`` tag; nothing is pickled. Storage handles
are plain data (bytes and ints) that :mod:`.ipc_handles` turns back into storages
with fixed functions: no message can name code to run.

Order of one connection and of one refit (``R`` = rollout, ``T`` = trainer)::

    R → T  Hello(rank, plan_hash, session)          connect: plan check
    T → R  Welcome(plan_hash, session, ok, reason)  ok=False → both raise PlanMismatch
    --- per refit ---
    R → T  Ready(session, committed, attempt)       the rollout is waiting for a refit
    T → R  Offer(version, handles, release, sources, staged_buckets, ring)
    T → R  BucketReady(version, seq, slot)          } staged sources only: at most
    R → T  BucketDone(version, seq)                 } ``len(ring)`` buckets outstanding
    R → T  Done(version, nbytes, ok, error)         every byte landed (or why not)
    T → R  Commit(version) | Abort(version, reason)  the rollout commits only on Commit

Every per-refit message carries the ``attempt`` token the rollout drew for that
refit (its Ready opens the attempt; the channel stamps and checks it): a message of
an older, failed attempt — a late BucketDone or Done after a timeout — is dropped as
stale instead of derailing the next refit, so the pair recovers without a rebuild.
"""

from __future__ import annotations

from typing import Union

import msgspec

from policyworker.wire import Decoder, Message, encode

__all__ = [
    "Abort", "BucketDone", "BucketReady", "Commit", "CudaHandle", "Done", "Hello", "Offer",
    "Ready", "ShmHandle", "SourceRef", "StorageHandle", "Welcome", "ZmqMessage", "decoder", "encode",
]


class CudaHandle(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="cuda"):
    """``UntypedStorage._share_cuda_()``'s fields, plus our id (see ipc_handles.open_handle)."""

    id: int
    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class ShmHandle(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="shm"):
    """A file_system-style shared CPU storage: (shm manager socket, file name, bytes)."""

    id: int
    manager: bytes
    filename: bytes
    size: int


StorageHandle = Union[CudaHandle, ShmHandle]


class SourceRef(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Where the trainer's source tensor ``name`` lives: a strided view of storage ``handle``.

    ``handle == -1``: the tensor is not exported (offloaded, or staging forced); its
    bytes arrive through the staging ring instead. ``offset`` and ``stride`` count
    elements of ``dtype``, as ``Tensor.set_`` takes them.
    """

    name: str
    handle: int
    offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class Hello(Message, frozen=True, kw_only=True):
    rank: int
    plan_hash: str
    session: str
    device_id: str = ""
    pid: int = 0


class Welcome(Message, frozen=True, kw_only=True):
    plan_hash: str
    session: str
    ok: bool
    reason: str = ""


class Ready(Message, frozen=True, kw_only=True):
    session: str
    committed: int
    #: Fresh per refit attempt; every later message of the attempt carries it.
    attempt: str = ""


class Offer(Message, frozen=True, kw_only=True):
    """One refit: handles the rollout has not opened yet, handles to drop, every source.

    ``ring`` lists the staging ring's handle ids (slot order) when ``staged_buckets`` > 0.
    """

    version: int
    plan_hash: str
    handles: list[StorageHandle]
    release: list[int]
    sources: list[SourceRef]
    staged_buckets: int
    ring: list[int]
    bucket_bytes: int
    kv_scales: dict[str, float] | None = None
    #: Bumped whenever ``sources``/``ring`` change; ``sources`` is empty when the
    #: rollout already holds this epoch's table (this session).
    epoch: int = 0
    attempt: str = ""


class BucketReady(Message, frozen=True, kw_only=True):
    version: int
    seq: int
    slot: int
    attempt: str = ""


class BucketDone(Message, frozen=True, kw_only=True):
    version: int
    seq: int
    attempt: str = ""


class Done(Message, frozen=True, kw_only=True):
    version: int
    nbytes: int
    ok: bool
    error: str = ""
    attempt: str = ""


class Commit(Message, frozen=True, kw_only=True):
    version: int
    attempt: str = ""


class Abort(Message, frozen=True, kw_only=True):
    version: int
    reason: str
    attempt: str = ""


ZmqMessage = Union[Hello, Welcome, Ready, Offer, BucketReady, BucketDone, Done, Commit, Abort]

#: The one decoder of this protocol: anything outside ``ZmqMessage`` is a ProtocolError.
decoder = Decoder(ZmqMessage)
