"""Stale refit attempts of nccl_reshard: recorded in the groups' stores, refused later.

A message posted by an attempt that then failed (a deadline, an
abort, a lost peer) stays posted in the backend: a gloo send the peer never received
is matched by that peer's *next* receive of the same (peer, tag), and its bytes would
land in live weights as if they were the next refit's. Nothing in the bytes tells
them apart, so the groups carry the fact instead: the failed attempt counts itself
in each of its groups' stores and aborts its groups; every later connect or refit on
those groups — on any rank, whatever it saw itself — reads the counts before it
posts anything and refuses (RefitAborted, untouched) unless they are all zero. The
recovery is the usual one: every side rebuilds its groups (new groups count from 0).
A refit that failed cleanly (every rank reached the verdict) leaves nothing posted."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from policyworker.errors import RefitAborted, RefitTimeout, translate_comm_error

__all__ = ["check_fresh", "spoil", "spoiled_counts", "store_add"]

_log = logging.getLogger(__name__)

#: Per group, in the group's store: how many refit attempts on it ended with messages
#: still posted (a timeout, an abort, a lost peer). See ``spoil`` / ``check_fresh``.
_SPOILED_KEY = "nccl_reshard/spoiled_attempts"
#: How long recording a failed attempt may wait for its group's store.
_SPOIL_WRITE_S = 2.0
#: How long reading the counts may wait for a store when the refit has no deadline.
_SPOIL_READ_S = 30.0


def store_add(store: Any, value: int, timeout_s: float) -> int:
    """``store.add(_SPOILED_KEY, value)`` that returns within ``timeout_s``.

    A store's host may be a stopped process (SIGSTOP, a debugger, swapped out): its TCP
    connection stays open and c10d's ``add`` then waits with no timeout of its own
    (``set_timeout`` bounds ``get``/``wait`` only). The call runs on a daemon thread; past
    ``timeout_s`` it raises ``TimeoutError`` and the thread is left to finish (or die
    with the process) — it holds nothing of ours but the store.
    """
    try:
        return _store_adds([store], value, timeout_s)[0]
    except _StoreFailed as failed:
        raise failed.error from None


def _store_adds(stores: list, value: int, timeout_s: float) -> list[int]:
    """``store_add`` on each of ``stores``, one after the other on one daemon thread (one
    thread a refit, not one a group), all within ``timeout_s``. The first error raises
    (``TimeoutError`` when time ran out), as ``(index of its store, error)`` in ``args``
    of a ``_StoreFailed``."""
    box: list = []
    done = threading.Event()

    def call() -> None:
        try:
            for i, store in enumerate(stores):
                try:
                    box.append(int(store.add(_SPOILED_KEY, value)))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    box.append(_StoreFailed(i, exc))
                    return
        finally:
            done.set()

    threading.Thread(target=call, name="pw-store-add", daemon=True).start()
    if not done.wait(max(timeout_s, 0.0)):
        raise _StoreFailed(len(box), TimeoutError(
            f"the group's store did not answer in {timeout_s:.1f} s (its host is stopped or gone)"))
    if box and isinstance(box[-1], _StoreFailed):
        raise box[-1]
    return box


class _StoreFailed(Exception):
    """A store call of ``_store_adds`` failed: ``index`` of its store and the ``error``."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(index, error)
        self.index, self.error = index, error


def spoiled_counts(groups: list, rank: int, deadline: float | None = None) -> list[int]:
    """Each group's spoiled-attempt count, read from its store (``add(key, 0)`` reads
    atomically), every read bounded by ``deadline`` (``time.monotonic()``)."""
    left = (deadline - time.monotonic()) if deadline is not None else _SPOIL_READ_S
    try:
        return _store_adds([g.store for g in groups], 0, left)
    except _StoreFailed as failed:
        name, exc = groups[failed.index].name, failed.error
        if isinstance(exc, TimeoutError):
            raise RefitTimeout(f"reading the refit attempts of group {name!r}: {exc}", rank=rank,
                               transport="nccl_reshard") from exc
        # the store raises DistStoreError/RuntimeError when its host is gone
        raise translate_comm_error(exc, rank=rank, transport="nccl_reshard",
                                   what="reading the groups' refit attempts") from exc


def spoil(groups: list, rank: int) -> None:
    """An attempt failed with messages possibly still posted on ``groups``: count it there
    and abort them. (A group aborted before the attempt began got nothing posted: the
    group refuses every operation once aborted.)"""
    for group in groups:
        group.abort()
    end = time.monotonic() + _SPOIL_WRITE_S  # one bound for all of them
    for group in groups:
        try:
            # Bounded: the store's host may be the very peer that stalled (a stopped
            # trainer hosts its group's store); its peers then learn of the failure
            # as a lost or timed-out peer, and a rebuild replaces the group anyway.
            store_add(group.store, 1, end - time.monotonic())
        except Exception as exc:  # the store's host is gone: its peers learn that as a lost peer
            _log.warning("nccl_reshard rank %s: could not record a failed attempt on group %r: %s",
                         rank, group.name, exc)


def check_fresh(groups: list, rank: int, deadline: float | None) -> None:
    """Refuse (``RefitAborted``) to post anything on groups where an attempt failed with
    messages in flight."""
    counts = spoiled_counts(groups, rank, deadline)
    if any(counts):
        names = [g.name for g, n in zip(groups, counts) if n]
        raise RefitAborted(
            f"a refit attempt on group(s) {names} failed (on this rank or a peer) "
            f"with messages still in flight; rebuild the groups on every side (init_collective, then the "
            f"stage groups) before the next refit", rank=rank, transport="nccl_reshard")
