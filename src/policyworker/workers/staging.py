"""A second set of tensors shaped like a live set, for refits that commit by a swap.

``twin_tensors(live)`` allocates, on the same devices, tensors of the same names,
shapes, strides and dtypes that share storage the same way the live ones do: views of
one flat buffer stay views of one new flat buffer at the same offsets, so a transport
that lands a refit as one span into the live set does the same into the twin.
``storage_bytes`` is what such a set costs (each storage counted once).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["same_structure", "storage_bytes", "twin_tensors"]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def storage_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors.values():
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def twin_tensors(live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New (uninitialised) tensors with ``live``'s names, geometry and storage sharing."""
    storages: dict[tuple[str, int], torch.UntypedStorage] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in live.items():
        key = _storage_key(t)
        if key not in storages:
            src = t.untyped_storage()
            storages[key] = torch.empty(src.nbytes(), dtype=torch.uint8, device=t.device).untyped_storage()
        view = torch.empty(0, dtype=t.dtype, device=t.device)
        view.set_(storages[key], t.storage_offset(), t.size(), t.stride())
        out[name] = view
    return out


def same_structure(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """True when ``b`` has ``a``'s names, shapes, strides, dtypes and devices."""
    if a.keys() != b.keys():
        return False
    return all(x.shape == b[k].shape and x.stride() == b[k].stride() and x.dtype == b[k].dtype
               and x.device == b[k].device and x.storage_offset() == b[k].storage_offset() for k, x in a.items())
