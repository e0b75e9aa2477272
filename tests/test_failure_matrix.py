"""The failure matrix: every built-in transport × every fault kind, generated.

The table (``tests/matrix_cells.py``) says which cells apply and what each side must
see; a pair that does not apply is excluded there with its reason, never skipped
here. Every cell asserts the guarantees of ``docs/guarantees.md``:

* each side's error is a ``PolicyWorkerError`` subclass of the expected kinds (or the
  cancellation propagates, or the side succeeds where its transport does not wait),
  within its bound + ``SLACK_S``;
* the rollout is torn iff a live byte changed (bytes compared against a snapshot taken
  just before the fault, not the flag) — save where a sender that had begun writing
  straight into live tensors died or stalled (``DIRECT_RECEIVE``): torn, bytes maybe
  unchanged — its version is unchanged, and it serves iff it is not torn;
* after the transport's documented recovery the next refit commits, bit-exact against
  weights the rollout's process computes itself;
* every process exits with code 0 — a killed one with -SIGKILL, an interrupted one with
  130 (KeyboardInterrupt, after its worker shut down) — and every ``shutdown()`` is clean.

Processes are shared: one world per transport (2 processes; ``memory``: 1), driven by a
command queue, each cell with fresh workers; a cell that kills a process gets a
replacement, which then serves the following cells.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import queue
import shutil
import signal
import tempfile
import threading
import time

import pytest

from policyworker.runtime.procs import free_port, process_context, start_process

from .matrix_cells import (CANCEL_BOUND_S, DIRECT_RECEIVE, KILLED_EXIT, SIGINT_EXIT, SLACK_S, TRANSPORTS, Cell,
                           cells, exclusions)
from .matrix_sides import side_names, world_size
from .matrix_world import serve

pytestmark = [pytest.mark.multiprocess]

CELLS = cells()
CELL_TIMEOUT_S = float(os.environ.get("PW_CELL_TIMEOUT_S", "300"))
#: The whole matrix, every world side by side (a bound, not a goal: CI takes ~3 min).
MATRIX_TIMEOUT_S = 900.0


_PORTS_LOCK = threading.Lock()
_PORTS_USED: set[int] = set()


def _port() -> int:
    """A free port not handed to any cell of this session yet (worlds draw side by side)."""
    with _PORTS_LOCK:
        while True:
            port = free_port()
            if port not in _PORTS_USED:
                _PORTS_USED.add(port)
                return port


class MatrixWorld:
    """One transport's long-lived processes and their queues."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.ctx = process_context()
        self.n = world_size(transport)
        self.cmds = [self.ctx.Queue() for _ in range(self.n)]
        self.results = self.ctx.Queue()
        self.barrier = self.ctx.Barrier(2) if self.n == 2 else None
        self.procs = [self._start(r, None) for r in range(self.n)]
        self.exits: list[int] = []  # exit codes of processes that ended inside a cell

    def _start(self, rank: int, first: dict | None):
        return start_process(serve, (rank, self.transport, self.cmds[rank], self.results, self.barrier, first))

    def rank_of(self, side: str) -> int:
        return next(r for r in range(self.n) if side in side_names(self.transport, r))

    def run(self, cell: Cell) -> tuple[dict, dict[int, int]]:
        """Run one cell; return {side: record} and {rank: exit code} of processes that ended."""
        epochs = len(cell.steps) + 2  # one per recovery, and one for a fresh connect (mismatch steps)
        work = tempfile.mkdtemp(prefix="pwmatrix-")
        spec = {"id": cell.id, "transport": cell.transport, "fault": cell.fault, "recovery": cell.recovery,
                "steps": [dataclasses.asdict(s) | {"trainer": None, "rollout": None} for s in cell.steps],
                "ports": [[_port(), _port()] for _ in range(epochs)], "dir": work,
                "pids": {s: self.procs[self.rank_of(s)].pid for s in ("trainer", "rollout")}}
        for q in self.cmds:
            q.put(spec)
        out: dict = {}
        ended: dict[int, int] = {}
        pending = set(range(self.n))
        deadline = time.monotonic() + CELL_TIMEOUT_S
        try:
            while pending and time.monotonic() < deadline:
                try:
                    cid, rank, ok, value = self.results.get(timeout=0.1)
                except queue.Empty:
                    for r in list(pending):
                        p = self.procs[r]
                        if not p.is_alive() and r not in ended:
                            p.join(1)
                            ended[r] = p.exitcode
                            if not cell.kills:
                                raise AssertionError(f"rank {r} exited {p.exitcode} in a cell that kills no one")
                            self.procs[r] = self._start(r, spec)  # joins the cell where the victim left it
                    continue
                assert cid == cell.id, (cid, cell.id)
                assert ok, f"rank {rank}: {value}"
                if any("interrupted" in v for v in value.values()):
                    out.setdefault("interrupted", {}).update(value)
                    continue
                out.update(value)
                pending.discard(rank)
            if pending:
                for r in pending:  # their stacks go to stderr (faulthandler, see serve)
                    if self.procs[r].is_alive():
                        os.kill(self.procs[r].pid, signal.SIGUSR1)
                time.sleep(1.0)
            assert not pending, f"ranks {sorted(pending)} did not finish {cell.id} in {CELL_TIMEOUT_S:.0f} s"
        except BaseException:
            self.close()
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return out, ended

    def close(self, *, timeout_s: float = 30.0) -> list[int | None]:
        for q in self.cmds:
            q.put(None)
        codes = []
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(5)
            codes.append(p.exitcode)
        self.procs = []
        return codes


