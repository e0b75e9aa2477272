"""The worker's surroundings: its groups, its control endpoint, its shutdown.

:class:`WorkerLifecycle` is the base of :class:`~policyworker.workers.core.WorkerCore`
(which sets up the attributes used here: the executor, the attachments and transport
states, the update group). What it guards: a group is never closed while the refit
executor may be inside it — abort first, let the executor leave (bounded, shielded
from cancellation: :func:`drain`), close only then; a group the executor did not leave
in time stays aborted and is never closed under it. A new update group (recovery) is
a new refit world: every attachment connects again.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from policyworker.runtime._aio import run_in_executor
from policyworker.runtime.comm import CommGroup, new_group, share_token

__all__ = ["WorkerLifecycle", "drain", "groups_in"]


class WorkerLifecycle:
    """Groups, control endpoint and shutdown of a worker (see the module docstring)."""

    # -- groups ----------------------------------------------------------------------
    async def _new_update_group(self, ip: str, port: int, world_size: int, group_rank: int) -> None:
        """Replace the update group (recovery). Every group belongs to the old world: abort
        them (a refit blocked in one returns), let the executor leave (bounded), close the
        old update group only then, and build the new one. The transport groups are closed
        when their transport reconnects (it replaces them) or at shutdown."""
        old = self.model_update_group
        for group in self._groups():
            group.abort()
        drained = await drain(self._executor, self.timeout_s)
        self.model_update_group = None
        for att in self._attachments.values():
            att.connected = False
        if old is not None and drained:
            old.close()
        elif old is not None:  # the executor is still inside it: leave it aborted, never close under it
            self._leaked.append(old)
        group = await self._run(new_group, host=ip, port=port, rank=group_rank, world_size=world_size,
                                name="model_update", timeout_s=self.timeout_s, device=self.device)
        self._set_update_group(group)
        self.control_token = await self._run(share_token, group)

    async def _retire_groups(self, state: dict[str, Any], keys: tuple[str, ...]) -> None:
        """Abort the groups under ``keys``, let the executor leave them (bounded), close them."""
        old = []
        for key in keys:
            value = state.pop(key, None)
            items = value.values() if isinstance(value, Mapping) else (value,)
            old += [g for g in items if isinstance(g, CommGroup) and g not in old]
        if not old:
            return
        for group in old:
            group.abort()
        if await drain(self._executor, self.timeout_s):
            for group in old:
                group.close()
        else:  # the executor is still inside one: aborted, never closed under it
            self._leaked += old

    def _replace_group(self, attr: str, group: CommGroup | None) -> None:
        old = getattr(self, attr, None)
        setattr(self, attr, group)
        if old is not None and old is not group:
            old.close()

    def _set_update_group(self, group: CommGroup | None) -> None:
        """A new update group is a new refit world: every attachment connects again."""
        self._replace_group("model_update_group", group)
        for att in self._attachments.values():
            att.connected = False

    # -- control endpoint ------------------------------------------------------------
    def start_control_endpoint(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve status and stand-down requests over TCP for holders of the group token.

        Returns the ``tcp://host:port`` address (port 0: a free one). Idempotent: a
        running endpoint's address is returned. Needs ``init_collective`` first.
        """
        self._ensure_open()
        if self._control is None:
            from policyworker.runtime.control import ControlServer

            self._control = ControlServer(self, host=host, port=port)
        return self._control.address

    # -- lifecycle -------------------------------------------------------------------
    def _groups(self) -> list[CommGroup]:
        """Every group this worker is in: the update group and those in transport states."""
        found = [self.model_update_group] if self.model_update_group is not None else []
        for state in list(self._transport_state.values()):
            found += [g for g in groups_in(state) if g not in found]
        return found

    def _close_resources(self) -> None:
        """Subclasses release their own resources here (runs once, on shutdown)."""

    async def shutdown(self) -> bool:
        """Abort groups and transports, let the executor leave, then close everything.

        Safe to call twice. Order matters: a group is never closed while the executor
        thread may be inside it — abort first (a blocked refit returns), wait for the
        executor (bounded by ``timeout_s``), then close transports, groups, sockets.
        When the executor does not leave in time (a backend call no abort reaches), the
        wait still ends: nothing it may be inside is closed (groups stay aborted),
        ``shutdown_clean`` is False, and the process should exit soon.
        """
        if self._closed:
            return True
        self._closed = True
        for group in self._groups():
            group.abort()
        for att in list(self._attachments.values()):
            att.transport.abort()
        drained = await drain(self._executor, self.timeout_s)
        self.shutdown_clean = drained
        if drained:
            await run_in_executor(None, self._executor.shutdown, True)  # idle now: returns at once
        else:
            # Bounded: the executor thread is stuck in a backend call no abort reaches. Drop
            # queued work, do not wait, and close nothing it may be inside (groups stay aborted).
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._leaked += self._groups()
        if drained:
            for name in list(self._attachments):
                await self.detach_transport(name)
            for state in list(self._transport_state.values()):
                for group in groups_in(state):
                    group.close()
            self._close_resources()
            for close in reversed(self._closers):
                close()
            self._replace_group("model_update_group", None)
        else:  # transports, sockets and groups may be in use by the stuck thread: only forget them
            self._attachments.clear()
            self.model_update_group = None
        self._closers.clear()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._profiler is not None:
            self.stop_gpu_profiling()
        return True


def groups_in(state: Mapping[str, Any]) -> list[CommGroup]:
    """CommGroups kept in a transport state dict (values, or values of dict values)."""
    out: list[CommGroup] = []
    for value in list(state.values()):
        items = value.values() if isinstance(value, Mapping) else (value,)
        for item in items:
            if isinstance(item, CommGroup) and item not in out:
                out.append(item)
    return out


def _wait_idle(executor: ThreadPoolExecutor, timeout_s: float) -> bool:
    try:
        executor.submit(lambda: None).result(timeout=timeout_s)
    except (concurrent.futures.TimeoutError, RuntimeError):  # RuntimeError: executor already shut down
        return False
    return True


async def drain(executor: ThreadPoolExecutor, timeout_s: float) -> bool:
    """Wait (shielded from cancellation, at most ``timeout_s``) until the executor is idle."""
    import asyncio

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # another anyio backend (trio)
        loop = None
    if loop is not None:
        fut = loop.run_in_executor(None, _wait_idle, executor, timeout_s)
        while True:
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                if fut.done():
                    return fut.result()
                continue  # a second cancel while draining: keep waiting (bounded by timeout_s)
    import anyio
    import anyio.to_thread

    with anyio.CancelScope(shield=True):
        return await anyio.to_thread.run_sync(_wait_idle, executor, timeout_s)
