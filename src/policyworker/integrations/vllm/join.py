"""A vLLM rank's receiving worker on the generic road: join the groups, attach, refit.

Both vLLM backends (:mod:`.vllm`, :mod:`.vllm_lora`) receive through one
``RolloutWorker`` per vLLM rank and use only its public road:

* :func:`join` — ``init_collective`` (the update group), then each pipeline stage's
  reshard group (built here with :func:`~policyworker.runtime.comm.new_group`, the stage's
  trainers first), then this rank's note on the update group's store (what it loads).
  The groups are the ``groups=`` of the attachment; until it exists they are the
  caller's (:meth:`Joined.close`).
* :meth:`Joined.attach` — once per plan: ``attach_transport("nccl_reshard", plan=...,
  groups=..., connect=False)`` into destination tensors the caller holds; the worker
  checks them against the plan there, once. The connect runs inside the first refit's
  deadline, when the trainers' first refit connects too.
* each update: ``await worker.refit("nccl_reshard", refit_timeout_s=...)``, whose
  ``RefitReport`` carries the version and the kv-cache scales.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from policyworker.runtime._aio import run_in_executor
from policyworker.runtime.comm import CommGroup, new_group
from policyworker.errors import ConfigError, RefitTimeout, translate_comm_error

__all__ = ["Joined", "Loop", "join"]

TRANSPORT = "nccl_reshard"


class Loop:
    """A private asyncio loop on a daemon thread: vLLM's calls are synchronous, ours async.
    ``background``: the loop's thread (and all it starts) gives way to the engine's thread."""

    def __init__(self, background: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self._background = background
        self._thread = threading.Thread(target=self._run, name="policyworker-vllm-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._background:
            # Every thread of the receive starts from this one (executors, gloo's socket
            # threads) and inherits it: they give way to the engine's thread.
            from policyworker.integrations.vllm.overlap import give_way

            give_way()
        self.loop.run_forever()

    def call(self, coro: Any, timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            if not future.cancel() and future.done():
                return future.result()  # it finished just as the wait ran out
            raise RefitTimeout(f"a policyworker call inside vLLM did not return within {timeout_s:g} s") from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)


@dataclass
class Joined:
    """A vLLM rank's worker, its stage groups, and whether the transport is attached."""

    worker: Any
    groups: dict[int, CommGroup]
    options: dict[str, Any] = field(default_factory=dict)
    plan: Any = None

    async def attach(self, plan: Any, params: Mapping[str, torch.Tensor]) -> None:
        """Attach ``nccl_reshard`` with ``plan`` landing in ``params`` (checked against the plan now)."""
        self.worker.params = dict(params)
        await self.worker.attach_transport(TRANSPORT, connect=False, plan=plan, groups=dict(self.groups),
                                           **self.options)
        self.plan = plan

    def land_in(self, params: Mapping[str, torch.Tensor], landing: Any = None) -> None:
        """Land the next refit in ``params``: tensors of the same names, shapes and dtypes as
        those checked at :meth:`attach` (the staging set that nothing live references).
        ``landing``: what makes the ``meta`` ones on demand (``TransportContext.landing``)."""
        self.worker.params = dict(params)
        self.worker.landing = landing

    async def refit(self, refit_timeout_s: float | None) -> Any:
        """One refit over the attachment; its ``RefitReport``."""
        if self.plan is None:
            raise ConfigError("attach the trainers' plan before a refit", rank=self.worker.rank)
        return await self.worker.refit(TRANSPORT, refit_timeout_s=refit_timeout_s)

    def close(self) -> None:
        """Close the stage groups (idempotent; the worker's shutdown closes them as well once attached)."""
        for group in self.groups.values():
            group.close()


def _store_set(store: Any, key: str, value: bytes, rank: int) -> None:
    try:
        store.set(key, value)
    except Exception as exc:  # the store raises DistStoreError/RuntimeError when its host is gone
        raise translate_comm_error(exc, rank=rank, what=f"publishing {key}") from exc


async def join(init_info: Any, *, rank: int, gen_world_size: int, device: Any, key: str, note: bytes) -> Joined:
    """Build generation rank ``rank``'s worker, join the update group and every stage's group,
    and publish ``note`` under ``key`` on the update group's store.

    ``init_info``: a ``PolicyworkerInitInfo``. Every wait is bounded by its ``timeout_s``
    (trainers that never come make this raise); on failure nothing is left open.
    """
    from policyworker.workers.rollout import RolloutWorker

    for n in init_info.trainers_per_stage:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"init_info.trainers_per_stage entries must be ints >= 1, got {n!r}")
    reserved = sorted({"plan", "groups", "group", "stage", "connect"} & set(init_info.reshard_options))
    if reserved:
        raise ConfigError(f"init_info.reshard_options may not set {reserved}: the backend sets them")
    n_train = sum(init_info.trainers_per_stage)
    worker = RolloutWorker(rank=rank, gen_world_size=gen_world_size, device=device, timeout_s=init_info.timeout_s)
    joined = Joined(worker, {}, dict(init_info.reshard_options))
    try:
        await worker.init_collective(init_info.host, init_info.update_port, n_train + gen_world_size,
                                     train_world_size=n_train)
        hosts = init_info.stage_hosts or [init_info.host] * len(init_info.stage_ports)
        for stage, (host, port, trainers) in enumerate(zip(hosts, init_info.stage_ports,
                                                             init_info.trainers_per_stage)):
            joined.groups[stage] = await run_in_executor(
                None, new_group, host=host, port=port, rank=trainers + rank, world_size=trainers + gen_world_size,
                name=f"reshard_pp{stage}", timeout_s=init_info.timeout_s, device=worker.device)
        await run_in_executor(None, _store_set, worker.model_update_group.store, key, note, rank)
    except BaseException:
        joined.close()
        await worker.shutdown()
        raise
    return joined
