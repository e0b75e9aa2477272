"""Delta mode (``delta=True``): a version on disk holds only what changed since the one before.

Writer. It keeps a *shadow*: a copy of every tensor as it last published it (its
memory is ``RefitReport.shadow_bytes``). Version ``v`` is written as a delta over
``v - 1`` — per tensor, the changed units encoded by :mod:`policyworker.layout.delta`
and the checksum of the bytes a reader must end with — unless a full version is
needed: no shadow (the writer's first version, or its last write failed), the newest
version on disk is not the shadow's, a rollout asked for one (``want-full-*``), the
trainer asked (``refit(..., delta=False)``), ``delta_full_every`` versions passed,
the deltas since the last full version add up to ``delta_chain_fraction`` of a full
version's bytes, or more than ``delta_max_fraction`` of the elements changed (an
estimate on every 127th). Pruning keeps the newest full version and every delta
after it, besides the newest ``keep``.

Reader. To land the newest version ``T`` it builds a *chain*: walking back from ``T``
along the deltas' bases until it reaches the version it holds (committed by its
ledger, not torn, last landed by this transport) or a full version. Every version of
the chain is mapped and verified (manifest, file checksums, blob layout) before a
byte changes; then the full version (if the chain starts at one) is copied and the
deltas applied in order, and the result is checked tensor by tensor against ``T``'s
checksums. So a rollout at ``T - 1`` reads one small delta, a lagging one a few, and a
new or torn one the newest full version and the deltas after it (at most
``delta_full_every - 1`` and ``delta_chain_fraction`` of a full version's bytes).
A chain that cannot be built (a base gone), a corrupt file or a checksum mismatch is a
``ProtocolError``; the rollout then drops a ``want-full-*`` request, so the writer's
next version is full. A mismatch found after the apply leaves the rollout torn (its
live bytes changed); anything found before leaves it untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from policyworker.errors import ProtocolError
from policyworker.layout import delta as _delta

from . import dirs
from .manifest import Manifest
from .reader import OpenVersion, open_version, units
from .writer import write_delta_version, write_version

__all__ = ["DeltaPolicy", "check_result", "held_base", "open_chain", "protect_from", "publish", "received",
           "request_full"]

_log = logging.getLogger(__name__)
_SAMPLE = 127  # every 127th unit estimates the changed fraction


@dataclass(frozen=True, slots=True)
class DeltaPolicy:
    """When the writer publishes a full version anyway (module docstring)."""

    max_fraction: float = 0.25
    full_every: int | None = None
    chain_fraction: float = 1.0


@dataclass(slots=True)
class _Shadow:
    version: int | None = None  # the version the tensors hold, once it committed
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # flat unit views of the copies
    last_full: int | None = None
    full_bytes: int = 0
    chain_bytes: int = 0  # delta bytes written since last_full

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(slots=True)
class _Held:
    landed: int | None = None  # the version this transport's last good receive landed


# -- writer ----------------------------------------------------------------------------------
def _why_full(ctx: Any, sh: _Shadow, base: int | None, policy: DeltaPolicy, version: int,
              requests: list[str], newest: int | None, params: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``version`` must be full (None: a delta over ``base``)."""
    if ctx.option("delta") is False:
        return "the trainer asked for a full version"
    if base is None or set(sh.tensors) != set(params) or sh.last_full is None:
        return "no shadow of the last version (the writer's first, or its last write failed)"
    if newest != base:
        return f"the newest version on disk is {newest}, not this writer's last ({base})"
    if requests:
        return f"{len(requests)} rollout request(s) for a full version"
    if policy.full_every is not None and version - sh.last_full >= policy.full_every:
        return f"a full version is due (delta_full_every={policy.full_every})"
    if sh.chain_bytes >= policy.chain_fraction * sh.full_bytes:
        return f"the deltas since version {sh.last_full} reached delta_chain_fraction of a full version"
    changed = seen = 0
    for name, t in params.items():
        c, n = _delta.changed_fraction(units(t), sh.tensors[name], _SAMPLE)
        changed, seen = changed + c, seen + n
    if changed > policy.max_fraction * max(seen, 1):
        return f"~{changed / max(seen, 1):.1%} of the elements changed (over delta_max_fraction)"
    return None


