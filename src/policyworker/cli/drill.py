"""``policyworker drill``: fault scenarios on the embedded CPU default, one row each.

Every built-in transport is drilled: the ``nccl_reshard`` rows are here; the ``zmq``
rows (:mod:`.drill_zmq`) and the ``sglang_ipc`` rows (:mod:`.drill_sglang`) run their
own worlds and are judged the same way. Each transport has a *cancel* row: the
controller cancels an awaiting refit (as ``asyncio.wait_for`` would); the rollout must
then be torn (refusing) or at its old version with intact bytes, never mixed.

nccl_reshard world: 2 trainers (tp=2) → 2 rollouts (tp=2), nccl_reshard over gloo, the "tiny"
preset in small buckets (many messages, so "mid-refit" is real), three refits. In
each scenario one fault hits refit v2; then the survivors recover the way a
controller would, and the scenario passes only if

* the failure was detected by the right error, in time (``detect_seconds``: prompt
  for a dead peer, within deadline + 2 s for a stall),
* no rollout served torn weights and none served a mixed version (after every
  failure a rollout either refuses with ``TornWeights`` or still holds exactly its
  last committed version, checked bit for bit),
* every rank — a replacement process included — ends at v3, bit-exact.

Recovery: comm failures (``PeerLost``, ``RefitAborted``, ``RefitTimeout``) move every
survivor to the next *epoch*: new update and stage groups on fresh ports (a killed
process is replaced by a new one that joins there). Protocol failures (a corrupt
bucket, a plan mismatch at connect) leave the groups healthy: the refit is retried.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any

from policyworker.cli.drill_rows import collect_with_replacement, failure_row, join_groups

__all__ = ["SCENARIOS", "Scenario", "run_drill"]

N_TRAIN = N_GEN = 2
REFITS = 3
FAULT_VERSION = 2
_COMM = ("PeerLost", "RefitAborted", "RefitTimeout")


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # kill_mid | stop_mid | standdown | kill_between | flip | bad_plan | cancel | refuse | engine_stall
    #            | never_calls | stale | sigint | options
    victim: int  # global rank: nccl_reshard 0, 1 trainers, 2, 3 rollouts; zmq 0 trainer, 1 rollout
    expect: tuple[str, ...]  # error types acceptable on the survivors
    refit_timeout_s: float = 6.0
    checksum: bool = False
    transport: str = "nccl_reshard"
    delta: bool = False  # nccl_reshard with delta=True (drill_delta's world)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("kill-rollout-mid-refit", "kill_mid", 3, _COMM),
        Scenario("kill-trainer-mid-refit", "kill_mid", 1, _COMM),
        Scenario("stall-rollout-past-deadline", "stop_mid", 3, ("RefitTimeout", "RefitAborted"), refit_timeout_s=3.0),
        Scenario("stand-down-during-refit", "standdown", 3, ("RefitAborted",), refit_timeout_s=20.0),
        Scenario("corrupt-bucket", "flip", 0, ("ProtocolError", "TransportError"), checksum=True),
        Scenario("plan-hash-mismatch", "bad_plan", 3, ("PlanMismatch",)),
        Scenario("restart-and-recover", "kill_between", 2, _COMM),
        # A controller cancels the rollout's awaiting refit (asyncio.wait_for): the rollout is
        # torn or intact at its old version; everyone rebuilds and commits.
        Scenario("cancel-awaiting-refit", "cancel", 3, (*_COMM, "Cancelled", "TransportError"),
                 refit_timeout_s=3.0),
        # A rollout never calls v2: the trainers' deadline fires (RefitTimeout), everyone rebuilds.
        Scenario("rollout-never-calls", "never_calls", 3, ("RefitTimeout", "RefitAborted", "PeerLost"),
                 refit_timeout_s=3.0),
        # Both rollouts are absent for the trainers' first v2 attempt, which carries other bytes;
        # after the rebuild the retry's bytes, not the stale attempt's, must land (bit-exact).
        Scenario("stale-attempt-arrives-late", "stale", 2, ("RefitTimeout", "RefitAborted", "PeerLost"),
                 refit_timeout_s=3.0),
        # SIGINT to a rollout mid-refit: it shuts down and exits 130 (never SIGABRT); a
        # replacement joins and everyone commits.
        Scenario("sigint-rollout-mid-refit", "sigint", 3, _COMM),
        # In a new world a rollout connects with other bucket_bytes: refused at connect on every
        # rank (ConfigError), nothing touched; the controller fixes it and everyone rebuilds.
        Scenario("options-mismatch-at-connect", "options", 3, ("ConfigError",)),
        Scenario("zmq-kill-rollout-mid-refit", "kill_mid", 1, _COMM, transport="zmq"),
        Scenario("zmq-kill-trainer-mid-refit", "kill_mid", 0, _COMM, transport="zmq"),
        Scenario("zmq-stall-rollout-past-deadline", "stop_mid", 1, ("RefitTimeout", "RefitAborted"),
                 refit_timeout_s=3.0, transport="zmq"),
        Scenario("zmq-restart-and-recover", "kill_between", 1, _COMM, transport="zmq"),
        Scenario("sglang-engine-refuses-bucket", "refuse", 0, ("TransportError",), transport="sglang_ipc"),
        Scenario("sglang-engine-times-out", "engine_stall", 0, ("RefitTimeout",), refit_timeout_s=3.0,
                 transport="sglang_ipc"),
        Scenario("sglang-cancel-awaiting-refit", "cancel", 0, (*_COMM, "Cancelled", "TransportError"),
                 refit_timeout_s=3.0, transport="sglang_ipc"),
        Scenario("zmq-cancel-awaiting-refit", "cancel", 1, (*_COMM, "Cancelled", "TransportError"),
                 transport="zmq"),
        # nccl_reshard with delta=True (drill_delta): a rollout killed mid-delta is replaced; the
        # retried refit is full (the replacement holds no base), the next one a delta again.
        Scenario("delta-kill-rollout-mid-delta", "kill_mid", 3, _COMM, delta=True),
    )
}


def _plan(bad: bool = False):
    import torch

    from policyworker.layout import build_plan
    from policyworker.models import get_preset

    gen = "tp=1,dp=2" if bad else "tp=2"  # same world size, another layout: another hash
    return build_plan(get_preset("tiny"), "tp=2", gen, N_TRAIN, N_GEN, dtype=torch.float32)


def _rank_main(rank: int, sc: Scenario, ports: list[dict], events, start_epoch: int) -> dict[str, Any]:
    import torch

    from policyworker.testing import faults
    from policyworker.errors import PolicyWorkerError
    from policyworker.layout import dest_shards
    from policyworker.models import get_preset, seeded_state_dict
    from policyworker.models.toy_model import build_model
    from policyworker.workers.rollout import RolloutWorker
    from policyworker.workers.torch_trainer import TorchPolicyWorker

    torch.set_num_threads(1)
    config = get_preset("tiny")
    trainer = rank < N_TRAIN
    plan = _plan()
    options = {"bucket_bytes": 4096, "in_flight": 4, "checksum": sc.checksum}
    victim = rank == sc.victim and start_epoch == 0
    out: dict[str, Any] = {"rank": rank, "replacement": start_epoch > 0, "failures": [], "served_torn": False,
                           "mixed": False, "stood_down": None}

    def expected(version: int) -> dict[str, torch.Tensor]:
        return dest_shards(plan, rank - N_TRAIN, seeded_state_dict(config, seed=version, dtype=torch.float32))

    async def join(w, epoch: int) -> None:
        await join_groups(w, ports[epoch], trainer=trainer, rank=rank, n_train=N_TRAIN, n_gen=N_GEN)

    async def reattach(w, setup: dict[str, Any]) -> None:
        """Attach nccl_reshard again with ``setup``, its plan and wiring kept (connects at the next refit)."""
        att = w.attachment("nccl_reshard")
        wiring = {k: v for k, v in att.raw_setup.items() if k in ("group", "stage", "groups")}
        await w.attach_transport("nccl_reshard", connect=False, plan=att.plan, **wiring, **setup)

    async def main() -> dict[str, Any]:
        epoch = start_epoch
        if trainer:
            model = build_model(config, seed=0, dtype=torch.float32)
            w: Any = TorchPolicyWorker(model, rank=rank, world_size=N_TRAIN, device="cpu", timeout_s=60)
            await join(w, epoch)
            info = await w.prepare_nccl_reshard_refit_info("tp=2", "tp=2", N_TRAIN, N_GEN)
            # The setup, given through the road with the wiring just built; the shims keep it.
            await w.attach_transport("nccl_reshard", connect=False, plan=info, group=w.pp_comm_group, stage=0,
                                     **options)
            if start_epoch > 0:
                w.refit_version = FAULT_VERSION - 1  # a replacement joins the survivors' count
        else:
            w = RolloutWorker(rank=rank - N_TRAIN, gen_world_size=N_GEN, device="cpu", timeout_s=60)
            await join(w, epoch)
            info = _plan(bad=victim and sc.fault == "bad_plan").refit_info()
            w.load_refit_plan(info)
            await w.attach_transport("nccl_reshard", connect=False, plan=info, groups=w.stage_groups, **options)
        while True:
            version = (w.refit_version if trainer else w.weight_version) + 1
            if version > REFITS:
                break
            faulty = victim and version == FAULT_VERSION and not out["failures"]
            if faulty and sc.fault == "kill_between":
                faults.die_after_waits(1)  # dies at its very next wait: an idle rank gone
            elif faulty and sc.fault == "kill_mid":
                faults.die_after_waits(6, signal.SIGKILL)
            elif faulty and sc.fault in ("stop_mid", "standdown"):
                faults.die_after_waits(6, signal.SIGSTOP)
            elif faulty and sc.fault == "sigint":
                faults.die_after_waits(6, signal.SIGINT)
            elif faulty and sc.fault == "options":
                await reattach(w, {**options, "bucket_bytes": 2 * options["bucket_bytes"]})
            if sc.fault == "options" and version == FAULT_VERSION and not out["failures"] \
                    and not out.get("fresh_world"):
                # A new world first (init_collective): every rank connects again at this refit,
                # so the options are compared on every rank, and the victim's are refused there.
                out["fresh_world"] = True
                epoch += 1
                await join(w, epoch)
            elif faulty and sc.fault == "flip":
                state = w._refit_transport_state("nccl_reshard")
                first = next(m for m in state["schedule"] if m.copies is not None)
                first.group = faults.FlippingGroup(first.group)
            t0 = time.monotonic()
            rebuilt = False
            absent = version == FAULT_VERSION and not out["failures"] and not out.get("was_absent") and (
                (sc.fault == "never_calls" and victim) or (sc.fault == "stale" and not trainer))
            if absent:  # this rollout does not call: it waits out the trainers' deadline, then rebuilds
                out["was_absent"] = True
                await asyncio.sleep(sc.refit_timeout_s + 1.0)
                epoch += 1
                await join(w, epoch)
                continue
            stale = sc.fault == "stale" and trainer and version == FAULT_VERSION and not out["failures"]
            try:
                if trainer:
                    new = seeded_state_dict(config, seed=1000 + version if stale else version, dtype=torch.float32)
                    with torch.no_grad():
                        for name, p in model.named_parameters():
                            p.copy_(new[name])
                    refit = asyncio.ensure_future(w.nccl_reshard_refit(refit_timeout_s=sc.refit_timeout_s))
                else:
                    refit = asyncio.ensure_future(w.receive_nccl_reshard_refit(refit_timeout_s=sc.refit_timeout_s))
                if faulty and sc.fault == "cancel":
                    from policyworker.runtime.comm import CommGroup

                    faults.after_calls(CommGroup, "wait", 6, faults.cancel_task(asyncio.get_running_loop(), refit))
                if sc.fault == "standdown" and version == FAULT_VERSION and not out["failures"]:
                    done, _ = await asyncio.wait({refit}, timeout=1.5)
                    if not done:
                        # The controller confirmed a peer dead: disarm the deadlines (no abort
                        # from the watchdog), then rebuild, which aborts the stuck refit.
                        t_sd = time.perf_counter()
                        count = w.stand_down_refit_watchdog()
                        out["stood_down"] = {"count": count, "seconds": time.perf_counter() - t_sd}
                        events.put(("stood_down", rank))
                        epoch += 1
                        rebuilt = True
                        rebuild = asyncio.ensure_future(join(w, epoch))
                        await asyncio.wait({refit}, timeout=30)
                        await rebuild
                rep = await refit
                if not trainer:
                    want, have = expected(rep.version), w.weights()
                    if not all(torch.equal(have[k], want[k]) for k in want):
                        out["mixed"] = True
            except (PolicyWorkerError, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and not (faulty and sc.fault == "cancel"):
                    if faulty and sc.fault == "sigint":  # KeyboardInterrupt cancelled the refit
                        await w.shutdown()
                    raise
                row = failure_row(exc, version=version, t0=t0, w=w, trainer=trainer, out=out, expected=expected)
                kind = row["error"]
                row["epoch"] = epoch
                out["failures"].append(row)
                events.put(("failed", rank))
                if victim and sc.fault == "bad_plan" and kind == "PlanMismatch":
                    w.load_refit_plan(plan.refit_info())  # the controller hands out the right plan
                if victim and sc.fault == "options":
                    await reattach(w, options)  # the controller fixes the setup
                if (kind in _COMM or kind == "Cancelled" or sc.fault == "options") and not rebuilt:
                    epoch += 1
                    await join(w, epoch)
                if len(out["failures"]) > 4:
                    break
        out["final_version"] = w.refit_version if trainer else w.weight_version
        if not trainer:
            out["torn"] = w.torn
            if not w.torn:
                want, have = expected(w.weight_version), w.weights()
                out["exact"] = all(torch.equal(have[k], want[k]) for k in want)
            else:
                out["exact"] = False
        await w.shutdown()
        return out

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        raise SystemExit(130) from None  # 128 + SIGINT, the worker shut down; never SIGABRT


def _replacement(_index: int, rank: int, sc: Scenario, ports: list[dict], events) -> dict[str, Any]:
    return _rank_main(rank, sc, ports, events, 1)


def run_scenario(sc: Scenario, *, timeout_s: float = 150.0) -> dict[str, Any]:
    """Run one scenario in real processes; return its row (see ``run_drill``)."""
    from policyworker.runtime.procs import free_port, process_context, start_world

    if sc.transport == "zmq":
        from policyworker.cli.drill_zmq import run_zmq_scenario

        return _judge(sc, run_zmq_scenario(sc, timeout_s=min(timeout_s, 120.0)))
    if sc.delta:
        from policyworker.cli.drill_delta import delta_checks, run_delta_scenario

        results = run_delta_scenario(sc, timeout_s=min(timeout_s, 120.0))
        row = _judge(sc, results)
        row["checks"].update(delta_checks(results))
        row["passed"] = all(row["checks"].values())
        return row
    if sc.transport == "sglang_ipc":
        from policyworker.cli.drill_sglang import run_sglang_scenario

        return _judge(sc, run_sglang_scenario(sc, timeout_s=min(timeout_s, 120.0)))

    ports = [{"update": free_port(), "stage": free_port()} for _ in range(3)]
    events = process_context().Queue()
    world = start_world(_rank_main, N_TRAIN + N_GEN, (sc, ports, events, 0))
    results = collect_with_replacement(
        world, sc, events, timeout_s, resume_on=dict.fromkeys(("stop_mid", "standdown"), {"failed", "stood_down"}),
        replace=lambda: start_world(_replacement, 1, (sc.victim, sc, ports, events)))
    return _judge(sc, results)


def _judge(sc: Scenario, results: dict[int, dict]) -> dict[str, Any]:
    ranks = [results[r] for r in sorted(results)]
    firsts = [r["failures"][0] for r in ranks if r["failures"]]
    detect = max((f["detect_seconds"] for f in firsts), default=None)
    kinds = sorted({f["error"] for f in firsts})
    recovered = all(r.get("final_version") == REFITS for r in ranks) and all(
        r.get("exact", True) for r in ranks)
    served_torn = any(r["served_torn"] for r in ranks)
    mixed = any(r["mixed"] for r in ranks)
    limit = sc.refit_timeout_s + 2.0
    checks = {
        "detected": bool(firsts) and all(f["error"] in sc.expect for f in firsts if f["version"] == FAULT_VERSION),
        "in_time": detect is not None and detect <= limit,
        "recovered": recovered,
        "no_torn_serving": not served_torn,
        "no_mixed_version": not mixed,
    }
    if sc.fault == "standdown":
        sd = [r["stood_down"] for r in ranks if r["stood_down"]]
        checks["stand_down_counted"] = bool(sd) and all(s["count"] >= 1 for s in sd)
    if sc.fault == "sigint":  # the interrupted process shut down and exited 130, not by SIGABRT
        checks["victim_exit_130"] = ranks[sc.victim].get("victim_exitcode") == 130
    if sc.fault == "options":  # the victim is refused at its connect, before a byte lands: not torn
        checks["untouched"] = not any(f.get("torn") for f in ranks[sc.victim]["failures"])
    if sc.fault == "stale":  # the rollouts never took part in the stale attempt: nothing of it landed
        checks["untouched"] = not any(r["failures"] for r in ranks[N_TRAIN:])
    if sc.fault == "kill_mid" and detect is not None:
        checks["prompt"] = detect < sc.refit_timeout_s  # the transport told before the deadline
    return {
        "name": sc.name,
        "transport": sc.transport,
        "passed": all(checks.values()),
        "detect_seconds": detect,
        "served_torn": served_torn,
        "recovered": recovered,
        "errors": kinds,
        "checks": checks,
        "scenario": asdict(sc),
    }


def run_drill(names: list[str] | None = None, *, on_row=None, jobs: int = 1) -> dict[str, Any]:
    """Run scenarios (all by default), ``jobs`` at a time; rows come back in the given order.

    Scenarios share nothing (fresh ports, private runtime dirs), so they may overlap.
    """
    import concurrent.futures as cf

    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        from policyworker.errors import ConfigError

        raise ConfigError(f"jobs must be an int >= 1, got {jobs!r}")
    order = names or list(SCENARIOS)

    def one(name: str) -> dict[str, Any]:
        sc = SCENARIOS[name]
        try:
            return run_scenario(sc)
        except Exception as exc:  # a scenario that crashed is a failed row, the drill goes on
            return {"name": name, "transport": sc.transport, "passed": False, "detect_seconds": None,
                    "served_torn": False, "recovered": False, "errors": [f"{type(exc).__name__}: {str(exc)[:2000]}"]}

    rows: dict[str, dict[str, Any]] = {}
    with cf.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="drill") as pool:
        futures = {pool.submit(one, name): name for name in order}
        for fut in cf.as_completed(futures):
            row = fut.result()
            rows[futures[fut]] = row
            if on_row is not None:
                on_row(row)
    out = [rows[n] for n in order]
    return {"scenarios": out, "passed": all(r["passed"] for r in out)}
