"""Typed setup and options: plain keyword arguments → a frozen dataclass, once, at the edge.

Every transport declares what ``attach_transport(name, **setup)`` and
``refit(name, **options)`` accept as frozen, kw-only dataclasses (``Transport.Setup``,
``Transport.Options``). :func:`parse` turns the caller's keywords into one of them:
an unknown key, a missing required key or a value of the wrong type is a
``ConfigError`` that names the key and lists what is accepted — raised when the
worker is given the value, not at the first refit. A dataclass may check values
further in ``__post_init__`` (raising ``ConfigError``).

Types checked: ``bool``, ``int`` (bools refused), ``float`` (ints accepted), ``str``,
``X | None``; anything else (``Any``, groups, mappings) is passed through for the
dataclass's own ``__post_init__`` to check.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from policyworker.errors import ConfigError

__all__ = ["EmptyOptions", "EmptySetup", "parse", "positive_int", "positive_seconds", "torch_dtype"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EmptySetup:
    """A transport that needs nothing at attach time."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EmptyOptions:
    """A transport that takes no per-refit options."""


def _check_type(value: Any, hint: Any) -> bool:
    """True when ``value`` fits ``hint`` (or the hint is one we leave to ``__post_init__``)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_check_type(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


@functools.lru_cache(maxsize=256)
def _type_hints(cls: type) -> dict[str, Any]:
    # Evaluated once per class: parse() runs on every refit's options.
    return typing.get_type_hints(cls)


def parse(cls: type[T], values: Mapping[str, Any], *, what: str) -> T:
    """``cls(**values)`` with every key and simple type checked; ``ConfigError`` otherwise.

    ``what`` names the thing in errors, e.g. ``"setup of transport 'zmq'"``.
    """
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{what}: {cls!r} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    accepted = ", ".join(sorted(fields)) or "nothing"
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; accepted: {accepted}")
    hints = _type_hints(cls)
    for name, value in values.items():
        hint = hints.get(name, Any)
        if not _check_type(value, hint):
            shown = getattr(hint, "__name__", None) or str(hint)
            raise ConfigError(f"{what}: {name!r} must be {shown}, got {value!r}")
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{what}: missing required key(s) {', '.join(map(repr, missing))}; accepted: {accepted}")
    return cls(**values)


def positive_int(value: int, name: str, *, minimum: int = 1) -> None:
    """``ConfigError`` unless ``value`` is an int >= ``minimum`` (for ``__post_init__``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")


def positive_seconds(value: float | None, name: str, *, optional: bool = True) -> float | None:
    """``value`` as a float; ``ConfigError`` unless it is a finite number of seconds > 0
    (or None when ``optional``). The one timeout check: workers, transports, groups, clients."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``); ``ConfigError`` for anything else.

    The one dtype-name converter: plans, handles and files carry dtypes by name.
    """
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown torch dtype {name!r}")
    return dtype