def publish(directory: str, setup: Any, ctx: Any, version: int, stop: Callable[[], None]) -> tuple[Manifest, str, int]:
    """Write and commit ``version`` in delta mode (blocking); returns (manifest, note, shadow bytes)."""
    sh = ctx.state.setdefault("delta_shadow", _Shadow())
    base, sh.version = sh.version, None  # unknown until this version commits
    requests = dirs.full_requests(directory)
    versions = dirs.committed_versions(directory)
    params = {n: t.detach().contiguous() for n, t in ctx.params.items()}
    policy = DeltaPolicy(setup.delta_max_fraction, setup.delta_full_every, setup.delta_chain_fraction)
    why = _why_full(ctx, sh, base, policy, version, requests, versions[-1] if versions else None, params)
    common = dict(rank=ctx.rank, checksum=setup.checksum, file_bytes=setup.file_bytes, fsync=setup.fsync,
                  stop=stop, session=ctx.state.get("session", ""))
    if why is None:
        def encoded():
            for name in sorted(params):
                t = params[name]
                # update_old: the shadow becomes this version as it is encoded
                yield name, t, _delta.encode(units(t), sh.tensors[name], update_old=True, with_checksum=True)

        manifest = write_delta_version(directory, version, base, encoded(), **common)
        sh.chain_bytes += manifest.file_bytes
        note = f"delta over version {base}: {manifest.file_bytes} bytes written for {manifest.nbytes}"
    else:
        with torch.no_grad():
            for name, t in params.items():
                old = sh.tensors.get(name)
                if old is None or old.numel() != t.numel() or old.dtype != units(t).dtype or old.device != t.device:
                    old = sh.tensors[name] = torch.empty_like(units(t))
                old.copy_(units(t))
        for name in set(sh.tensors) - set(params):
            del sh.tensors[name]
        manifest = write_version(directory, version, params, **common)
        sh.last_full, sh.full_bytes, sh.chain_bytes = version, manifest.file_bytes, 0
        dirs.clear_requests(directory, requests)
        note = f"full: {why}"
    sh.version = version
    return manifest, note, sh.nbytes


def protect_from(state: dict[str, Any]) -> int | None:
    """The oldest version pruning must keep in delta mode (the newest full one)."""
    sh = state.get("delta_shadow")
    return sh.last_full if sh is not None else None


# -- reader ----------------------------------------------------------------------------------
def held_base(ctx: Any) -> int | None:
    """The version this rollout holds for a delta to apply to: the one this transport
    last landed, if its ledger committed it and it is not torn; else None."""
    held = ctx.state.setdefault("delta_held", _Held())
    ledger = getattr(ctx.worker, "ledger", None)
    if held.landed is None or (ledger is not None and (ledger.version != held.landed or ledger.torn)):
        return None
    return held.landed


def received(ctx: Any, version: int | None) -> None:
    """Record what the last receive landed (None: it failed)."""
    ctx.state.setdefault("delta_held", _Held()).landed = version


def open_chain(directory: str, target: OpenVersion, listed: list[int], mine: int | None) -> list[OpenVersion]:
    """``[start, ..., target]``, opened (see the module docstring). ``FileNotFoundError``
    when a version was pruned meanwhile (list again); ``ProtocolError`` when a base is
    not on disk. Closes what it opened when it raises; ``target`` stays the caller's."""
    chain = [target]
    try:
        while chain[-1].is_delta and chain[-1].manifest.base != mine:
            base = chain[-1].manifest.base
            if base not in listed:
                raise ProtocolError(f"version {chain[-1].version} is a delta over version {base}, which is not on "
                                    f"disk, and this rollout holds {mine if mine is not None else 'no version'}",
                                    transport="files")
            chain.append(open_version(directory, base))
    except BaseException:
        for opened in chain[1:]:
            opened.close()
        raise
    chain.reverse()
    return chain


def check_result(target: OpenVersion, dests: Mapping[str, torch.Tensor], stop: Callable[[], None]) -> None:
    """``ProtocolError`` unless every destination's bytes have ``target``'s checksum."""
    for t in target.manifest.tensors:
        stop()
        dst = dests[t.name]
        got = _delta.checksum(units(dst if dst.is_contiguous() else dst.contiguous()))
        if got != t.checksum:
            raise ProtocolError(f"version {target.version}: {t.name!r} after the delta is not the trainer's "
                                f"(checksum {got:016x}, want {t.checksum:016x})", transport="files", param=t.name)


def request_full(directory: str, why: str) -> None:
    """Ask the writer for a full version; a directory we cannot write to is logged, not raised."""
    try:
        name = dirs.request_full(directory, why)
    except OSError as exc:
        _log.warning("files transport: could not ask for a full version in %s: %s", directory, exc)
        return
    _log.info("files transport: asked the writer for a full version (%s): %s", name, why)
