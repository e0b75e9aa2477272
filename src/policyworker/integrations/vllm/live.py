"""The storages a vLLM model's live layers can reach: what a refit must never write.

After a commit, some staging tensors are served as they are (a norm weight; on CPU a
linear weight on vLLM's plain path; a kernel's closure over the weight).
:func:`live_storages` finds them by storage, not by assumption; :mod:`.stage` then moves
those parameters' staging elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["live_storages", "storage_key"]


def live_storages(layers: Iterable[torch.nn.Module]) -> set[tuple[str, int]]:
    """(device, storage pointer) of every tensor the live ``layers`` can reach: parameters,
    buffers, tensor attributes and what their callables close over (vLLM's CPU kernels are
    lambdas over the weight they read). Opaque kernel handles (oneDNN's) hold copies."""
    out: set[tuple[str, int]] = set()
    for module in layers:
        for value in _reachable(module):
            if value.numel() > 0:
                out.add((str(value.device), value.untyped_storage().data_ptr()))
    return out


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _reachable(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from (t for t in module._parameters.values() if t is not None)
    yield from (t for t in module._buffers.values() if t is not None)
    for key, value in module.__dict__.items():
        if key not in ("_parameters", "_buffers", "_modules"):
            yield from _tensors_in(value, depth=2)


def _tensors_in(value: Any, depth: int) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
        return
    if depth == 0:
        return
    if isinstance(value, (list, tuple)):
        items: Iterable[Any] = value
    elif isinstance(value, dict):
        items = value.values()
    elif isinstance(value, functools.partial):
        items = (*value.args, *value.keywords.values())
    elif callable(value) and hasattr(value, "__code__"):
        cells = [c.cell_contents for c in (value.__closure__ or ()) if _filled(c)]
        items = (*cells, *(value.__defaults__ or ()))
    else:
        return
    for item in items:
        yield from _tensors_in(item, depth - 1)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises ValueError)
    except ValueError:
        return False
    return True
