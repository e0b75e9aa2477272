"""A colocated trainer/rollout world for the zmq transport tests (spawned processes, CPU).

Ranks ``[0, pairs)`` are trainers (``TorchPolicyWorker`` + ``ZmqRefitMixin``, full
model), ranks ``[pairs, 2*pairs)`` their colocated rollouts (same CPU index → same
endpoint). Each refit loads seeded weights into the trainer (in place), refits, and
the rollout checks its tensors bit for bit against the expected shards.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from policyworker.workers.rollout import RolloutWorker

from .helpers import same_bits
from policyworker.workers.torch_trainer import TorchPolicyWorker

# The zmq mixins are part of the workers' own bases.
ZTrainer = TorchPolicyWorker
ZRollout = RolloutWorker


@dataclass
class ZmqSpec:
    preset: str = "tiny"
    gen: str = "tp=1"
    pairs: int = 1
    refits: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    move_at: int | None = None  # refit version before which one trainer param gets a new storage
    refit_timeout_s: float | None = 20.0
    device: str = "cpu"
    double_buffer: bool = False  # the rollout reads served() throughout each transfer
    fp8_kernel: str = ""  # an fp8 kernel variant name (fp8_triton.configure_from_string), "" = the default


def _load(model: torch.nn.Module, config, version: int) -> None:
    from policyworker.models import seeded_state_dict

    new = seeded_state_dict(config, seed=version, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new[name])


def zmq_rank(rank: int, spec: ZmqSpec) -> dict[str, Any]:
    from policyworker.layout import dest_shards
    from policyworker.models import get_preset, seeded_state_dict
    from policyworker.models.toy_model import build_model

    torch.set_num_threads(1)
    if spec.fp8_kernel:
        from policyworker.ops import fp8_triton

        fp8_triton.configure_from_string(spec.fp8_kernel)
    config = get_preset(spec.preset)
    is_trainer = rank < spec.pairs
    g = rank if is_trainer else rank - spec.pairs

    # Pairs meet at an endpoint named by the device id. On CPU each pair has its own
    # index; several pairs on one GPU share the id, so each pair gets its own runtime dir.
    import os

    runtime = None
    if spec.device.startswith("cuda") and spec.pairs > 1:
        runtime = os.path.join(os.environ["POLICYWORKER_RUNTIME_DIR"], f"pair{g}")

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"rank": rank, "outcomes": []}
        if is_trainer:
            model = build_model(config, seed=0, dtype=torch.float32).to(spec.device)
            w: Any = ZTrainer(model, rank=g, world_size=spec.pairs, device=spec.device, cpu_index=g, timeout_s=30.0,
                                  runtime_dir=runtime)
            info = await w.prepare_zmq_refit_info(spec.gen, spec.pairs)
        else:
            from policyworker.layout import build_plan

            w = ZRollout(rank=g, gen_world_size=spec.pairs, device=spec.device, cpu_index=g, timeout_s=30.0,
                                  runtime_dir=runtime, double_buffer=spec.double_buffer)
            plan = build_plan(config, "tp=1", spec.gen, 1, spec.pairs, dtype=torch.float32)
            w.load_colocated_plan(plan.refit_info())
            info = plan.refit_info()
        # The setup, through the road with the plan just wired (the shims keep it).
        await w.attach_transport("zmq", connect=False, plan=info, timeout_s=w.zmq_timeout_s, **spec.options)
        out["hash"] = info["hash"]
        for version in range(1, spec.refits + 1):
            row: dict[str, Any] = {"version": version}
            t0 = time.perf_counter()
            try:
                if is_trainer:
                    if spec.move_at == version:
                        name, p = w._params[1]
                        p.data = p.data.clone()  # a new storage: the transport must re-export it
                    _load(model, config, version)
                    rep = await w.stream_weights_via_ipc_zmq(kv_scales={"k": 0.5 * version},
                                                             refit_timeout_s=spec.refit_timeout_s)
                else:
                    refit = asyncio.ensure_future(w.update_weights_via_ipc_zmq(refit_timeout_s=spec.refit_timeout_s))
                    if spec.double_buffer:
                        from .refit_world import read_while, weights_of

                        old = dest_shards(plan, g, weights_of(config, w.weight_version, torch.float32))
                        row["mid"] = await read_while(refit, w, old)
                    rep = await refit
                    want = dest_shards(w._refit_transport_state("zmq")["plan"], g,
                                       seeded_state_dict(config, seed=version, dtype=torch.float32))
                    have = w.weights()
                    row["exact"] = set(want) == set(have) and all(same_bits(have[k].cpu(), want[k]) for k in want)
                    row["kv_scales"], row["report_kv_scales"] = w.kv_scales, rep.kv_scales
                    row["weight_version"] = w.weight_version
                row.update(ok=True, bytes=rep.bytes, notes=list(rep.notes), buckets=rep.buckets,
                           peak_extra=rep.peak_extra_bytes, report_version=rep.version)
            except Exception as exc:  # noqa: BLE001 - the test asserts on the error type
                row.update(ok=False, error=type(exc).__name__, message=str(exc))
            row["seconds"] = time.perf_counter() - t0
            out["outcomes"].append(row)
        if is_trainer:
            out["reexports"] = w._refit_transport_state("zmq").get("reexports", 0)
        else:
            out["expected_bytes"] = w._refit_transport_state("zmq")["plan"].recv_bytes_per_dst_rank()[g]
            out["staging_bytes"] = w.staging_bytes
        await w.shutdown()
        return out

    return asyncio.run(main())
