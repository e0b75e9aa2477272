"""The drill's delta rows: ``nccl_reshard`` with ``delta=True``, a rollout killed mid-delta.

World: 2 trainers (tp=2) → 2 rollouts (tp=2), the "tiny" preset in bf16 over gloo.
Weights change by 2% of their elements per version (lowest bits flipped, seeded by the
version, replayed in every process): v1 is full (no shadow yet), v2 is a delta — and
the victim rollout kills itself after its first payload wait of v2 began. The
survivors move to new groups (the next epoch), where a replacement process (version
0, fresh tensors) joins; v2 is retried and must be *full* (the replacement's base is
not the trainers'), v3 a delta again. Judged like the other rows (:mod:`.drill`), plus
``full_after_replacement`` and ``delta_after_recovery``.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

from policyworker.cli.drill_rows import collect_with_replacement, failure_row, join_groups

N_TRAIN = N_GEN = 2
REFITS = 3
FAULT_VERSION = 2
FRACTION = 0.02
_COMM = ("PeerLost", "RefitAborted", "RefitTimeout")


def delta_rank_main(rank: int, sc: Any, ports: list[dict], events, start_epoch: int) -> dict[str, Any]:
    import torch

    from policyworker.errors import PolicyWorkerError
    from policyworker.layout import build_plan, dest_shards
    from policyworker.models import get_preset, seeded_state_dict
    from policyworker.workers.rollout import RolloutWorker
    from policyworker.testing import faults
    from policyworker.testing.delta_weights import versioned_state
    from policyworker.models.toy_model import build_model
    from policyworker.workers.torch_trainer import TorchPolicyWorker

    torch.set_num_threads(1)
    config = get_preset("tiny")
    dtype = torch.bfloat16
    trainer = rank < N_TRAIN
    plan = build_plan(config, "tp=2", "tp=2", N_TRAIN, N_GEN, dtype=dtype)
    base = seeded_state_dict(config, seed=0, dtype=dtype)
    options = {"delta": True, "bucket_bytes": 4096}
    victim = rank == sc.victim and start_epoch == 0
    out: dict[str, Any] = {"rank": rank, "replacement": start_epoch > 0, "failures": [], "served_torn": False,
                           "mixed": False, "stood_down": None, "modes": {}}

    def state(version: int) -> dict[str, torch.Tensor]:
        return versioned_state(base, [FRACTION] * version)

    def expected(version: int) -> dict[str, torch.Tensor]:
        return dest_shards(plan, rank - N_TRAIN, state(version))

    async def join(w, epoch: int) -> None:
        await join_groups(w, ports[epoch], trainer=trainer, rank=rank, n_train=N_TRAIN, n_gen=N_GEN)

    async def main() -> dict[str, Any]:
        epoch = start_epoch
        if trainer:
            model = build_model(config, seed=0, dtype=dtype)
            w: Any = TorchPolicyWorker(model, rank=rank, world_size=N_TRAIN, device="cpu", timeout_s=60)
            await join(w, epoch)
            info = await w.prepare_nccl_reshard_refit_info("tp=2", "tp=2", N_TRAIN, N_GEN)
            # The setup, given through the road with the wiring just built; the shims keep it.
            await w.attach_transport("nccl_reshard", connect=False, plan=info, group=w.pp_comm_group, stage=0,
                                     **options)
        else:
            w = RolloutWorker(rank=rank - N_TRAIN, gen_world_size=N_GEN, device="cpu", timeout_s=60)
            await join(w, epoch)
            w.load_refit_plan(plan.refit_info())
            await w.attach_transport("nccl_reshard", connect=False, plan=plan.refit_info(), groups=w.stage_groups,
                                     **options)
        while True:
            # (a replacement rollout at version 0 receives whatever comes next: the retried v2)
            version = (w.refit_version if trainer else w.weight_version) + 1
            if version > REFITS:
                break
            if victim and version == FAULT_VERSION and not out["failures"]:
                # waits of a delta on the receiver: the handshake's two (its row sent, the
                # answer), one header, then the payload: it dies waiting for the payload
                faults.die_after_waits(4, signal.SIGKILL)
            t0 = time.monotonic()
            try:
                if trainer:
                    new = state(version)
                    with torch.no_grad():
                        for name, p in model.named_parameters():
                            p.copy_(new[name])
                    rep = await w.nccl_reshard_refit(refit_timeout_s=sc.refit_timeout_s)
                else:
                    rep = await w.receive_nccl_reshard_refit(refit_timeout_s=sc.refit_timeout_s)
                    want, have = expected(rep.version), w.weights()
                    if not all(torch.equal(have[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want):
                        out["mixed"] = True
                out["modes"][rep.version] = "delta" if rep.notes[-1].startswith("delta") else "full"
            except PolicyWorkerError as exc:
                row = failure_row(exc, version=version, t0=t0, w=w, trainer=trainer, out=out, expected=expected)
                row["epoch"] = epoch
                out["failures"].append(row)
                events.put(("failed", rank))
                if row["error"] in _COMM:
                    epoch += 1
                    await join(w, epoch)
                if len(out["failures"]) > 4:
                    break
        out["final_version"] = w.refit_version if trainer else w.weight_version
        if not trainer:
            out["torn"] = w.torn
            out["exact"] = not w.torn and all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in ((w.weights()[k], v) for k, v in expected(w.weight_version).items()))
        await w.shutdown()
        return out

    return asyncio.run(main())


def _replacement(_index: int, rank: int, sc: Any, ports: list[dict], events) -> dict[str, Any]:
    return delta_rank_main(rank, sc, ports, events, 1)


def run_delta_scenario(sc: Any, *, timeout_s: float = 150.0) -> dict[int, dict]:
    """Run the world of one delta scenario; the caller judges the results."""

    from policyworker.runtime.procs import free_port, process_context, start_world

    ports = [{"update": free_port(), "stage": free_port()} for _ in range(3)]
    events = process_context().Queue()
    world = start_world(delta_rank_main, N_TRAIN + N_GEN, (sc, ports, events, 0))
    return collect_with_replacement(world, sc, events, timeout_s, resume_on={},
                                    replace=lambda: start_world(_replacement, 1, (sc.victim, sc, ports, events)))


def delta_checks(results: dict[int, dict]) -> dict[str, bool]:
    """The delta row's own checks: the retried v2 was full everywhere, v3 a delta."""
    modes = [r.get("modes", {}) for r in results.values()]
    return {"full_after_replacement": all(m.get(FAULT_VERSION) == "full" for m in modes),
            "delta_after_recovery": all(m.get(REFITS) == "delta" for m in modes)}
