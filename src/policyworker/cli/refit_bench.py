"""A measured refit world: trainers → rollouts over nccl_reshard, with its own ceiling.

Used by ``policyworker demo`` and ``policyworker bench --transport nccl_reshard``.
Every process is real: trainers are ``TorchPolicyWorker`` s holding the full model
(each sends its training-layout shard as views of it), rollouts are ``RolloutWorker`` s
in the generation layout. Per refit, every trainer loads new weights (seeded by the
version: the stand-in for a training step), all ranks meet at a barrier, the refit
runs, and each rollout checks every tensor bit for bit against the expected shard.

The ceiling is measured in the same run, between the same processes, with the same
pattern of traffic: every (trainer, rollout) pair of the plan moves the same number
of bytes as one plain gloo/NCCL send of a preallocated contiguous buffer, all pairs
at once. Ceiling and refit are interleaved — ceiling, refit v1, ceiling, refit v2, …
(each ceiling the median of ``ceiling_rounds`` = 3 back-to-back rounds)
— so each refit has a ceiling measured moments before it in the same processes, and
a busy moment on a shared machine slows both of a pair. Times are the slowest rank's
wall time. ``ratio_to_ceiling`` is the median over steady pairs of (ceiling seconds ÷
refit seconds); ``ratio_spread`` gives its min / quartiles / max and the number of
pairs. The first refit (cold: first touch of buffers and plan caches) is reported
apart in ``cold_refit`` and left out of the steady figures. ``ratio_to_best_ceiling``
divides the steady median refit GB/s by the best ceiling round of the run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from policyworker.errors import ConfigError, PlanError
from policyworker.layout import Parallelism, build_plan, dest_shards, empty_local_tensors, source_shards
from policyworker.layout.formats import BlockFp8Format, split_gen_layout
from policyworker.cli.output import ratio_spread
from policyworker.runtime.procs import free_port, process_context, start_world

__all__ = ["RefitBenchSpec", "run_refit_bench"]


@dataclass
class RefitBenchSpec:
    preset: str = "small"
    train: str = "tp=2,pp=2"
    gen: str = "tp=2,dp=2"
    refits: int = 3
    dtype: str = "bfloat16"
    bucket_bytes: int = 16 << 20
    in_flight: int = 16
    staging: int = 2
    checksum: bool = False
    ceiling_rounds: int = 3          # ceiling rounds before each refit; their median is its pair
    timeout_s: float = 120.0
    verify: bool = True
    # "flat": each trainer holds its training-layout shards in one buffer (as
    # Megatron's distributed optimizer keeps parameters); "views": it holds the full
    # model and sends views of it (row-parallel shards are then strided).
    trainer_params: str = "flat"
    ports: dict[str, Any] = field(default_factory=dict)

    @property
    def train_par(self) -> Parallelism:
        return Parallelism.parse(self.train)

    @property
    def gen_par(self) -> Parallelism:
        return Parallelism.parse(split_gen_layout(self.gen)[0])  # gen may carry fp8=block128

    def validate(self) -> None:
        """Check every argument and build the plan once, here, before any process starts.

        Raises ``ConfigError`` / ``PlanError`` with one line: bad input never reaches the
        ranks (where it would fail once per process, after the world formed).
        """
        from policyworker.models import get_preset

        if self.refits < 2:
            raise ConfigError(f"refits must be >= 2 (the first is cold and reported apart), got {self.refits}")
        for name in ("bucket_bytes", "in_flight", "staging", "ceiling_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout_s!r}")
        if self.trainer_params not in ("flat", "views"):
            raise ConfigError(f"trainer_params must be 'flat' or 'views', got {self.trainer_params!r}")
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"dtype must name a torch floating dtype (e.g. bfloat16), got {self.dtype!r}")
        train, gen = self.train_par, self.gen_par
        build_plan(get_preset(self.preset), train, self.gen, train.world_size, gen.world_size, dtype=dtype)


def _max_over(group, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=group.device)
    group.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _ceiling(w, plan, spec: RefitBenchSpec, is_trainer: bool, rank: int, stage_groups: dict,
             rounds: int) -> list[float]:
    """Wall seconds (slowest rank) of plain sends of each pair's bytes, all pairs at once."""
    from policyworker.transports.nccl_reshard.transport import stage_members

    members = stage_members(plan)
    if is_trainer:
        stage = next(s for s, m in enumerate(members) if rank in m)
        pairs = [(t, stage_groups[stage], len(members[stage]) + t.dst) for t in plan.sends(rank)]
    else:
        pairs = [(t, stage_groups[t.stage], members[t.stage].index(t.src)) for t in plan.receives(rank)]
    dev = w.device
    bufs = [torch.empty(t.nbytes, dtype=torch.uint8, device=dev) for t, _, _ in pairs]
    for b in bufs:
        b.fill_(1)  # touch the pages: fresh buffers would measure page faults, not the wire
    out = []
    for _ in range(rounds):
        w.model_update_group.barrier()
        t0 = time.perf_counter()
        works = [(g, g.isend(b, peer) if is_trainer else g.irecv(b, peer)) for (t, g, peer), b in zip(pairs, bufs)]
        for g, work in works:
            g.wait(work)
        out.append(_max_over(w.model_update_group, time.perf_counter() - t0))
    return out


