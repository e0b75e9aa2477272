"""The failure matrix's processes: long-lived, one world per transport, driven by cells.

``serve`` is one process: it takes cells from its command queue and runs its side(s) of
each with fresh workers (processes are shared across cells, workers are not), then
answers on the result queue. A cell that kills or interrupts a process ends that
process; the parent starts a replacement that joins the cell where the victim left it.

One side of one cell (``run_side``)::

    open (epoch 0) -> refit v1 (commits) -> for each step: [sync] fault step [sync] recovery
    -> refit v2 (must commit bit-exact) -> shutdown

A step records what the side saw (error class, seconds, whether a live byte changed
against a snapshot taken just before it, torn, version, whether it serves).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import anyio
import torch

from policyworker import PolicyWorkerError
from policyworker.testing import faults

from .matrix_cells import (DEADLINE_S, STAND_DOWN_AT_S, STAND_DOWN_DEADLINE_S, SIGINT_EXIT)
from .matrix_sides import SIDES, side_names

FINAL_DEADLINE_S = 60.0
SYNC_S = 300.0
#: The record of an interrupted side, posted by the process before it exits.
_PARTIAL: dict[str, Any] = {}


def _bytes_changed(before: dict[str, torch.Tensor], now: dict[str, torch.Tensor]) -> bool:
    return set(before) != set(now) or any(not torch.equal(before[k], now[k]) for k in before)


def _servable(side) -> bool:
    try:
        for r in side.rollouts():
            r.weights()
    except PolicyWorkerError:
        return False
    return True


class _Canceller:
    """Cancels the current refit from any thread, the way the cell's backend does it."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.at: float | None = None
        self.scope: anyio.CancelScope | None = None
        self.task = None
        if how == "cancel_trio":
            import trio

            self._token = trio.lowlevel.current_trio_token()
        else:
            import asyncio

            self._loop = asyncio.get_running_loop()

    def __call__(self) -> None:
        self.at = time.monotonic()
        if self.how == "cancel_trio":
            self._token.run_sync_soon(self.scope.cancel)
        elif self.how == "cancel_anyio":
            self._loop.call_soon_threadsafe(self.scope.cancel)
        else:
            self._loop.call_soon_threadsafe(self.task.cancel)


async def _sync(barrier, label: str) -> None:
    await anyio.to_thread.run_sync(barrier.wait, SYNC_S)


async def _step(side, step: dict, cell: dict, k: int) -> dict[str, Any]:
    """This side's part of one fault step; returns its record."""
    fault, victim = step["fault"], step["victim"]
    me = side.name
    rec: dict[str, Any] = {"side": me, "fault": fault}
    is_rollout = me == "rollout"
    if fault in ("options", "plan") and me == victim:
        await side.mismatch(fault)
    if fault in ("options", "plan") and hasattr(side, "fresh_connect"):
        await side.fresh_connect()
    snap = {n: t.clone() for n, t in side.live().items()} if is_rollout else None
    if is_rollout:
        rec["version_before"] = [r.weight_version for r in side.rollouts()]
        rec["torn_before"] = any(r.torn for r in side.rollouts())
    idle = (fault in ("never_calls", "stand_down") and me == victim) or (fault == "stale" and me == "rollout") \
        or (fault.startswith("cancel") and me == "trainer" and side.transport == "memory")
    remove = None
    seed = None
    timeout = DEADLINE_S
    canceller = None
    hook = side.hook()
    if fault in ("killed_before", "killed_mid") and me == victim:
        remove = faults.after_calls(*hook, 1 if fault == "killed_before" else side.MID,
                                    faults.signal_self(signal.SIGKILL))
    elif fault == "sigint" and me == victim:
        remove = faults.after_calls(*hook, side.SIGINT_AT or side.MID, faults.signal_self(signal.SIGINT, hold_s=side.SIGINT_HOLD_S))
    elif fault == "stall" and me == victim:
        remove = faults.after_calls(*hook, side.MID, faults.signal_self(signal.SIGSTOP))
    elif fault == "stand_down" and me != victim:
        timeout = STAND_DOWN_DEADLINE_S
    elif fault == "stale" and me == "trainer":
        seed = 1000 + 2  # the attempt that is cut short carries other bytes than the retry
        if side.transport == "files":  # a writer never waits: cancel it mid-write
            canceller = _Canceller("cancel_task")
            remove = faults.after_calls(*hook, 2, canceller)
    elif fault.startswith("cancel") and me == victim:
        canceller = _Canceller(fault)
        if hook is None:  # no mid-bulk point (memory): the cancel lands while it waits
            threading.Timer(0.3, canceller).start()
        else:
            remove = faults.after_calls(*hook, side.MID, canceller)
    t0 = time.monotonic()
    if idle:
        rec["error"] = "idle"
    else:
        try:
            if fault in ("options", "plan") and hasattr(side, "refit_mismatched") and \
                    (me == victim or side.transport == "sglang_ipc"):
                call = side.refit_mismatched(timeout)
            else:
                call = side.refit(2, timeout, seed)
            if canceller is not None and canceller.how in ("cancel_anyio", "cancel_trio"):
                with anyio.CancelScope() as scope:
                    canceller.scope = scope
                    await call
                rec["error"] = "Cancelled" if scope.cancelled_caught else "ok"
            elif canceller is not None or fault == "stand_down":
                import asyncio

                task = asyncio.ensure_future(call)
                if canceller is not None:
                    canceller.task = task
                else:
                    done, _ = await asyncio.wait({task}, timeout=STAND_DOWN_AT_S)
                    if not done:
                        rec["stood_down"] = sum(w.stand_down_refit_watchdog() for w in side.workers())
                try:
                    await task
                    rec["error"] = "ok"
                except asyncio.CancelledError:
                    if canceller is None or canceller.at is None:
                        raise
                    rec["error"] = "Cancelled"
            else:
                await call
                rec["error"] = "ok"
        except PolicyWorkerError as exc:
            rec["error"] = type(exc).__name__
            rec["message"] = str(exc)[:400]
        except Exception as exc:  # noqa: BLE001 - an untyped error is what the cell reports
            rec["error"] = f"untyped {type(exc).__module__}.{type(exc).__name__}"
            rec["message"] = str(exc)[:400]
        except BaseException:
            if fault == "sigint":  # record what this side holds, then let the interrupt end the process
                _PARTIAL.update(rec, error="interrupted", seconds=time.monotonic() - t0)
            raise
        finally:
            if remove is not None:
                remove()
    rec["seconds"] = time.monotonic() - t0
    if canceller is not None and canceller.at is not None:
        rec["after_cancel"] = time.monotonic() - canceller.at
    if fault == "stall" and me != victim:
        os.kill(cell["pids"]["trainer"], signal.SIGCONT)
    if is_rollout:
        rec["touched"] = _bytes_changed(snap, side.live())
        rec["torn"] = any(r.torn for r in side.rollouts())
        rec["version_after"] = [r.weight_version for r in side.rollouts()]
        rec["serves"] = _servable(side)
        if hasattr(side, "after_step"):
            rec.update(await side.after_step())
    if fault in ("options", "plan") and me == victim:
        await side.unmismatch(fault)
    return rec


