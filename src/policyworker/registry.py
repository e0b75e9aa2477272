"""Transport registry: entry points in group ``policyworker.transports``, loaded lazily.

Built-in transports are registered by our own pyproject exactly as a third-party
distribution registers its plugin::

    [project.entry-points."policyworker.transports"]
    my_transport = "my_pkg.module:MyTransport"

Listing reads entry-point metadata only: it imports no transport. ``load(name)``
imports just that one and checks it is a :class:`~policyworker.transports.base.Transport`
subclass whose ``name`` matches.

Plugins are isolated from each other: a broken entry point makes only its own name
fail, with ``TransportLoadError`` naming the entry point and its distribution(s), and
never disables another name:

* an import error, a wrong type or a wrong ``name`` fails that name at ``load``;
* two third-party entry points claiming one name (two distributions, or one
  distribution registering it twice) with different targets: that name fails, naming
  every claimant; nobody's transport is picked by installation order;
* a third-party entry point claiming a built-in's name (``memory``, ``nccl_reshard``,
  ``zmq``, ``sglang_ipc``): the built-in wins and keeps working; the claim is
  reported (``problems()``, ``policyworker transports --load``), never loaded.

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

from policyworker.errors import ConfigError, TransportLoadError

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
    """One registered name. ``problem``: why it cannot load (a conflicting claim), if known
    without importing; for a built-in, a third-party claim on its name that was ignored."""

    name: str
    distribution: str
    target: str  # "module:attr"
    loaded: bool
    problem: str | None = None


def _dist_name(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "<unknown>"


def _claims(eps: list[md.EntryPoint]) -> str:
    return " and ".join(f"{ep.value} (from distribution {_dist_name(ep)})" for ep in eps)


def _distinct(eps: list[md.EntryPoint]) -> list[md.EntryPoint]:
    """Claims with distinct (distribution, target): one distribution seen twice on the path
    with the same entry point is one claim."""
    seen: set[tuple[str, str]] = set()
    out = []
    for ep in eps:
        key = (_dist_name(ep), ep.value)
        if key not in seen:
            seen.add(key)
            out.append(ep)
    return out


class TransportRegistry:
    """Name → entry point, resolved on first use; transports imported on ``load``."""

    def __init__(self, entry_points: Iterable[md.EntryPoint] | None = None, *, autoload: bool | None = None) -> None:
        self._given = None if entry_points is None else list(entry_points)
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("1", "true", "yes")
        self.autoload = autoload
        self._lock = threading.Lock()
        self._eps: dict[str, md.EntryPoint] | None = None
        #: Names that cannot load because of conflicting claims (the error ``load`` raises).
        self._conflicts: dict[str, TransportLoadError] = {}
        #: Third-party claims on built-in names, ignored (the built-in is kept).
        self._shadowed: dict[str, TransportLoadError] = {}
        self._claimants: dict[str, list[md.EntryPoint]] = {}
        self._loaded: dict[str, type] = {}

    def _entry_points(self) -> dict[str, md.EntryPoint]:
        with self._lock:
            if self._eps is not None:
                return self._eps
            found = self._given if self._given is not None else list(md.entry_points(group=ENTRY_POINT_GROUP))
            by_name: dict[str, list[md.EntryPoint]] = {}
            for ep in found:
                if not self.autoload and _dist_name(ep) != _OWN_DISTRIBUTION:
                    continue
                by_name.setdefault(ep.name, []).append(ep)
            eps: dict[str, md.EntryPoint] = {}
            for name, claims in by_name.items():
                claims = _distinct(claims)
                own = [ep for ep in claims if _dist_name(ep) == _OWN_DISTRIBUTION]
                others = [ep for ep in claims if _dist_name(ep) != _OWN_DISTRIBUTION]
                if own and others:
                    # A built-in name: the built-in wins; the third-party claim is reported, never loaded.
                    eps[name] = own[0]
                    self._shadowed[name] = TransportLoadError(
                        f"transport name {name!r} is a built-in of policyworker ({own[0].value}); the claim "
                        f"{_claims(others)} is ignored: rename that plugin's entry point",
                        entry_point=name, distribution=", ".join(sorted({_dist_name(ep) for ep in others})))
                elif len(claims) > 1:
                    eps[name] = claims[0]
                    self._claimants[name] = claims
                    self._conflicts[name] = TransportLoadError(
                        f"transport name {name!r} is registered more than once: {_claims(claims)}; it cannot "
                        f"load until one of them is renamed or uninstalled (other transports are unaffected)",
                        entry_point=name, distribution=", ".join(sorted({_dist_name(ep) for ep in claims})))
                else:
                    eps[name] = claims[0]
            self._eps = eps
            return eps

    def names(self) -> list[str]:
        return sorted(self._entry_points())

    def list(self) -> list[TransportInfo]:
        """Every registered name, without importing any (conflicting ones with their ``problem``)."""
        eps = self._entry_points()
        out = []
        for name, ep in sorted(eps.items()):
            conflict = self._conflicts.get(name)
            if conflict is not None:  # no claimant is "the" transport: show them all
                claims = self._claimants[name]
                out.append(TransportInfo(name, conflict.distribution or "", " | ".join(e.value for e in claims),
                                         False, str(conflict)))
                continue
            shadowed = self._shadowed.get(name)
            out.append(TransportInfo(name, _dist_name(ep), ep.value, name in self._loaded,
                                     None if shadowed is None else str(shadowed)))
        return out

    def problems(self) -> list[TransportLoadError]:
        """What is wrong with the installed plugins, known without importing any: names that
        cannot load (conflicting claims) and ignored claims on built-in names."""
        self._entry_points()
        return [err for _, err in sorted({**self._shadowed, **self._conflicts}.items())]

    def load(self, name: str) -> type:
        """Import and return the transport class registered as ``name``.

        ``TransportLoadError`` when this name's plugin is broken (and only then: other
        names are unaffected); ``ConfigError`` for a name nobody registered.
        """
        eps = self._entry_points()
        if name in self._loaded:
            return self._loaded[name]
        ep = eps.get(name)
        if ep is None:
            known = ", ".join(sorted(eps)) or "none"
            raise ConfigError(f"unknown transport {name!r}; registered: {known}", transport=name)
        conflict = self._conflicts.get(name)
        if conflict is not None:
            raise TransportLoadError(str(conflict), entry_point=conflict.entry_point,
                                     distribution=conflict.distribution)
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
        from policyworker.transports.base import Transport

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