def _rank_main(rank: int, spec: RefitBenchSpec, events) -> dict[str, Any]:
    from policyworker.runtime import device as _device
    from policyworker.models import get_preset, seeded_state_dict
    from policyworker.models.toy_model import build_model
    from policyworker.workers.rollout import RolloutWorker
    from policyworker.workers.torch_trainer import TorchPolicyWorker

    torch.set_num_threads(1)
    config = get_preset(spec.preset)
    dtype = getattr(torch, spec.dtype)
    train, gen = spec.train_par, spec.gen_par
    n_train, n_gen = train.world_size, gen.world_size
    is_trainer = rank < n_train
    options = {"bucket_bytes": spec.bucket_bytes, "in_flight": spec.in_flight, "staging": spec.staging,
               "checksum": spec.checksum}
    ip = "127.0.0.1"
    stage_ports = spec.ports["stages"]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"rank": rank, "role": "trainer" if is_trainer else "rollout", "refits": []}
        if is_trainer:
            model = build_model(config, seed=0, dtype=dtype)
            shards = None
            if spec.trainer_params == "flat":
                own_plan = build_plan(config, train, spec.gen, n_train, n_gen, dtype=dtype)
                shards = empty_local_tensors(own_plan, "src", rank, flat=True)
                for name, t in source_shards(own_plan, rank, dict(model.named_parameters())).items():
                    shards[name].copy_(t)
            w: Any = TorchPolicyWorker(model, rank=rank, world_size=n_train, device="cpu",
                                       timeout_s=spec.timeout_s, refit_params=shards)
            await w.init_collective(ip, spec.ports["update"], n_train + n_gen, train_world_size=n_train)
            stage = train.coords(rank).pp_stage
            members = list(train.stage_ranks(stage))
            await w.init_nccl_reshard_comm_group([ip] * train.pp, stage_ports, train.pp, stage,
                                                 len(members) + n_gen, members.index(rank))
            info = await w.prepare_nccl_reshard_refit_info(train, spec.gen, n_train, n_gen)
            # The same plan, computed here (deterministic) rather than read out of the
            # worker's transport state, whose keys are the core's business.
            plan = own_plan if spec.trainer_params == "flat" else build_plan(config, train, spec.gen, n_train, n_gen,
                                                                               dtype=dtype)
            if plan.hash != info["hash"]:
                raise PlanError("the bench's plan differs from the worker's", rank=rank)
            stage_groups = {stage: w.pp_comm_group}
            # The setup, given through the road with the wiring just built; the shims keep it.
            await w.attach_transport("nccl_reshard", connect=False, plan=info, group=w.pp_comm_group, stage=stage,
                                     **options)
            out["hash"] = info["hash"]
        else:
            g = rank - n_train
            w = RolloutWorker(rank=g, gen_world_size=n_gen, device="cpu", timeout_s=spec.timeout_s)
            await w.init_collective(ip, spec.ports["update"], n_train + n_gen, train_world_size=n_train)
            await w.init_nccl_reshard_comm_groups([ip] * train.pp, stage_ports,
                                                  [len(train.stage_ranks(s)) for s in range(train.pp)])
            plan = build_plan(config, train, spec.gen, n_train, n_gen, dtype=dtype)
            w.load_refit_plan(plan.refit_info())
            stage_groups = w.stage_groups
            await w.attach_transport("nccl_reshard", connect=False, plan=plan, groups=stage_groups, **options)
            out["hash"] = plan.hash
        events.put((rank, "joined", 0))
        my_rank = rank if is_trainer else rank - n_train
        # One unpaired round first: the ceiling's own first touch of its buffers.
        out["ceiling_warmup_s"] = await w._run(_ceiling, w, plan, spec, is_trainer, my_rank, stage_groups, 1)
        out["ceiling_s"] = []
        events.put((rank, "ceiling", 0))
        for version in range(1, spec.refits + 1):
            if is_trainer:
                new = seeded_state_dict(config, seed=version, dtype=dtype)
                with torch.no_grad():
                    if shards is None:
                        for name, p in model.named_parameters():
                            p.copy_(new[name])
                    else:
                        for name, t in source_shards(plan, rank, new).items():
                            shards[name].copy_(t)
                del new
            # This refit's ceiling, measured right before it (after the weight load).
            out["ceiling_s"].append(await w._run(_ceiling, w, plan, spec, is_trainer, my_rank, stage_groups,
                                                 max(1, spec.ceiling_rounds)))
            await w._run(w.model_update_group.barrier)
            _device.reset_peak_memory("cpu")
            rss0 = _device.rss_bytes()
            t0 = time.perf_counter()
            if is_trainer:
                rep = await w.nccl_reshard_refit(kv_scales={"model.layers.0.self_attn.k_scale": 1.0 + version})
            else:
                rep = await w.receive_nccl_reshard_refit()
            seconds = time.perf_counter() - t0
            extra = max(0, _device.peak_memory_bytes("cpu") - rss0)
            wall = await w._run(_max_over, w.model_update_group, seconds)
            row = {"version": rep.version, "seconds": seconds, "wall_seconds": wall, "bytes": rep.bytes,
                   "ring_bytes": rep.peak_extra_bytes, "peak_extra_bytes": extra}
            if not is_trainer and spec.verify:
                want = dest_shards(plan, my_rank, seeded_state_dict(config, seed=version, dtype=dtype))
                have = w.weights()
                row["bit_exact"] = set(want) == set(have) and all(_same(have[k], want[k]) for k in want)
                row["kv_scales"] = w.kv_scales
                row["expected_bytes"] = plan.recv_bytes_per_dst_rank()[my_rank]
            out["refits"].append(row)
            events.put((rank, "refit", version))
        await w.shutdown()
        return out

    return asyncio.run(main())