class Matrix:
    """Runs every transport's cells in its own world, the worlds side by side (a cell
    spends most of its time waiting out a deadline, so worlds overlap well); a test
    waits for its own cell's result."""

    def __init__(self, todo: list[Cell]) -> None:
        self.futures = {c.id: concurrent.futures.Future() for c in todo}
        self.worlds: dict[str, MatrixWorld] = {}
        self.codes: dict[str, list[int | None]] = {}
        self.threads = []
        for t in dict.fromkeys(c.transport for c in todo):
            th = threading.Thread(target=self._run, args=(t, [c for c in todo if c.transport == t]),
                                  name=f"matrix-{t}", daemon=True)
            th.start()
            self.threads.append(th)

    def _run(self, transport: str, todo: list[Cell]) -> None:
        world = None
        for cell in todo:
            try:
                if world is None or not world.procs:  # a failed cell closed it: start afresh
                    world = self.worlds[transport] = MatrixWorld(transport)
                self.futures[cell.id].set_result((world.run(cell), world))
            except BaseException as exc:  # noqa: BLE001 - the cell's test reports it
                self.futures[cell.id].set_exception(exc)
        if world is not None and world.procs:
            self.codes[transport] = world.close()

    def result(self, cell: Cell):
        return self.futures[cell.id].result(timeout=MATRIX_TIMEOUT_S)

    def join(self) -> dict[str, list[int | None]]:
        for th in self.threads:
            th.join(MATRIX_TIMEOUT_S)
        return self.codes


