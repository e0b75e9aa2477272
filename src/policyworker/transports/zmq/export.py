"""The trainer's side of a zmq refit: its sources made mappable and exported.

Sources on the trainer's device are flattened into one buffer (``flatten``, so that
a tp=1 refit is one copy) or, on CPU, moved into shared memory; each storage is
exported once (:func:`export`: a CUDA IPC or shm handle) and again only when it
moved. :func:`fingerprint` is the cheap per-refit check that nothing moved. Staged
sources travel through a ring of exported buffers (:func:`ring`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from policyworker.errors import ConfigError
from policyworker.transports.zmq import wire as w
from policyworker.transports.base import TransportContext
from policyworker.transports.ipc_handles import export_storage, flatten_into, share_cpu, storage_key

__all__ = ["export", "fingerprint", "holds", "prepare_sources", "ring"]

_data_ptr = torch.Tensor.data_ptr


def prepare_sources(ctx: TransportContext, *, staged: bool, flatten: bool) -> list[str]:
    """Put mappable sources where they can be exported; return notes on moves."""
    notes = []
    dev = ctx.device.torch_device
    names = list(ctx.plan.local_tensors("src", 0))
    missing = [n for n in names if n not in ctx.params]
    if missing:
        raise ConfigError(f"trainer lacks source tensor {missing[0]!r}", rank=ctx.rank, param=missing[0])
    direct = [] if staged else [n for n in names if ctx.params[n].device == dev]
    flat = ctx.state.get("flat")
    if flatten and direct:
        flat_ptr = None if flat is None else flat.untyped_storage().data_ptr()
        if any(ctx.params[n].untyped_storage().data_ptr() != flat_ptr for n in direct):
            ctx.state["flat"] = flatten_into([ctx.params[n] for n in direct], device=dev,
                                             shared_cpu=dev.type == "cpu")
            notes.append(f"flattened {len(direct)} sources into one buffer")
    elif dev.type == "cpu":
        moved = sum(share_cpu(ctx.params[n]) for n in direct)
        if moved:
            notes.append(f"moved {moved} storages into shared memory")
    ctx.state["direct_names"] = set(direct)
    return notes


def fingerprint(params: Mapping[str, torch.Tensor], names) -> tuple | None:
    """Cheap per-refit check that no source moved: the sources' data pointers in plan
    order (None when one is missing or not a tensor: the slow path says which).

    It runs on every refit before the Offer, so it is one C-level pass over the
    parameters. On CPU a freed shm file's address can come back as another file:
    the cache holds the storages it was built from (:func:`holds`), so none of
    them is freed while its address is the fingerprint's.
    """
    try:
        return tuple(map(_data_ptr, map(params.__getitem__, names)))
    except (KeyError, TypeError):
        return None


def holds(ctx: TransportContext, names) -> list[torch.UntypedStorage]:
    if ctx.device.torch_device.type != "cpu":
        return []  # CUDA: data pointers alone, as the export key (an address names its block)
    return [ctx.params[n].untyped_storage() for n in names]


def _key(t: torch.Tensor) -> tuple:
    key = storage_key(t)
    if t.device.type == "cpu":  # a freed shm file's address can come back as another file
        key += (t.untyped_storage()._share_filename_cpu_()[1],)
    return key


def export(ctx: TransportContext) -> tuple[list[w.SourceRef], list[str]]:
    st = ctx.state
    exports: dict[tuple, w.StorageHandle] = st.setdefault("exports", {})
    keys: dict[str, tuple] = st.setdefault("src_keys", {})
    refs, moved, used = [], 0, set()
    for name in ctx.plan.local_tensors("src", 0):
        t = ctx.params[name]
        if name not in st["direct_names"]:
            refs.append(w.SourceRef(name=name, handle=-1, offset=0, dtype=str(t.dtype).removeprefix("torch."),
                                    shape=tuple(t.shape), stride=tuple(t.stride())))
            continue
        key = _key(t)
        if name in keys and keys[name] != key:
            moved += 1
        keys[name] = key
        h = exports.get(key)
        if h is None:
            st["next_id"] = st.get("next_id", 0) + 1
            h = exports[key] = export_storage(t, st["next_id"])
        used.add(key)
        refs.append(w.SourceRef(name=name, handle=h.id, offset=t.storage_offset(),
                                dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                                stride=tuple(t.stride())))
    st["release"] = [exports.pop(k).id for k in list(exports) if k not in used]
    notes = []
    if moved:
        st["reexports"] = st.get("reexports", 0) + moved
        notes.append(f"re-exported {moved} moved storages")
    return refs, notes


def ring(ctx: TransportContext, staging: int, slot_bytes: int) -> list[tuple[torch.Tensor, w.StorageHandle]]:
    st, dev = ctx.state, ctx.device.torch_device
    ring = st.get("ring")
    if ring is None or len(ring) != staging or ring[0][0].numel() < slot_bytes:
        ring = []
        for _ in range(staging):
            buf = torch.empty(slot_bytes, dtype=torch.uint8, device=dev)
            if dev.type == "cpu":
                share_cpu(buf)
            buf.fill_(0)  # touch the pages once: fresh pages cost more than the copy
            st["next_id"] = st.get("next_id", 0) + 1
            ring.append((buf, export_storage(buf, st["next_id"])))
        st["ring"] = ring
    return ring
