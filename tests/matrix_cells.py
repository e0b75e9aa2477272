"""The failure matrix's table: fault kinds × transports, with each cell's expectation.

A *cell* is (transport, fault). :func:`cells` generates them all; a pair that does not
apply is excluded here, with its reason (:func:`exclusions`), never skipped at run time.
Each fault is one or more *steps* (a failing refit, then the transport's documented
recovery); then one more refit must commit bit-exact. What a side must see in a step
is an :class:`Expect`: an error kind, the bound it must arrive within, or success.

Sides: ``trainer`` is the sending peer's process, ``rollout`` the process that holds
the receiving weights (for ``sglang_ipc``: trainer rank 0, which hosts the in-process
engine and its rollouts; the ``trainer`` side is trainer rank 1, the gather's peer).
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("nccl_reshard", "nccl_landing", "zmq", "files", "files_delta", "memory", "sglang_ipc")

#: The refit deadline of a failing step (``refit_timeout_s``), seconds.
DEADLINE_S = 3.0
#: Slack past a bound: a typed error must arrive within bound + SLACK_S.
SLACK_S = 3.0
#: A stand-down cell arms this deadline, stands down after STAND_DOWN_AT_S, and the
#: transport's own wait bound (OWN_BOUND_S: group timeout / zmq / files / memory
#: ``timeout_s``) ends the refit — long before this deadline would have.
STAND_DOWN_DEADLINE_S = 30.0
STAND_DOWN_AT_S = 1.0
OWN_BOUND_S = 4.0
#: A cancelled refit returns within this many seconds of the cancel.
CANCEL_BOUND_S = 3.0
#: Exit code of a process whose refit was interrupted by SIGINT (128 + SIGINT: the
#: matrix's process turns the KeyboardInterrupt into SystemExit(130) after recording).
SIGINT_EXIT = 130
KILLED_EXIT = -9  # SIGKILL
#: zmq's own wait bound (``timeout_s`` of its setup): a re-attach waits this long for the trainer.
ZMQ_TIMEOUT_S = 20.0

# What a side may see (error kinds; PolicyWorkerError subclasses unless named otherwise).
COMM = ("PeerLost", "RefitAborted", "RefitTimeout", "TransportError")
TIMEOUT = ("RefitTimeout",)
MISMATCH = ("ConfigError", "PlanMismatch")


@dataclass(frozen=True)
class Expect:
    """One side's outcome in one step: ``kinds`` (error class names; ``("ok",)``: the
    refit succeeds; ``("idle",)``: the side does not call; ``("dead",)``: it dies;
    ``("Cancelled",)``: the cancellation propagates), within ``bound_s`` (+ SLACK_S)."""

    kinds: tuple[str, ...]
    bound_s: float | None = None


@dataclass(frozen=True)
class Step:
    fault: str  # never_calls | killed_before | killed_mid | stall | stand_down | cancel_task | cancel_anyio | cancel_trio | sigint | options | plan | stale
    victim: str | None  # "trainer" | "rollout" | None
    trainer: Expect
    rollout: Expect


@dataclass(frozen=True)
class Cell:
    transport: str
    fault: str
    steps: tuple[Step, ...]
    recovery: str  # what the sides do after each step (docs/guarantees.md): rebuild | reattach | none
    #: Whether a live byte may have been touched by the steps (torn is then compared
    #: with the bytes); False: the bytes must be unchanged and the rollout not torn.
    may_touch: bool = True

    @property
    def id(self) -> str:
        return f"{self.transport}-{self.fault}"

    @property
    def kills(self) -> bool:
        return any(s.fault in ("killed_before", "killed_mid", "sigint") for s in self.steps)


# -- how each transport behaves ---------------------------------------------------------
#: The recovery each transport documents after a failed refit.
RECOVERY = {"nccl_reshard": "rebuild", "nccl_landing": "rebuild", "sglang_ipc": "rebuild", "zmq": "reattach",
            "files": "none", "files_delta": "none", "memory": "none"}
#: Senders that never wait for a receiver: a missing or dead receiver fails nothing on them.
FIRE_AND_FORGET = ("files", "files_delta", "memory")
#: Transports whose rollouts receive straight into live tensors from a socket. When the
#: sender dies (or stalls past the deadline) after its header arrived, the receiver cannot
#: tell a partial write from none: it is torn although the bytes it holds may be
#: unchanged (docs/guarantees.md, guarantee 3). Everywhere else torn equals "a byte changed".
DIRECT_RECEIVE = ("nccl_reshard", "nccl_landing")
IN_PROCESS = ("memory",)


def exclusions() -> dict[tuple[str, str], str]:
    """(transport, fault) pairs that do not apply, each with the reason."""
    out: dict[tuple[str, str], str] = {}
    for fault in ("killed_before-trainer", "killed_before-rollout", "killed_mid-trainer", "killed_mid-rollout",
                  "sigint", "stall"):
        out[("memory", fault)] = ("in-process test double: both sides share one process, so no peer can be "
                                  "killed, interrupted or stopped alone")
    for fault in ("killed_before-rollout", "killed_mid-rollout"):
        out[("sglang_ipc", fault)] = ("the in-process engine and its rollouts live in trainer rank 0's process: "
                                      "killing them kills the gather source, no rollout survives to check")
    out[("zmq", "options")] = ("the rollout has no setup to disagree on: the trainer's Offer carries "
                               "bucket_bytes and the staging ring")
    out[("files", "options")] = "the directory is self-describing (manifest, signature): no options are shared"
    out[("memory", "options")] = "the hub is the only setup both sides share"
    out[("memory", "plan")] = ("plan-less and connect-less: destinations of another shape are a ProtocolError "
                               "at receive, checked before any byte lands (tests/test_generic_road.py)")
    out[("sglang_ipc", "plan")] = ("plan-less: the engine takes tensors by name; the trainer ranks' tensor "
                                   "lists are compared at connect like their options (the options cell)")
    # files_delta: the files plugin with delta=True; versions differ from the one before
    # in ~2% of the elements, so v2 and later are deltas. Its cells cut a delta version.
    for fault in FAULTS:
        if fault not in _DELTA_FAULTS:
            out[("files_delta", fault)] = ("delta mode differs from the files cells only in what a version holds and "
                                           "how a reader replays it: its cells cut a delta mid-write, mid-replay and "
                                           "past a deadline; the other faults are the files cells'")
    # nccl_landing: nccl_reshard with the rollout landing every other destination on demand.
    # Its cells cut a refit while destinations are open or handed over (cancelled three
    # ways, the trainer killed or stopped mid-bulk, torn then refitted again).
    for fault in FAULTS:
        if fault not in _LANDING_FAULTS:
            out[("nccl_landing", fault)] = ("on-demand landing changes only where the rollout's bytes land: its "
                                            "cells cut a refit mid-landing; connect, plan, options, idle-peer and "
                                            "interrupt faults never reach a landing and are nccl_reshard's cells")
    out[("memory", "stale")] = ("the sender never waits, so no attempt of it can be cut short; the hub "
                                "holds one value per version")
    return out


def _cell(transport: str, fault: str) -> Cell:
    ff = transport in FIRE_AND_FORGET
    rec = RECOVERY[transport]
    d = DEADLINE_S
    ok, idle, dead = Expect(("ok",)), Expect(("idle",)), Expect(("dead",))
    timeout = Expect(TIMEOUT, d)
    comm = Expect(COMM, d)
    # A sender that never waits has nothing to cut short: it either finished (ok) or
    # was never waited on.
    sender_after_rollout_fault = ok if ff else comm
    if fault.startswith("never_calls-"):
        victim = fault.split("-")[1]
        if victim == "trainer":
            return Cell(transport, fault, (Step("never_calls", victim, idle, timeout),), rec, may_touch=False)
        return Cell(transport, fault, (Step("never_calls", victim, ok if ff else timeout, idle),), rec,
                    may_touch=False)
    if fault.startswith(("killed_before-", "killed_mid-")):
        kind, victim = fault.split("-")
        if victim == "trainer":
            # files: a dead writer leaves nothing committed; the rollout waits out its deadline.
            return Cell(transport, fault, (Step(kind, victim, dead, Expect(COMM, d)),), rec)
        return Cell(transport, fault, (Step(kind, victim, sender_after_rollout_fault, dead),), rec)
    if fault == "stall":  # the trainer stops (SIGSTOP) mid-bulk: the rollout's deadline fires
        # files: once continued, the writer may finish its version (readers land it later).
        kinds = ("ok", *COMM) if ff else COMM
        return Cell(transport, fault, (Step("stall", "trainer", Expect(kinds, 6 * d), timeout),), rec)
    if fault == "stand_down":  # the trainer never calls; the rollout stands down its deadline
        own = Expect(("RefitTimeout", "RefitAborted", "PeerLost", "TransportError"), STAND_DOWN_AT_S + OWN_BOUND_S)
        return Cell(transport, fault, (Step("stand_down", "trainer", idle, own),), rec, may_touch=False)
    if fault in ("cancel_task", "cancel_anyio", "cancel_trio"):
        # memory has no mid-bulk point: its trainer stays idle and the cancel lands in the wait.
        trainer = idle if transport in IN_PROCESS else sender_after_rollout_fault
        return Cell(transport, fault, (Step(fault, "rollout", trainer, Expect(("Cancelled",), CANCEL_BOUND_S)),), rec)
    if fault == "sigint":
        if transport == "sglang_ipc":  # rank 1 is interrupted; rank 0 (and its engine) sees a lost peer
            return Cell(transport, fault, (Step("sigint", "trainer", dead, Expect(COMM, d)),), rec)
        # The interrupt lands on the loop; the executor may finish the rollout's part (its last
        # message) first, and the trainer then succeeds. The interrupted rollout never commits.
        return Cell(transport, fault, (Step("sigint", "rollout", Expect(("ok", *COMM), d), dead),), rec)
    if fault in ("options", "plan"):
        victim = "trainer" if transport == "sglang_ipc" else "rollout"
        mismatch = Expect(MISMATCH, d)
        # Every side connects afresh (nccl_reshard: a new world first; zmq: the rollout's
        # Hello; sglang_ipc: both ranks re-attach) and refuses there. files: the writer
        # never looks at its readers; it commits.
        trainer = ok if transport == "files" else mismatch
        return Cell(transport, fault, (Step(fault, victim, trainer, mismatch),), rec, may_touch=False)
    if fault == "torn_again":
        # A cancelled refit (torn iff touched), then, from there, a refit whose trainer never calls.
        first = _cell(transport, "cancel_task").steps[0]
        if transport == "files":  # the writer committed v2 in step 1: the torn reader catches up
            second = ok
        elif transport == "zmq":  # the re-attach (a new session) waits zmq's own timeout_s for the trainer
            second = Expect(TIMEOUT, ZMQ_TIMEOUT_S)
        else:
            second = timeout
        return Cell(transport, fault, (first, Step("never_calls", "trainer", idle, second)), rec)
    if fault == "stale":
        # The trainer's attempt (other bytes) is cut short while the rollout is absent
        # (files: cancelled mid-write); then the retry's bytes, not the stale ones, must land.
        trainer = Expect(("Cancelled",), CANCEL_BOUND_S) if ff else timeout
        return Cell(transport, fault, (Step("stale", "rollout", trainer, idle),), rec, may_touch=False)
    raise ValueError(fault)


FAULTS = ("never_calls-trainer", "never_calls-rollout", "killed_before-trainer", "killed_before-rollout",
          "killed_mid-trainer", "killed_mid-rollout", "stall", "stand_down", "cancel_task", "cancel_anyio",
          "cancel_trio", "sigint", "options", "plan", "torn_again", "stale")


#: The faults cut in the files plugin's delta mode: a writer killed mid-version, a
#: reader killed mid-replay, a writer stopped past the reader's deadline.
_DELTA_FAULTS = ("killed_mid-trainer", "killed_mid-rollout", "stall")
_LANDING_FAULTS = ("killed_mid-trainer", "stall", "cancel_task", "cancel_anyio", "cancel_trio", "torn_again")


def cells() -> list[Cell]:
    """Every applicable (transport, fault) cell, transports grouped (they share processes)."""
    skip = exclusions()
    return [_cell(t, f) for t in TRANSPORTS for f in FAULTS if (t, f) not in skip]
