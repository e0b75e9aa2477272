"""Spawning a small world of real processes, with every wait bounded.

Used by the demo, the benchmarks and the multi-process tests. Each process runs
``target(rank, *args)`` (a picklable top-level function) in a fresh process forked
from a server that has imported torch once (:func:`process_context`; ``spawn`` on
request), and its return value — plain data — comes back through a queue. A process
that raises sends back its traceback text; a world that does not finish in
``timeout_s`` is killed, every process of it, and reported.

This is local process control, not a network protocol: results travel over
multiprocessing's own pipe between a parent and the children it spawned.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue as _queue
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from policyworker.errors import ConfigError, ProcessFailed

#: After one rank failed, how long :meth:`World.collect` still waits for the others.
FAIL_GRACE_S = 10.0

__all__ = ["ProcessFailed", "World", "free_port", "free_ports", "process_context", "run_world", "start_process",
           "start_world"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago.

    Drawn at random below the kernel's ephemeral range (Linux: 32768-60999), where the
    OS never hands ports to outgoing connections: a port the OS picked (``bind(0)``)
    comes from that range and can be taken by any client socket (a store client, a
    gloo pair) before our server binds it — seen once on the H200 as "port ... is
    already in use". Falls back to the OS's pick if no port there is free.

    ``POLICYWORKER_PORTS=lo:hi`` narrows the draw to ``[lo, hi)``: runs side by side
    (the test suite's parallel workers) each draw from their own slice, so one never
    takes a port another drew and has not bound yet.

    A port this process drew in its last :data:`_RECENT_PORTS` draws is not drawn again:
    two draws for one world (an update port, a stage port) never collide, even when the
    first is not bound yet."""
    lo, hi = _port_range()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(lo, hi)
        if port in _recent and len(_recent) < (hi - lo) // 2:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _recent.append(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: How many of its latest draws :func:`free_port` does not repeat.
_RECENT_PORTS = 256
_recent: collections.deque[int] = collections.deque(maxlen=_RECENT_PORTS)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports, each free a moment ago (:func:`free_port`). Two separate
    :func:`free_port` calls can draw the same port (each probe is closed before the next):
    a world that binds both then fails with "already in use"."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def _port_range() -> tuple[int, int]:
    text = os.environ.get("POLICYWORKER_PORTS")
    if not text:
        return 20000, 32768
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        lo = hi = -1
    if not 1024 <= lo < hi <= 65536:
        raise ConfigError(f"POLICYWORKER_PORTS={text!r}: expected lo:hi with 1024 <= lo < hi <= 65536")
    return lo, hi


def _child(target: Callable[..., Any], rank: int, args: tuple, results, env: dict[str, str], _stdio: None) -> None:
    _take_environment(env)
    # A world that overruns gets SIGUSR1 before it is killed: every thread's stack goes to
    # this process's stderr as it was at start (a dup, so a later redirect of fd 2
    # cannot swallow it), and a hang says where it hung.
    with contextlib.suppress(OSError, ValueError, AttributeError):
        faulthandler.register(signal.SIGUSR1, file=os.fdopen(os.dup(2), "w"), all_threads=True)
    try:
        value = target(rank, *args)
        results.put((rank, True, value))
    except SystemExit:  # a chosen exit code (e.g. 130 after a KeyboardInterrupt): the process's own
        raise
    except BaseException:  # report every failure, KeyboardInterrupt included, then exit
        results.put((rank, False, traceback.format_exc()))


