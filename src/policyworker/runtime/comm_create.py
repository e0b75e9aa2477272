"""Building groups: a store, a rendezvous, the backend, a warm-up that proves every rank agrees.

Rank 0 of a group hosts its store at ``(host, port)``; every other rank connects to it.
:func:`new_group` builds a group over a fresh ``TCPStore``; :func:`group_on_store` over
a store the caller already shares (under a prefix of its own). Both are bounded by
``timeout_s`` and raise typed errors (``ConfigError``, ``PeerLost``, ``RefitTimeout``).
"""

from __future__ import annotations

import datetime as _dt
import os
import secrets
import threading
import time

import torch
import torch.distributed as dist

from policyworker.config import positive_seconds
from policyworker.errors import ConfigError, PeerLost, RefitTimeout, translate_comm_error
from policyworker.runtime.comm_group import CommGroup
from policyworker.runtime.comm_setup import _first_line, _quiet_cpp_stderr, _rendezvous, nccl_device

__all__ = ["DEFAULT_TIMEOUT_S", "backend_for", "group_on_store", "new_group", "share_token"]

DEFAULT_TIMEOUT_S = 120.0


def _check_rank(rank: int, world_size: int) -> None:
    for value, name in ((rank, "rank"), (world_size, "world_size")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside [0, {world_size})")


def backend_for(device: torch.device | int | str | None) -> str:
    """The backend of a worker's groups: nccl on a CUDA device, gloo on the CPU."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if isinstance(device, int) and not isinstance(device, bool):
        return "nccl"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"not a device: {device!r}") from exc
    return "nccl" if kind == "cuda" else "gloo"


def new_group(
    *,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    name: str,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    verify: bool = True,
    device: torch.device | int | str | None = None,
) -> CommGroup:
    """Build an independent group; rank 0 hosts the store at ``(host, port)``.

    ``device``: the worker's own device (pass it: an NCCL group then lives on that GPU,
    never on whichever device is current on the calling thread). ``backend`` defaults
    to :func:`backend_for` ``(device)``: nccl for a CUDA device, gloo for a CPU one, and
    without a device nccl when CUDA is available, else gloo. With ``verify`` a
    warm-up runs: rank 0 broadcasts (magic, world_size, nonce); every rank checks the
    world size matches its own and all-reduces its verdict, so every rank knows every
    rank agreed. Raises ``ConfigError`` (bad arguments, port in use, disagreement) or
    ``PeerLost`` / ``RefitTimeout`` (a peer never came) — never hangs past ``timeout_s``.
    """
    _check_rank(rank, world_size)
    timeout_s = positive_seconds(timeout_s, "timeout_s", optional=False)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"port must be an int in (0, 65536), got {port!r}")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"host must be a non-empty string, got {host!r}")
    if backend is None:
        backend = backend_for(device)
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = _dt.timedelta(seconds=timeout_s)
    is_master = rank == 0
    try:
        with _quiet_cpp_stderr():
            store = dist.TCPStore(
                host, port, world_size, is_master, timeout=timeout, wait_for_workers=False
            )
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError with errno text
        text = _first_line(exc)
        if is_master and ("in use" in text or "EADDRINUSE" in text or "errno: 98" in text):
            raise ConfigError(f"port {port} on {host} is already in use (group {name!r})", rank=rank) from None
        cls = RefitTimeout if any(m in text for m in ("timed out", "Timeout", "timeout")) else PeerLost
        raise cls(f"rank {rank} of group {name!r} could not reach its store at {host}:{port} within "
                  f"{timeout_s:g} s: rank 0 (the store's host) is missing ({text})", rank=rank) from None
    prefixed = dist.PrefixStore(f"policyworker/{name}", store)
    return group_on_store(prefixed, rank=rank, world_size=world_size, name=name, backend=backend,
                          timeout_s=timeout_s, owner_store=store, verify=verify, device=device)


def group_on_store(
    store: dist.Store,
    *,
    rank: int,
    world_size: int,
    name: str,
    backend: str,
    timeout_s: float,
    owner_store: dist.TCPStore | None = None,
    verify: bool = True,
    transport: str | None = None,
    device: torch.device | int | str | None = None,
) -> CommGroup:
    """A group whose ranks meet on ``store`` (already prefixed for it), warmed up if ``verify``.

    ``new_group`` uses it over a fresh TCPStore; callers that already share a store
    (e.g. the update group's, under a prefix of their own) use it directly.
    """
    timeout = _dt.timedelta(seconds=timeout_s)
    _rendezvous(store, rank=rank, world_size=world_size, name=name, timeout_s=timeout_s, transport=transport)
    try:
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            pg = _nccl_backend(store, rank, world_size, nccl_device(device), timeout_s)
    except Exception as exc:  # torch raises RuntimeError / DistError with backend text
        raise translate_comm_error(exc, rank=rank, transport=transport, what=f"creating group {name!r}") from exc
    group = CommGroup(pg, store, rank=rank, world_size=world_size, backend=backend, name=name,
                      timeout_s=timeout_s, owner_store=owner_store,
                      device=nccl_device(device) if backend == "nccl" else None)
    if verify:
        try:
            _warm_up(group, deadline=time.monotonic() + timeout_s)
        except BaseException:
            group.close()
            raise
    return group


_ENV_LOCK = threading.Lock()


def _nccl_backend(store: dist.Store, rank: int, world_size: int, dev: torch.device, timeout_s: float):
    """A ProcessGroupNCCL bound to ``dev`` whose communicator exists before this returns.

    ``eager_connect_single_device(dev)`` is what ``init_process_group(device_id=dev)``
    does: the group's one communicator is created here, on our device, and every
    point-to-point op (batched, see :meth:`CommGroup.batch_isend_irecv`) runs on it.

    A stuck op is ours to end (deadline → ``abort()`` → ``RefitTimeout``). NCCL reads
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` once per group, at construction: ours is built
    with 2 (CleanUpOnly: its watchdog may abort the communicator, never the process),
    whatever the process's setting, which is restored at once for the user's own
    groups. NCCL's own timeout lies past every deadline of ours.
    """
    torch.cuda.set_device(dev)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _dt.timedelta(seconds=2 * timeout_s + 60)
    with _ENV_LOCK:
        before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        try:
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            if before is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before
    pg.eager_connect_single_device(dev)
    return pg


_MAGIC = 0x50574B31  # "PWK1"


def _warm_up(group: CommGroup, *, deadline: float) -> None:
    """Broadcast from rank 0, check on every rank, all-reduce the verdicts."""
    dev = group.device
    if group.rank == 0:
        hello = torch.tensor([_MAGIC, group.world_size, secrets.randbits(62)], dtype=torch.int64, device=dev)
    else:
        hello = torch.zeros(3, dtype=torch.int64, device=dev)
    group.broadcast(hello, 0, deadline=deadline)
    magic, size, _nonce = (int(v) for v in hello.tolist())
    ok = magic == _MAGIC and size == group.world_size
    verdict = torch.tensor([0 if ok else 1], dtype=torch.int64, device=dev)
    group.all_reduce(verdict, deadline=deadline)
    bad = int(verdict.item())
    if not ok:
        raise ConfigError(
            f"group {group.name!r}: rank 0 says world_size={size}, this rank says {group.world_size}",
            rank=group.rank,
        )
    if bad:
        raise ConfigError(
            f"group {group.name!r}: {bad} rank(s) disagree on the world size", rank=group.rank
        )


def share_token(group: CommGroup) -> str:
    """A fresh secret, made by rank 0 and read by every rank through the group's store.

    Called right after the group formed (every rank), so each ``init_collective``
    yields a new token. Store reads are bounded by the store's timeout.
    """
    if group.rank == 0:
        token = secrets.token_hex(16)
        group.store.set("control_token", token)
        return token
    try:
        return group.store.get("control_token").decode()
    except Exception as exc:  # the store raises DistStoreError/RuntimeError on timeouts
        raise translate_comm_error(exc, rank=group.rank, what="reading the group token") from exc
