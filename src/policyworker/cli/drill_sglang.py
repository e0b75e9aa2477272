"""The drill's ``sglang_ipc`` rows: 2 trainer ranks → one in-process engine of tp 2.

The engine (:class:`~policyworker.integrations.sglang.engine.InProcessSglangEngine`) lives on the
gather source (rank 0) and loads into two ``RolloutWorker`` ledgers there; 4 KiB-ish
buckets make a refit many engine calls. One fault hits refit v2: the engine refuses a
bucket (protocol failure: the groups stay healthy, the refit is retried), the engine
never answers (``RefitTimeout``: every rank rebuilds its update group on a fresh
port and reconnects), or the controller cancels rank 0's awaiting refit (rebuild).
After every failure the engine's rollouts must be torn/refusing or intact at their
last committed version; everyone ends at v3, bit-exact.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

REFITS = 3
FAULT_VERSION = 2
WORLD = 2
_REBUILD = ("PeerLost", "RefitAborted", "RefitTimeout", "Cancelled")


def sglang_rank_main(rank: int, sc: Any, ports: list[int]) -> dict[str, Any]:
    import torch

    from policyworker.errors import PolicyWorkerError
    from policyworker.models import get_preset, seeded_state_dict
    from policyworker.workers.rollout import RolloutWorker
    from policyworker.transports.sglang_ipc.client import EngineResult
    from policyworker.integrations.sglang.engine import InProcessSglangEngine
    from policyworker.testing import faults
    from policyworker.models.toy_model import build_model
    from policyworker.workers.torch_trainer import TorchPolicyWorker

    torch.set_num_threads(1)
    config = get_preset("tiny")
    out: dict[str, Any] = {"rank": rank, "failures": [], "served_torn": False, "mixed": False, "stood_down": None}

    async def main() -> dict[str, Any]:
        model = build_model(config, seed=0)
        w = TorchPolicyWorker(model, rank=rank, world_size=WORLD, device="cpu", timeout_s=30)
        epoch = 0

        async def join() -> None:
            await w.init_collective("127.0.0.1", ports[epoch], WORLD, train_world_size=WORLD)
            if "sglang_ipc" not in w.attached_transports():  # the setup, once, through the road
                await w.attach_transport("sglang_ipc", engine_gpu_counts=(WORLD,), engine_gpu_offsets=None,
                                         bucket_bytes=16 << 10)
            else:  # a rejoin: the shim keeps the attached setup
                await w.connect_sglang_rollout_engines(engine_gpu_counts=[WORLD])

        await join()
        rollouts: list[RolloutWorker] = []
        engine: Any = None
        if rank == 0:
            for i in range(WORLD):
                r = RolloutWorker(rank=i, gen_world_size=WORLD, device="cpu", timeout_s=10.0)
                r.params = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
                rollouts.append(r)
            inner = InProcessSglangEngine(rollouts)
            engine = inner
            if sc.fault == "engine_stall":
                engine = faults.StallingEngine(inner, version=FAULT_VERSION, bucket=1)
        refused = False
        version = 1
        while version <= REFITS:
            new = seeded_state_dict(config, seed=version)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(new[name])
            faulty = rank == 0 and version == FAULT_VERSION and not out["failures"]
            refit = asyncio.ensure_future(w.sglang_refit(engine=engine, refit_timeout_s=sc.refit_timeout_s))
            if faulty and sc.fault == "cancel":
                faults.after_calls(InProcessSglangEngine, "update_weights_from_tensor", 2,
                                   faults.cancel_task(asyncio.get_running_loop(), refit))
            if faulty and sc.fault == "refuse" and not refused:
                refused = True
                real = inner.update_weights_from_tensor

                def refuse(request, *, timeout_s=None, _real=real):
                    if request.bucket == 1:
                        inner.update_weights_from_tensor = _real
                        return EngineResult(success=False, message="injected refusal")
                    return _real(request, timeout_s=timeout_s)

                inner.update_weights_from_tensor = refuse
            t0 = time.monotonic()
            try:
                await refit
            except (PolicyWorkerError, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and not (faulty and sc.fault == "cancel"):
                    raise
                kind = "Cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__
                row: dict[str, Any] = {"version": version, "error": kind, "detect_seconds": time.monotonic() - t0}
                for r in rollouts:
                    try:
                        have = r.weights()
                    except PolicyWorkerError:
                        continue
                    out["served_torn"] |= r.torn
                    if r.weight_version:
                        want = seeded_state_dict(config, seed=r.weight_version)
                        out["mixed"] |= not all(torch.equal(have[k], want[k]) for k in want)
                out["failures"].append(row)
                if len(out["failures"]) > 4:
                    break
                if kind in _REBUILD:
                    epoch += 1
                    await join()
                continue
            for r in rollouts:
                have = r.weights()
                out["mixed"] |= r.weight_version != version or not all(torch.equal(have[k], new[k]) for k in new)
            version += 1
        out["final_version"] = w.transport_version("sglang_ipc")
        out["exact"] = all(not r.torn and r.weight_version == REFITS for r in rollouts)
        if engine is not None:
            engine.close()
        await w._run(w.model_update_group.barrier, deadline=time.monotonic() + 30)
        for r in rollouts:
            await r.shutdown()
        await w.shutdown()
        return out

    return asyncio.run(main())


def run_sglang_scenario(sc: Any, *, timeout_s: float = 120.0) -> dict[int, dict]:
    from policyworker.runtime.procs import free_port, start_world

    ports = [free_port() for _ in range(6)]
    return start_world(sglang_rank_main, WORLD, (sc, ports)).collect(timeout_s)
