"""What the drill's scenario runners share: a failed refit as a row, and collecting a
world while its fault plays out (resume a stopped victim, replace a dead one)."""

from __future__ import annotations

import asyncio
import queue
import signal
import time
from typing import Any

__all__ = ["collect_with_replacement", "failure_row", "join_groups"]


def failure_row(exc: BaseException, *, version: int, t0: float, w: Any, trainer: bool, out: dict,
                expected: Any) -> dict[str, Any]:
    """One failed refit as a drill row; on a rollout also what it serves now (torn? mixed?)."""
    import torch

    from policyworker.errors import PolicyWorkerError

    kind = "Cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__
    row: dict[str, Any] = {"version": version, "error": kind, "detect_seconds": time.monotonic() - t0}
    if not trainer:
        row["torn"] = w.torn
        try:
            have = w.weights()
        except PolicyWorkerError:
            row["serves"] = False
        else:
            row["serves"] = True
            out["served_torn"] |= w.torn
            if w.weight_version:
                want = expected(w.weight_version)
                out["mixed"] |= not all(torch.equal(have[k], want[k]) for k in want)
    return row


def collect_with_replacement(world: Any, sc: Any, events: Any, timeout_s: float, *,
                             resume_on: dict[str, set[str]], replace: Any) -> dict[int, dict]:
    """Collect a scenario's world while playing its fault's second half.

    A stopped victim (faults named in ``resume_on``) gets SIGCONT once any rank reports
    one of those events; a killed one (``kill_mid``, ``kill_between``) is replaced by
    ``replace()`` (a one-rank world) as soon as it is seen dead, and the replacement's
    result stands in for the victim's. Every wait is bounded by ``timeout_s``.
    """
    dies = sc.fault in ("kill_mid", "kill_between", "sigint")
    resume = resume_on.get(sc.fault, set())
    replacement = None

    def tick() -> None:
        nonlocal replacement
        while True:
            try:
                kind, _rank = events.get_nowait()
            except queue.Empty:
                break
            if kind in resume:
                world.signal(sc.victim, signal.SIGCONT)
        if dies and replacement is None and not world.procs[sc.victim].is_alive():
            replacement = replace()

    t0 = time.monotonic()
    results = world.collect(timeout_s, allow_dead=[sc.victim] if dies else [], on_tick=tick)
    if replacement is not None:
        results[sc.victim] = replacement.collect(max(10.0, timeout_s - (time.monotonic() - t0)))[0]
        results[sc.victim]["victim_exitcode"] = world.procs[sc.victim].exitcode
    return results


async def join_groups(w: Any, ports: dict[str, int], *, trainer: bool, rank: int, n_train: int, n_gen: int) -> None:
    """Join one epoch's update group and its one pipeline stage's group (the drill's
    nccl_reshard worlds have a single stage): ``ports`` holds that epoch's "update" and
    "stage" ports; ``rank`` is the process's rank (trainers first)."""
    await w.init_collective("127.0.0.1", ports["update"], n_train + n_gen, train_world_size=n_train)
    if trainer:
        await w.init_nccl_reshard_comm_group(["127.0.0.1"], [ports["stage"]], 1, 0, n_train + n_gen, rank)
    else:
        await w.init_nccl_reshard_comm_groups(["127.0.0.1"], [ports["stage"]], [n_train])