def run_refit_bench(spec: RefitBenchSpec, *, on_event=None) -> dict[str, Any]:
    """Run the world; return the JSON-ready summary (see ``policyworker demo --json``)."""
    import queue

    spec.validate()
    train, gen = spec.train_par, spec.gen_par
    spec.ports = {"update": free_port(), "stages": [free_port() for _ in range(train.pp)]}
    n = train.world_size + gen.world_size
    events = process_context().Queue()
    world = start_world(_rank_main, n, (spec, events))

    def tick() -> None:
        while True:
            try:
                ev = events.get_nowait()
            except queue.Empty:
                return
            if on_event is not None:
                on_event(*ev)

    results = world.collect(spec.timeout_s * (spec.refits + 3), on_tick=tick)
    tick()
    ranks = [results[r] for r in range(n)]
    plan = build_plan(_config(spec), train, spec.gen, train.world_size, gen.world_size,
                      dtype=getattr(torch, spec.dtype))
    total = plan.total_bytes
    rollouts = ranks[train.world_size:]
    refits = []
    for i in range(spec.refits):
        wall = ranks[0]["refits"][i]["wall_seconds"]
        ceiling_s = statistics.median(ranks[0]["ceiling_s"][i])
        refits.append({"version": ranks[0]["refits"][i]["version"], "seconds": wall, "bytes": total,
                       "gbps": total / wall / 1e9, "ceiling_seconds": ceiling_s,
                       "ceiling_gbps": total / ceiling_s / 1e9, "ratio_to_ceiling": ceiling_s / wall,
                       "cold": i == 0})
    # Steady pairs: every refit after the first (all of them when there is only one).
    steady = refits[1:] or refits
    ratios = [r["ratio_to_ceiling"] for r in steady]
    ratio = statistics.median(ratios)
    ceiling_gbps = statistics.median(r["ceiling_gbps"] for r in steady)
    all_ceilings = [s for rounds in ranks[0]["ceiling_s"] for s in rounds]
    best_ceiling_gbps = total / min(all_ceilings) / 1e9
    gbps_median = statistics.median(r["gbps"] for r in steady)
    received = sum(r["refits"][-1]["bytes"] for r in rollouts)
    bit_exact = all(row.get("bit_exact", False) for r in rollouts for row in r["refits"]) if spec.verify else None
    ring = max(row["ring_bytes"] for r in ranks for row in r["refits"])
    steady_extra = max((row["peak_extra_bytes"] for r in ranks for row in r["refits"][1:]), default=0)
    return {
        "transport": "nccl_reshard",
        "device": "cpu",
        "backend": "gloo",
        "preset": spec.preset,
        "dtype": spec.dtype,
        "layouts": {"train": str(train), "gen": str(gen)},
        "fp8": plan.dest_format.block if isinstance(plan.dest_format, BlockFp8Format) else None,
        "processes": n,
        "bucket_bytes": spec.bucket_bytes,
        "in_flight": spec.in_flight,
        "trainer_params": spec.trainer_params,
        "staging": spec.staging,
        "refits": refits,
        "bit_exact": bit_exact,
        "committed_versions": [r["refits"][-1]["version"] for r in rollouts],
        "ceiling_gbps": ceiling_gbps,
        "gbps_median": gbps_median,
        "ratio_to_ceiling": ratio,
        "ratio_method": "median over steady (ceiling, refit) pairs of ceiling_s / refit_s; "
                        "ceiling measured right before each refit in the same processes",
        "ratio_spread": ratio_spread(ratios),
        "cold_refit": {k: refits[0][k] for k in ("version", "seconds", "gbps", "ceiling_gbps", "ratio_to_ceiling")},
        "steady_refits": len(steady) if len(refits) > 1 else 0,
        "best_ceiling_gbps": best_ceiling_gbps,
        "ratio_to_best_ceiling": gbps_median / best_ceiling_gbps,
        "ceiling_seconds": all_ceilings,
        "ceiling_warmup_seconds": ranks[0]["ceiling_warmup_s"],
        "bytes_moved": received,
        "min_bytes": plan.min_bytes,
        "bytes_over_min": received / plan.min_bytes,
        "ring_bytes_per_process": ring,
        "bucket_x_staging": spec.bucket_bytes * spec.staging,
        "peak_extra_bytes_per_process_steady": steady_extra,
        "plan_hash": plan.hash,
        "spec": {k: v for k, v in asdict(spec).items() if k != "ports"},
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:  # no torch.equal for float8 on CPU
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _config(spec: RefitBenchSpec):
    from policyworker.models import get_preset

    return get_preset(spec.preset)
