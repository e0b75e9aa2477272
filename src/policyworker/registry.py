"""Transport registry: entry points in group ``policyworker.transports``, loaded lazily.

Built-in transports are registered by our own pyproject exactly as a third-party
distribution registers its plugin::

    [project.entry-points."policyworker.transports"]
    my_transport = "my_pkg.module:MyTransport"

Listing reads entry-point metadata only: it imports no transport. ``load(name)``
imports just that one and checks it is a :class:`~policyworker.transports.base.Transport`
subclass whose ``name`` matches. Any failure — two distributions claiming one name,
an import error, a wrong type — raises ``TransportLoadError`` naming the entry point
and its distribution.

Set ``POLICYWORKER_DISABLE_PLUGIN_AUTOLOAD=1`` to see only policyworker's own
transports (third-party entry points are then ignored, not imported).

Tests build their own :class:`TransportRegistry` from a list of entry points instead
of poking a global.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import ConfigError, TransportLoadError

__all__ = [
    "DISABLE_AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "TransportInfo",
    "TransportRegistry",
    "default_registry",
    "list_transports",
    "load_transport",
]

ENTRY_POINT_GROUP = "policyworker.transports"
DISABLE_AUTOLOAD_ENV = "POLICYWORKER_DISABLE_PLUGIN_AUTOLOAD"
_OWN_DISTRIBUTION = "policyworker"


@dataclass(frozen=True, slots=True)
class TransportInfo:
    name: str
    distribution: str
    target: str  # "module:attr"
    loaded: bool


def _dist_name(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "<unknown>"


class TransportRegistry:
    """Name → entry point, resolved on first use; transports imported on ``load``."""

    def __init__(self, entry_points: Iterable[md.EntryPoint] | None = None, *, autoload: bool | None = None) -> None:
        self._given = None if entry_points is None else list(entry_points)
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("1", "true", "yes")
        self.autoload = autoload
        self._lock = threading.Lock()
        self._eps: dict[str, md.EntryPoint] | None = None
        self._loaded: dict[str, type] = {}

    def _entry_points(self) -> dict[str, md.EntryPoint]:
        with self._lock:
            if self._eps is not None:
                return self._eps
            found = self._given if self._given is not None else list(md.entry_points(group=ENTRY_POINT_GROUP))
            eps: dict[str, md.EntryPoint] = {}
            for ep in found:
                dist = _dist_name(ep)
                if not self.autoload and dist != _OWN_DISTRIBUTION:
                    continue
                prior = eps.get(ep.name)
                if prior is not None and prior.value != ep.value:
                    raise TransportLoadError(
                        f"transport name {ep.name!r} is registered twice: {prior.value} "
                        f"(from {_dist_name(prior)}) and {ep.value} (from {dist})",
                        entry_point=ep.name,
                        distribution=dist,
                    )
                eps[ep.name] = ep
            self._eps = eps
            return eps

    def names(self) -> list[str]:
        return sorted(self._entry_points())

    def list(self) -> list[TransportInfo]:
        """Every registered transport, without importing any."""
        eps = self._entry_points()
        return [
            TransportInfo(name, _dist_name(ep), ep.value, name in self._loaded)
            for name, ep in sorted(eps.items())
        ]

    def load(self, name: str) -> type:
        """Import and return the transport class registered as ``name``."""
        eps = self._entry_points()
        if name in self._loaded:
            return self._loaded[name]
        ep = eps.get(name)
        if ep is None:
            known = ", ".join(sorted(eps)) or "none"
            raise ConfigError(f"unknown transport {name!r}; registered: {known}", transport=name)
        dist = _dist_name(ep)
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin can raise anything at import
            raise TransportLoadError(
                f"transport {name!r} ({ep.value}, from distribution {dist}) failed to import: "
                f"{type(exc).__name__}: {exc}",
                entry_point=name,
                distribution=dist,
            ) from exc
        from .transports.base import Transport

        if not (isinstance(obj, type) and issubclass(obj, Transport)):
            raise TransportLoadError(
                f"transport {name!r} ({ep.value}, from distribution {dist}) is not a Transport subclass",
                entry_point=name,
                distribution=dist,
            )
        if obj.name != name:
            raise TransportLoadError(
                f"transport {name!r} ({ep.value}, from distribution {dist}) says its name is {obj.name!r}",
                entry_point=name,
                distribution=dist,
            )
        with self._lock:
            self._loaded[name] = obj
        return obj


_default: TransportRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> TransportRegistry:
    """The registry over installed distributions (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TransportRegistry()
        return _default


def list_transports() -> list[TransportInfo]:
    return default_registry().list()


def load_transport(name: str) -> type:
    return default_registry().load(name)
