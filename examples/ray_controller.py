"""An asynchronous RL controller on Ray: trainer actors refit rollout actors over nccl_reshard.

    python examples/ray_controller.py --refits 3
    python examples/ray_controller.py --refits 4 --kill-rollout-at 2

Trainers (one ``TorchPolicyWorker`` each, ``--train`` layout, default tp=2) and rollouts
(one ``RolloutWorker`` each, ``--gen`` layout, default tp=2) are Ray async actors: the
workers run unchanged inside them, on the actor's event loop, and their heavy calls
run on the workers' own executor threads, so the actor keeps answering ``is_alive()``
and ``stand_down_refit_watchdog()`` during a refit. On CPU the groups are gloo; on GPUs
the same code runs NCCL.

Per refit the controller runs a training step stand-in on every trainer (a seeded
update, the same on each trainer: every trainer holds the full model and sends its
shard), then ``refit("nccl_reshard", ...)`` on every side at once, then checks every
rollout tensor bit for bit against ``dest_shards(plan, rank, trainer state)``.

``--kill-rollout-at N``: during refit N one rollout is held in the middle of its
transfer (a fault hook in this file, so that the kill lands mid-refit every time) and
killed with ``ray.kill``. The controller then follows the recipe in README ("Embedding in a controller: Ray, step by step"): it
sees the actor death, stands the trainers' deadlines down, starts a replacement,
re-wires every side on fresh ports (``init_collective`` again, the stage groups, the
plan, ``attach_transport``), sets ``refit_version`` on the trainers, and refit N is
run again; it commits bit-exact.

Everything is bounded: every ``ray.get`` has a timeout, every worker wait its group
timeout, every refit its deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from policyworker import RolloutWorker, TorchPolicyWorker
from policyworker.integrations.ray import RefitWiring, join_rollout, join_trainer, node_free_ports, store_hosts
from policyworker.layout import Parallelism, dest_shards
from policyworker.layout.local import as_plan
from policyworker.models import get_preset
from policyworker.models.toy_model import build_model

TRANSPORT = "nccl_reshard"
# Default setup of nccl_reshard here: small buckets, many messages per refit, so that
# "mid-refit" is a wide window for the fault paths; --bucket-bytes 16777216 (the
# transport's default) for throughput on larger presets.
BUCKET_BYTES, IN_FLIGHT = 4096, 4


def _report(rep: Any) -> dict[str, Any]:
    return {"version": rep.version, "bytes": rep.bytes, "seconds": rep.seconds, "role": rep.role}


def _timed(fn) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


@ray.remote(num_cpus=0)
class Trainer:
    """One trainer rank: a ``TorchPolicyWorker`` over the toy model (the full model on each rank)."""

    def __init__(self, rank: int, train: str, gen: str, preset: str, seed: int, timeout_s: float,
                 reshard: dict[str, int]) -> None:
        torch.set_num_threads(1)
        self.reshard = reshard
        self.rank, self.train, self.gen = rank, Parallelism.parse(train), Parallelism.parse(gen)
        self.model = build_model(get_preset(preset), seed=seed)
        self.worker = TorchPolicyWorker(self.model, rank=rank, world_size=self.train.world_size, device="cpu",
                                        timeout_s=timeout_s)
        self.stage = 0

    def free_ports(self, count: int) -> tuple[str, list[int]]:
        return node_free_ports(count)

    async def join(self, wiring: RefitWiring) -> None:
        mine = wiring.trainer(self.rank)
        self.stage = mine.stage
        await join_trainer(self.worker, mine)

    async def plan(self) -> dict:
        return await self.worker.prepare_nccl_reshard_refit_info(self.train, self.gen, self.train.world_size,
                                                                 self.gen.world_size)

    async def attach(self, info: dict) -> None:
        await self.worker.attach_transport(TRANSPORT, plan=info, group=self.worker.pp_comm_group, stage=self.stage,
                                           **self.reshard)

    async def train_step(self, step: int) -> None:
        """Stand-in for a training step: a seeded update, identical on every trainer.

        Off the loop (a thread), as a real step would be: the actor keeps answering.
        """
        await asyncio.to_thread(self._step, step)

    def _step(self, step: int) -> None:
        gen = torch.Generator().manual_seed(1000 + step)
        with torch.no_grad():
            for _, p in self.model.named_parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype), alpha=0.01)

    async def refit(self, timeout_s: float) -> dict[str, Any]:
        return _report(await self.worker.refit(TRANSPORT, refit_timeout_s=timeout_s))

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def is_alive(self) -> tuple[bool, float]:
        return _timed(self.worker.is_alive)

    def stand_down(self) -> tuple[int, float]:
        return _timed(self.worker.stand_down_refit_watchdog)

    def refit_version(self, value: int | None = None) -> int:
        if value is not None:
            self.worker.refit_version = value
        return self.worker.refit_version

    async def shutdown(self) -> bool:
        return await self.worker.shutdown()


@ray.remote(num_cpus=0)
class Rollout:
    """One generation rank: a ``RolloutWorker`` whose tensors the plan allocates."""

    def __init__(self, rank: int, gen_world_size: int, timeout_s: float, reshard: dict[str, int]) -> None:
        torch.set_num_threads(1)
        self.reshard = reshard
        self.worker = RolloutWorker(rank=rank, gen_world_size=gen_world_size, device="cpu", timeout_s=timeout_s)
        self._held = threading.Event()
        self._release = threading.Event()

    def free_ports(self, count: int) -> tuple[str, list[int]]:
        return node_free_ports(count)

    async def join(self, wiring: RefitWiring) -> None:
        await join_rollout(self.worker, wiring.rollout())

    async def attach(self, info: dict) -> None:
        await self.worker.attach_transport(TRANSPORT, plan=info, groups=self.worker.stage_groups,
                                           **self.reshard)

    async def refit(self, timeout_s: float, hold_after_waits: int | None = None) -> dict[str, Any]:
        if hold_after_waits is not None:
            _hold_after_waits(hold_after_waits, self._held, self._release)
        return _report(await self.worker.refit(TRANSPORT, refit_timeout_s=timeout_s))

    def held(self) -> bool:
        return self._held.is_set()

    def release(self) -> None:
        self._release.set()

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.worker.weight_version, {n: t.clone() for n, t in self.worker.weights().items()}

    def is_alive(self) -> tuple[bool, float]:
        return _timed(self.worker.is_alive)

    def status(self) -> dict[str, Any]:
        """The committed version and the torn mark (a torn rollout refuses to serve)."""
        return {"version": self.worker.weight_version, "torn": self.worker.torn}

    async def shutdown(self) -> bool:
        return await self.worker.shutdown()


def _hold_after_waits(k: int, held: threading.Event, release: threading.Event, bound_s: float = 60.0) -> None:
    """Fault hook: this process's ``k``-th group wait from now blocks (bounded) until released.

    The refit's executor thread stops mid-transfer; the actor's loop keeps answering.
    """
    from policyworker.runtime.comm import CommGroup
    from policyworker.testing.faults import after_calls

    def hold() -> None:
        held.set()
        release.wait(bound_s)

    after_calls(CommGroup, "wait", k, hold)


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    return type(cause if cause is not None else exc).__name__


@dataclass
class Controller:
    """Owns the actors, the epochs (one wiring each) and the refit count; see the module docstring."""

    train: str = "tp=2"
    gen: str = "tp=2"
    preset: str = "tiny"
    timeout_s: float = 30.0        # every worker wait (group formation, point to point)
    refit_timeout_s: float = 30.0  # each refit's deadline
    call_timeout_s: float = 60.0   # every ray.get
    bucket_bytes: int = BUCKET_BYTES
    trainers: list[Any] = field(default_factory=list)
    rollouts: list[Any] = field(default_factory=list)
    info: dict | None = None
    version: int = 0               # the last committed refit
    epoch: int = 0

    def __post_init__(self) -> None:
        self.train_par, self.gen_par = Parallelism.parse(self.train), Parallelism.parse(self.gen)
        self.reshard = {"bucket_bytes": self.bucket_bytes, "in_flight": IN_FLIGHT}  # equal on every rank

    def _get(self, refs: Any, timeout_s: float | None = None) -> Any:
        return ray.get(refs, timeout=timeout_s or self.call_timeout_s)

    def start(self) -> None:
        self.trainers = [Trainer.remote(r, self.train, self.gen, self.preset, 0, self.timeout_s, self.reshard)
                         for r in range(self.train_par.world_size)]
        self.rollouts = [self._new_rollout(g) for g in range(self.gen_par.world_size)]
        self.wire()

    def _new_rollout(self, rank: int) -> Any:
        return Rollout.remote(rank, self.gen_par.world_size, self.timeout_s, self.reshard)

    def wire(self) -> None:
        """One epoch: fresh ports on the hosts' nodes, every side joins, the plan, every side attaches."""
        hosts = store_hosts(self.train_par)
        chosen = dict(zip(hosts, self._get([self.trainers[r].free_ports.remote(len(n)) for r, n in hosts.items()])))
        wiring = RefitWiring.build(self.train_par, self.gen_par, chosen)
        # Collective: every side joins at once (the stores wait for all members).
        self._get([a.join.remote(wiring) for a in self.trainers + self.rollouts])
        if self.info is None:
            self.info = self._get(self.trainers[0].plan.remote())  # the same dict on every trainer
        self._get([a.attach.remote(self.info) for a in self.trainers + self.rollouts])
        self.epoch += 1

    def step(self) -> None:
        self._get([t.train_step.remote(self.version + 1) for t in self.trainers])

    def launch(self, *, hold: tuple[int, int] | None = None) -> dict[str, Any]:
        """Start a refit on every side at once; ``hold=(rollout, k)`` holds that rollout after k waits."""
        t0 = time.perf_counter()
        sends = [t.refit.remote(self.refit_timeout_s) for t in self.trainers]
        recvs = [r.refit.remote(self.refit_timeout_s, hold[1] if hold and hold[0] == g else None)
                 for g, r in enumerate(self.rollouts)]
        return {"sends": sends, "recvs": recvs, "t0": t0}

    def finish(self, inflight: dict[str, Any]) -> dict[str, Any]:
        """Wait for a launched refit; its row (version, seconds, bytes, GB/s)."""
        sends = inflight["sends"]
        reports = self._get(sends + inflight["recvs"])
        wall = time.perf_counter() - inflight["t0"]
        received = sum(r["bytes"] for r in reports[len(sends):])
        self.version = reports[0]["version"]
        return {"version": self.version, "wall_s": wall, "slowest_side_s": max(r["seconds"] for r in reports),
                "bytes": received, "gbps": received / wall / 1e9, "epoch": self.epoch}

    def refit(self) -> dict[str, Any]:
        return self.finish(self.launch())

    def wait_held(self, rollout: int) -> None:
        deadline = time.monotonic() + self.call_timeout_s
        while not self._get(self.rollouts[rollout].held.remote()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout {rollout} never reached its hold point")
            time.sleep(0.01)

    def verify(self) -> bool:
        """Every rollout tensor equals its shard of the trainers' state, bit for bit."""
        states = self._get([t.state.remote() for t in self.trainers])
        same = all(set(s) == set(states[0]) and all(torch.equal(s[k], states[0][k]) for k in s) for s in states)
        plan = as_plan(self.info)
        ok = same
        for g, (version, have) in enumerate(self._get([r.weights.remote() for r in self.rollouts])):
            want = dest_shards(plan, g, states[0])
            ok &= version == self.version and set(want) == set(have) and all(
                torch.equal(have[k], want[k]) for k in want)
        return bool(ok)

    def probe(self) -> dict[str, Any]:
        """``is_alive()`` on every actor and ``stand_down_refit_watchdog()`` on every trainer, timed.

        ``*_call_s``: inside the actor; ``*_rtt_s``: the Ray round trip from here.
        """
        out: dict[str, Any] = {"is_alive": [], "stand_down": []}
        for actor in self.trainers + self.rollouts:
            t0 = time.perf_counter()
            alive, call = self._get(actor.is_alive.remote())
            out["is_alive"].append({"alive": alive, "call_s": call, "rtt_s": time.perf_counter() - t0})
        for t in self.trainers:
            t0 = time.perf_counter()
            count, call = self._get(t.stand_down.remote())
            out["stand_down"].append({"count": count, "call_s": call, "rtt_s": time.perf_counter() - t0})
        return out

    def probe_mid_refit(self, rollout: int, *, hold_after_waits: int = 6) -> dict[str, Any]:
        """A refit with ``rollout`` held mid-transfer: probe every actor (:meth:`probe`), release, finish.

        The stand-down disarms the trainers' deadlines without aborting: the refit still commits.
        """
        idle = self.probe()  # the baseline: the same calls between refits
        inflight = self.launch(hold=(rollout, hold_after_waits))
        self.wait_held(rollout)
        probe = self.probe()
        self._get(self.rollouts[rollout].release.remote())
        row = self.finish(inflight)
        row["probe"], row["probe_idle"], row["held"] = probe, idle, True  # its seconds include the hold
        return row

    def kill_and_recover(self, victim: int, *, hold_after_waits: int = 6) -> dict[str, Any]:
        """The fault recipe around one refit: a rollout dies mid-refit; rebuild; refit again."""
        inflight = self.launch(hold=(victim, hold_after_waits))
        self.wait_held(victim)
        # Mid-refit: the survivors still answer at once.
        alive = [self._get(a.is_alive.remote()) for a in self.trainers]
        ray.kill(self.rollouts[victim], no_restart=True)
        # (1) the controller sees the death: the victim's pending call fails with ActorDiedError.
        try:
            self._get(inflight["recvs"][victim])
            death = None
        except ray.exceptions.RayActorError as exc:
            death = type(exc).__name__
        if death is None:
            raise RuntimeError(f"rollout {victim} finished its refit: the kill did not land mid-refit")
        # (2) stand the trainers' deadlines down: their refits end at the transport's bounds
        # (here: the dead peer's connection error), not by the watchdog's abort.
        stood = [self._get(t.stand_down.remote()) for t in self.trainers]
        # (3) a replacement, then every side joins a new epoch (which also ends any refit
        # still blocked in the old groups) and attaches again.
        self.rollouts[victim] = self._new_rollout(victim)
        self.wire()
        failed = []
        for g, ref in enumerate(inflight["sends"] + inflight["recvs"]):
            if ref is inflight["recvs"][victim]:
                continue
            try:
                self._get(ref)
                failed.append("committed")
            except ray.exceptions.RayTaskError as exc:
                failed.append(_cause(exc))
        survivors = [self._get(r.status.remote()) for g, r in enumerate(self.rollouts) if g != victim]
        # (4) every trainer announces the survivors' count (a replacement trainer would need it).
        self._get([t.refit_version.remote(self.version) for t in self.trainers])
        return {"death": death, "alive_mid_refit": alive, "stood_down": stood, "survivor_errors": failed,
                "survivors": survivors, "epoch": self.epoch}

    def shutdown(self) -> None:
        refs = [a.shutdown.remote() for a in self.trainers + self.rollouts]
        try:
            self._get(refs, 30)
        finally:
            for a in self.trainers + self.rollouts:
                ray.kill(a, no_restart=True)


def _states(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"v{r['version']}{' torn' if r['torn'] else ''}" for r in rows)


def _probe_line(probe: dict[str, Any], idle: dict[str, Any], held: int) -> str:
    def ms(p: dict[str, Any], call: str, key: str) -> str:
        return f"{max(r[key] for r in p[call]) * 1e3:.3f}"

    label = {"is_alive": "is_alive()", "stand_down": "stand_down_refit_watchdog()"}
    parts = [f"{label[call]} max {ms(probe, call, 'call_s')} ms in the actor, {ms(probe, call, 'rtt_s')} ms round trip "
             f"(between refits: {ms(idle, call, 'call_s')} / {ms(idle, call, 'rtt_s')} ms)"
             for call in ("is_alive", "stand_down")]
    counts = ", ".join(str(r["count"]) for r in probe["stand_down"])
    return f"  mid-refit (rollout {held} held): " + "; ".join(parts) + f"; stand-down disarmed {counts}"


def run(args: argparse.Namespace, *, console: Any = None) -> dict[str, Any]:
    """The controller loop; returns one row per refit (and the recovery), for tests and ``--json``."""
    if console is None:
        from rich.console import Console

        console = Console()
    say = console.print
    ctl = Controller(train=args.train, gen=args.gen, preset=args.preset, bucket_bytes=args.bucket_bytes,
                     timeout_s=args.timeout, refit_timeout_s=args.timeout, call_timeout_s=2 * args.timeout)
    t0 = time.perf_counter()
    ctl.start()
    say(f"[bold]ray controller[/]: {len(ctl.trainers)} trainers ({args.train}) → {len(ctl.rollouts)} rollouts "
        f"({args.gen}), preset {args.preset}, {TRANSPORT}; wired in {time.perf_counter() - t0:.2f}s")
    rows, recoveries = [], []
    try:
        while ctl.version < args.refits:
            ctl.step()
            if args.kill_rollout_at == ctl.version + 1 and not recoveries:
                rec = ctl.kill_and_recover(args.victim)
                recoveries.append(rec)
                sd = ", ".join(f"{n} in {s * 1e3:.2f} ms" for n, s in rec["stood_down"])
                say(f"[red]refit v{ctl.version + 1}: rollout {args.victim} killed mid-refit[/] ({rec['death']}); "
                    f"survivors: {', '.join(rec['survivor_errors'])}; stood down {sd}; "
                    f"surviving rollouts {_states(rec['survivors'])}; replacement wired, epoch {rec['epoch']}")
                # The training step is not run again: the same weights are refit once more.
            probing = args.probe_at == ctl.version + 1
            row = ctl.probe_mid_refit(args.victim) if probing else ctl.refit()
            row["bit_exact"] = ctl.verify()
            rows.append(row)
            mark = "[green]bit-exact[/]" if row["bit_exact"] else "[red]MISMATCH[/]"
            say(f"refit [bold]v{row['version']}[/]  {row['wall_s']:.3f} s  {row['gbps']:.3f} GB/s  "
                f"{row['bytes'] / 1e6:.2f} MB to {len(ctl.rollouts)} rollouts  epoch {row['epoch']}  {mark}"
                f"{'  (held for the probe)' if probing else ''}")
            if probing:
                say(_probe_line(row["probe"], row["probe_idle"], args.victim))
    finally:
        ctl.shutdown()
    return {"refits": rows, "recoveries": recoveries, "bit_exact": all(r["bit_exact"] for r in rows) and bool(rows)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--refits", type=int, default=3)
    p.add_argument("--kill-rollout-at", type=int, default=None, metavar="N",
                   help="kill a rollout actor in the middle of refit N, then recover")
    p.add_argument("--probe-at", type=int, default=None, metavar="N",
                   help="during refit N, hold a rollout mid-transfer and time is_alive() / "
                        "stand_down_refit_watchdog() on the actors, then let the refit finish")
    p.add_argument("--victim", type=int, default=1, help="the rollout rank --kill-rollout-at / --probe-at picks")
    p.add_argument("--train", default="tp=2")
    p.add_argument("--gen", default="tp=2")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES,
                   help="nccl_reshard bucket size (small: many messages; 16777216 for throughput)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds: every worker wait and each refit's deadline (ray.get: twice that)")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.refits < 1:
        p.error("--refits must be >= 1")
    for flag, n in (("--kill-rollout-at", args.kill_rollout_at), ("--probe-at", args.probe_at)):
        if n is not None and not 1 <= n <= args.refits:
            p.error(f"{flag} must name one of the refits 1..{args.refits}")
    if args.kill_rollout_at is not None and args.kill_rollout_at == args.probe_at:
        p.error("--kill-rollout-at and --probe-at must name different refits")
    if not 0 <= args.victim < Parallelism.parse(args.gen).world_size:
        p.error(f"--victim must be a rollout rank of {args.gen}")
    return args


def main(argv: list[str] | None = None) -> int:
    import json
    import tempfile

    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory(prefix="pwray") as tmp:
        ray.init(num_cpus=args.num_cpus, _temp_dir=tmp, include_dashboard=False, log_to_driver=False)
        try:
            result = run(args)
        finally:
            ray.shutdown()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