async def run_side(side, cell: dict, barrier, *, replacement: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"side": side.name, "steps": [], "pid": os.getpid()}
    steps = cell["steps"]
    try:
        if replacement:  # the victim died in step 0: join where the survivor recovers
            await _sync(barrier, "done-0")
            await side.open(1)
        else:
            await _sync(barrier, "start")  # both processes are up: connect waits start together
            await side.open(0)
            await side.refit(1, FINAL_DEADLINE_S)
            if side.name == "rollout":
                out["v1_exact"] = _exact(side)
            for k, step in enumerate(steps):
                await _sync(barrier, f"ready-{k}")
                out["steps"].append(await _step(side, step, cell, k))
                await _sync(barrier, f"done-{k}")
                if cell["recovery"] != "none":
                    await side.recover(k + 1)
        t0 = time.monotonic()
        try:
            await side.refit(2, FINAL_DEADLINE_S)
            out["final"] = "ok"
        except PolicyWorkerError as exc:
            out["final"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        out["final_seconds"] = time.monotonic() - t0
        if side.name == "rollout":
            out["final_version"] = [r.weight_version for r in side.rollouts()]
            out["final_torn"] = any(r.torn for r in side.rollouts())
            out["final_exact"] = _exact(side)
    finally:
        if hasattr(side, "close"):
            await side.close()
        out["shutdown"] = [await w.shutdown() for w in side.workers() if w is not None]
        out["shutdown_clean"] = [w.shutdown_clean for w in side.workers() if w is not None]
    return out


def _exact(side) -> bool:
    versions = {r.weight_version for r in side.rollouts()}
    if len(versions) != 1 or any(r.torn for r in side.rollouts()):
        return False
    want = side.reference(versions.pop())
    have = side.live()
    return set(want) == set(have) and all(torch.equal(have[k], want[k]) for k in want)


async def _run_cell(rank: int, cell: dict, barrier, replacement: bool) -> dict[str, Any]:
    names = side_names(cell["transport"], rank)
    if cell["transport"] == "memory":
        from policyworker.testing.memory import MemoryHub

        cell = {**cell, "hub": MemoryHub()}
    sides = [SIDES[cell["transport"]](n, cell) for n in names]
    results: dict[str, Any] = {}

    async def one(side) -> None:
        results[side.name] = await run_side(side, cell, barrier, replacement=replacement)

    async with anyio.create_task_group() as tg:
        for side in sides:
            tg.start_soon(one, side)
    return results


def serve(rank: int, transport: str, cmds, results, barrier, first: dict | None) -> None:
    """A matrix process: run cells until told to stop (``None``)."""
    import faulthandler

    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a cell that overruns dumps its stacks
    # Warm up before any cell: building a model imports much of torch lazily (seconds on a
    # busy host) — a cost no connect wait of a cell should pay.
    from .matrix_sides import CONFIG, build_model

    build_model(CONFIG, seed=0, dtype=torch.float32)
    if transport == "memory":
        barrier = threading.Barrier(2)
    cell, replacement = first, first is not None
    while True:
        if cell is None:
            cell = cmds.get(timeout=900)
            replacement = False
            if cell is None:
                return
        backend = "asyncio"
        if any(s["fault"] == "cancel_trio" for s in cell["steps"]) and (
                transport == "memory" or side_names(transport, rank) == ["rollout"]):
            backend = "trio"
        try:
            value = anyio.run(_run_cell, rank, cell, barrier, replacement, backend=backend)
            results.put((cell["id"], rank, True, value))
        except KeyboardInterrupt:
            results.put((cell["id"], rank, True, {side_names(transport, rank)[0]: {"interrupted": dict(_PARTIAL)}}))
            raise SystemExit(SIGINT_EXIT) from None
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the test
            import traceback

            results.put((cell["id"], rank, False, f"{type(exc).__name__}: {traceback.format_exc()[-3000:]}"))
        cell = None