@dataclass
class World:
    """Handles of a started world; see :func:`run_world` for the usual one-shot use."""

    procs: list[mp.process.BaseProcess]
    results: Any

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def signal(self, rank: int, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[rank].pid, sig)

    def collect(
        self, timeout_s: float, *, allow_dead: Sequence[int] = (), on_tick: Callable[[], None] | None = None
    ) -> dict[int, Any]:
        """Wait for every rank's result until ``timeout_s``; kill all on failure.

        Once a rank has failed, the others get ``FAIL_GRACE_S`` more to report (a peer's
        own error is often the better clue), not the whole timeout: a rank blocked on
        the one that died (a barrier, a collective) would otherwise hold the caller to
        the end of it. ``on_tick`` runs every 0.2 s or so while waiting (progress displays).
        """
        deadline = time.monotonic() + timeout_s
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = {r for r in range(len(self.procs)) if r not in allow_dead}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                why = (f"still running {FAIL_GRACE_S:.0f} s after another rank failed" if failures
                       else "did not finish in time")
                for r in pending:
                    failures[r] = f"{why} (its threads' stacks: stderr, 'Current thread')"
                self._dump_stacks(pending)
                break
            if on_tick is not None:
                on_tick()
            try:
                rank, ok, value = self.results.get(timeout=min(remaining, 0.2))
            except _queue.Empty:
                for r in list(pending):
                    p = self.procs[r]
                    if not p.is_alive() and p.exitcode not in (None, 0):
                        # Give the queue a moment: a result may still be in the pipe.
                        time.sleep(0.05)
                        if not p.is_alive() and self.results.empty():
                            failures[r] = f"exited with code {p.exitcode} and no result"
                            pending.discard(r)
                            deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)
                continue
            pending.discard(rank)
            if ok:
                out[rank] = value
            else:
                failures[rank] = value
                deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)
        self.close()
        if failures:
            detail = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
            raise ProcessFailed(f"{len(failures)} process(es) failed:\n{detail}", failures=failures)
        return out

    def _dump_stacks(self, ranks) -> None:
        """Ask live ranks for their stacks (SIGUSR1, see ``_child``); give them a moment."""
        alive = [r for r in ranks if self.procs[r].is_alive()]
        for r in alive:
            self.signal(r, signal.SIGUSR1)
        if alive:
            time.sleep(1.0)

    def close(self) -> None:
        for p in self.procs:
            p.join(timeout=2.0)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)


#: Imported once by the fork server (see :func:`process_context`), not by every process.
PRELOAD = ("torch", "torch.distributed", "policyworker.runtime.procs")


def process_context():
    """The multiprocessing context our worlds start processes with.

    ``forkserver`` by default: one server process per parent imports :data:`PRELOAD` (torch
    and torch.distributed, ~2-3 s of CPU) once, and every process of every world is forked
    from it, a fresh process that did not have to import torch itself. Nothing else of the
    parent is inherited: targets and arguments are pickled as with ``spawn``, and
    :func:`_child` replaces the server's environment with the parent's at the world's start.
    The server starts with ``OMP_NUM_THREADS=1`` (the OpenMP runtime reads it when torch
    loads it); a world's own ``OMP_NUM_THREADS`` is applied through ``torch.set_num_threads``.
    ``POLICYWORKER_START_METHOD=spawn`` starts every process in a fresh interpreter instead."""
    method = os.environ.get("POLICYWORKER_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ConfigError(f"POLICYWORKER_START_METHOD={method!r}: expected 'forkserver' or 'spawn'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        _start_fork_server(ctx)
    return ctx


def _start_fork_server(ctx) -> None:
    from multiprocessing import forkserver

    ctx.set_forkserver_preload(list(PRELOAD))
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


class _Stdio:
    """This process's stdout and stderr, handed to a process it starts: a forked process
    would otherwise write to its server's, those of the moment the server started (before a
    redirect, a capture, a pipe of this run)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _attach_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _attach_stdio(out, err) -> None:
    for target, handle in ((1, out), (2, err)):
        fd = handle.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _take_environment(env: dict[str, str]) -> None:
    """Make this process's environment exactly ``env`` (a forked process starts with its
    server's), and apply its ``OMP_NUM_THREADS`` to a torch already imported."""
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def start_process(target: Callable[..., Any], args: tuple = (), *, env: dict[str, str] | None = None,
                  daemon: bool = True) -> mp.process.BaseProcess:
    """Start one process of :func:`process_context` running ``target(*args)`` in this
    process's environment as it is now, updated with ``env`` (what a spawned process would
    inherit, which a forked one does not)."""
    ctx = process_context()
    p = ctx.Process(target=_run_in_environment, args=(_Stdio(), {**os.environ, **(env or {})}, target, args),
                    daemon=daemon)
    p.start()
    return p


def _run_in_environment(_stdio: None, env: dict[str, str], target: Callable[..., Any], args: tuple) -> None:
    _take_environment(env)
    target(*args)


def start_world(
    target: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    env: dict[str, str] | None = None,
) -> World:
    ctx = process_context()
    results = ctx.Queue()
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = []
    for rank in range(nprocs):
        p = ctx.Process(target=_child, args=(target, rank, args, results, child_env, _Stdio()), daemon=True)
        p.start()
        procs.append(p)
    return World(procs, results)


def run_world(
    target: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``target(rank, *args)`` in ``nprocs`` spawned processes; return results by rank."""
    world = start_world(target, nprocs, args, env=env)
    out = world.collect(timeout_s)
    return [out[r] for r in range(nprocs)]