@pytest.fixture(scope="module")
def matrix(request):
    selected = [item.callspec.params["cell"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "cell" in item.callspec.params]
    m = Matrix(selected or CELLS)
    yield m
    m.join()
    for w in m.worlds.values():
        if w.procs:
            w.close()


def _check_side(cell: Cell, k: int, side: str, rec: dict | None, expect, ended: dict, world: MatrixWorld) -> None:
    kinds = expect.kinds
    where = f"{cell.id} step {k} {side}"
    if kinds == ("dead",):
        code = ended.get(world.rank_of(side))
        want = SIGINT_EXIT if cell.steps[k].fault == "sigint" else KILLED_EXIT
        assert code == want, f"{where}: exit code {code}, expected {want}"
        return
    assert rec is not None, f"{where}: no record"
    err = rec["error"]
    if kinds == ("idle",):
        assert err == "idle", where
        return
    assert err in kinds, f"{where}: {err} ({rec.get('message', '')}), expected one of {kinds}"
    if kinds == ("Cancelled",):
        assert rec["after_cancel"] <= CANCEL_BOUND_S + SLACK_S, f"{where}: returned {rec['after_cancel']:.1f} s after the cancel"
    elif expect.bound_s is not None and err != "ok":
        assert rec["seconds"] <= expect.bound_s + SLACK_S, f"{where}: {err} after {rec['seconds']:.1f} s"
    if rec["fault"] == "stand_down" and side == "rollout":
        assert rec.get("stood_down", 0) >= 1, f"{where}: stand_down_refit_watchdog disarmed nothing"


@pytest.mark.timeout(MATRIX_TIMEOUT_S + 60)
@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell(cell: Cell, matrix) -> None:
    (out, ended), world = matrix.result(cell)
    for k, step in enumerate(cell.steps):
        for side in ("trainer", "rollout"):
            expect = getattr(step, side)
            recs = out.get(side, {}).get("steps", [])
            _check_side(cell, k, side, recs[k] if k < len(recs) else None, expect, ended, world)
        rec = out.get("rollout", {}).get("steps", [])
        if k < len(rec):  # the rollout survived this step: what it holds now
            r = rec[k]
            where = f"{cell.id} step {k}"
            if r["error"] == "ok":  # a refit that committed (a torn reader catching up): clean, newer
                assert not r["torn"] and r["serves"] and min(r["version_after"]) > max(r["version_before"]), r
                continue
            assert r["version_after"] == r["version_before"], f"{where}: version moved {r}"
            if r["torn_before"] or r["touched"]:
                assert r["torn"], f"{where}: a live byte changed (or it was torn before) but it is not torn"
            elif r["torn"]:  # torn, every byte as before: only a write that may have begun and was cut
                assert cell.may_touch and cell.transport in DIRECT_RECEIVE and \
                    cell.steps[k].fault in ("killed_before", "killed_mid", "stall", "sigint") and \
                    cell.steps[k].victim == "trainer", f"{where}: torn but no live byte changed {r}"
            if not cell.may_touch:
                assert not r["touched"], f"{where}: live bytes changed in a fault that must touch none"
            assert r["serves"] == (not r["torn"]), f"{where}: serves={r['serves']} torn={r['torn']}"
            if "landed_late" in r:  # on-demand landing: nothing handed over once the refit returned
                assert r["landed_late"] == 0 and r["landing_calls"] > 0, f"{where}: {r}"
    for side in ("trainer", "rollout"):
        rec = out[side]
        assert rec["final"] == "ok", f"{cell.id}: {side}'s refit after the recovery: {rec['final']}"
        assert all(rec["shutdown"]) and all(c is True for c in rec["shutdown_clean"]), (side, rec["shutdown_clean"])
    r = out["rollout"]
    assert r["final_exact"] and not r["final_torn"] and min(r["final_version"]) >= 2, r
    if "v1_exact" in r:
        assert r["v1_exact"]


def test_every_pair_is_a_cell_or_excluded_with_a_reason() -> None:
    from .matrix_cells import FAULTS

    have = {(c.transport, c.fault) for c in CELLS}
    skip = exclusions()
    for t in TRANSPORTS:
        for f in FAULTS:
            assert ((t, f) in have) != ((t, f) in skip), (t, f)
    assert all(len(reason) > 20 for reason in skip.values())
    assert set(TRANSPORTS) == {c.transport for c in CELLS}


@pytest.mark.timeout(MATRIX_TIMEOUT_S + 60)
def test_processes_exit_cleanly(matrix) -> None:
    """After the cells: every shared process stopped on request with exit code 0."""
    codes = matrix.join()
    assert codes and all(c == 0 for cs in codes.values() for c in cs), codes
