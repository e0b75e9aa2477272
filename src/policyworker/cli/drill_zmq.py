"""The drill's ``zmq`` rows: a colocated trainer/rollout pair on CPU (shared memory).

World: global rank 0 is the trainer (full "tiny" model), rank 1 its rollout, both on
CPU index 0 of a private runtime dir; ``staged=True`` in 4 KiB buckets, so a refit is
many BucketReady ⇄ BucketDone round trips and "mid-refit" is real. One fault hits
refit v2; the pair then recovers the way a controller would, on the same pair of
sockets: the trainer simply retries its version (its waits take a reconnecting
rollout's Hello), the rollout re-attaches (a new session) and retries. A killed
process is replaced by a new one that attaches and joins at v2. Judged like the
other rows (see :mod:`.drill`).
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

from policyworker.cli.drill_rows import collect_with_replacement, failure_row

REFITS = 3
FAULT_VERSION = 2
TRAINER, ROLLOUT = 0, 1
SETUP = {"staged": True, "bucket_bytes": 4096, "staging": 2, "timeout_s": 20.0}


def zmq_rank_main(rank: int, sc: Any, runtime_dir: str, events, start_epoch: int) -> dict[str, Any]:
    import torch

    from policyworker.errors import PolicyWorkerError
    from policyworker.layout import build_plan, dest_shards
    from policyworker.models import get_preset, seeded_state_dict
    from policyworker.workers.rollout import RolloutWorker
    from policyworker.testing import faults
    from policyworker.models.toy_model import build_model
    from policyworker.workers.torch_trainer import TorchPolicyWorker
    from policyworker.transports.zmq.channel import Channel

    torch.set_num_threads(1)
    config = get_preset("tiny")
    plan = build_plan(config, "tp=1", "tp=1", 1, 1, dtype=torch.float32)
    trainer = rank == TRAINER
    victim = rank == sc.victim and start_epoch == 0
    out: dict[str, Any] = {"rank": rank, "replacement": start_epoch > 0, "failures": [], "served_torn": False,
                           "mixed": False, "stood_down": None}

    def expected(version: int) -> dict[str, torch.Tensor]:
        return dest_shards(plan, 0, seeded_state_dict(config, seed=version, dtype=torch.float32))

    async def main() -> dict[str, Any]:
        kw = dict(rank=0, device="cpu", cpu_index=0, runtime_dir=runtime_dir, timeout_s=30)
        if trainer:
            model = build_model(config, seed=0, dtype=torch.float32)
            w: Any = TorchPolicyWorker(model, world_size=1, **kw)
        else:
            w = RolloutWorker(gen_world_size=1, **kw)
        await w.attach_transport("zmq", plan=plan, **SETUP)
        version = FAULT_VERSION if trainer and start_epoch > 0 else 1
        while version <= REFITS:
            faulty = victim and version == FAULT_VERSION and not out["failures"]
            loop = asyncio.get_running_loop()
            if trainer:
                new = seeded_state_dict(config, seed=version, dtype=torch.float32)
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(new[name])
                refit = asyncio.ensure_future(w.refit("zmq", version=version, refit_timeout_s=sc.refit_timeout_s))
            else:
                refit = asyncio.ensure_future(w.refit("zmq", refit_timeout_s=sc.refit_timeout_s))
            if faulty and sc.fault == "kill_between":
                faults.after_calls(Channel, "expect", 1, faults.signal_self(signal.SIGKILL))
            elif faulty and sc.fault == "kill_mid":
                faults.after_calls(Channel, "expect", 5, faults.signal_self(signal.SIGKILL))
            elif faulty and sc.fault == "stop_mid":
                faults.after_calls(Channel, "expect", 5, faults.signal_self(signal.SIGSTOP))
            elif faulty and sc.fault == "cancel":
                faults.after_calls(Channel, "expect", 5, faults.cancel_task(loop, refit))
            t0 = time.monotonic()
            try:
                rep = await refit
            except (PolicyWorkerError, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and not (faulty and sc.fault == "cancel"):
                    raise
                row = failure_row(exc, version=version, t0=t0, w=w, trainer=trainer, out=out, expected=expected)
                out["failures"].append(row)
                events.put(("failed", rank))
                if len(out["failures"]) > 6:
                    break
                if not trainer:  # a new session on the same socket; the trainer's waits take its Hello
                    try:
                        await w.attach_transport("zmq", plan=plan, **SETUP)
                    except PolicyWorkerError as again:
                        out["failures"].append({"version": version, "error": type(again).__name__,
                                                "detect_seconds": time.monotonic() - t0, "at": "reattach"})
                continue
            if not trainer:
                want, have = expected(rep.version), w.weights()
                out["mixed"] |= not all(torch.equal(have[k], want[k]) for k in want)
                version = rep.version + 1
            else:
                version += 1
        out["final_version"] = w.transport_version("zmq")
        if not trainer:
            out["torn"] = w.torn
            out["exact"] = not w.torn and all(torch.equal(w.weights()[k], v) for k, v in expected(w.weight_version).items())
            out["stale_dropped"] = w.attachment("zmq").transport._chan.stale
        await w.shutdown()
        return out

    return asyncio.run(main())


def _replacement(_index: int, rank: int, sc: Any, runtime_dir: str, events) -> dict[str, Any]:
    return zmq_rank_main(rank, sc, runtime_dir, events, 1)


def run_zmq_scenario(sc: Any, *, timeout_s: float = 120.0) -> dict[str, dict]:
    """Run one zmq scenario in real processes; return the per-rank results."""
    import shutil
    import tempfile

    from policyworker.runtime.procs import process_context, start_world

    runtime_dir = tempfile.mkdtemp(prefix="pwdrill-")  # mode 0700: a private runtime dir
    events = process_context().Queue()
    world = start_world(zmq_rank_main, 2, (sc, runtime_dir, events, 0))
    try:
        return collect_with_replacement(
            world, sc, events, timeout_s, resume_on={"stop_mid": {"failed"}},
            replace=lambda: start_world(_replacement, 1, (sc.victim, sc, runtime_dir, events)))
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
