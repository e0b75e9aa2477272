"""A refit world for tests: trainers and rollouts as real processes.

``refit_rank`` is the body of one process. Trainers hold seeded shards of a preset in
the training layout (rule-based, or DTensors sharded FSDP-style over dp), rollouts
receive them in the generation layout; every refit uses new weights (seed = version)
and each rollout checks its tensors bit for bit after each commit.

Faults (``spec.fault``), injected on train rank 0 for one version:
``drop_last_bucket`` (a bucket never sent) and ``flip_byte`` (a byte flipped in flight).

``spec.landing`` (a dict): the rollouts land every other destination on demand
(``TransportContext.landing``) through :class:`OnDemandLanding`, which records the
calls, copies each landed tensor into the rollout's real set and can fail one call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from policyworker import PolicyWorkerError, RolloutWorker
from policyworker.testing.faults import FlippingGroup, MutedGroup
from policyworker.layout import Parallelism, build_plan, dest_shards, source_shards
from policyworker.models import get_preset, param_specs, seeded_state_dict

from .helpers import ShardTrainer, same_bits


@dataclass
class RefitSpec:
    preset: str
    train: str
    gen: str
    refits: int = 2
    dtype: str = "float32"
    source: str = "rules"  # or "dtensor" (FSDP-style Shard(0) over all trainers)
    vocab_size: int | None = None  # override, for uneven shards
    overrides: dict[str, Any] = field(default_factory=dict)  # other ModelConfig fields
    update_port: int = 0
    stage_ports: list[int] = field(default_factory=list)
    train_port: int = 0  # the trainers' own default group (dtensor source)
    options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 60.0
    refit_timeout_s: float | None = None
    fault: dict[str, Any] | None = None
    kv_scales_entries: int = 1  # kv scales per refit (hundreds: past the verdict's inline bytes)
    double_buffer: bool = False  # rollouts land in a second set and read weights() mid-transfer
    go_on_after_failure: bool = False  # both sides keep refitting after a failed one
    nodes: list[str] | None = None  # node of each process (trainers, then rollouts): POLICYWORKER_NODE
    die_in_fanout: tuple[int, int] | None = None  # (generation rank, version): exits inside the relay phase
    landing: dict[str, Any] | None = None  # on-demand destinations: {"fail": {refit index: "open"/"landed"}}

    @property
    def train_par(self) -> Parallelism:
        return Parallelism.parse(self.train)

    @property
    def gen_par(self) -> Parallelism:
        from policyworker.layout.formats import split_gen_layout

        return Parallelism.parse(split_gen_layout(self.gen)[0])  # "tp=2,fp8=block128" too

    @property
    def config(self):
        config = get_preset(self.preset)
        if self.vocab_size is not None:
            config = dataclasses.replace(config, vocab_size=self.vocab_size)
        return dataclasses.replace(config, **self.overrides) if self.overrides else config


def _dtensor_plan(spec: RefitSpec, dtype: torch.dtype):
    """The plan for FSDP-style dp shards, built without DTensors (rollouts have none)."""
    from torch.distributed.tensor import Shard

    from policyworker.layout import placement_layout, plan_from_layouts, rule_layout

    specs = {n: (tuple(s), str(dtype).removeprefix("torch.")) for n, (s, _) in param_specs(spec.config, dtype).items()}
    n_train = spec.train_par.world_size
    entries = {n: (s, dtype, torch.arange(n_train), [Shard(0)]) for n, (s, _) in specs.items()}
    src = placement_layout(entries, world_size=n_train)
    dst = rule_layout(specs, spec.gen_par, config=spec.config, fused=True)
    return plan_from_layouts(specs, src, dst, train=spec.train_par, gen=spec.gen_par, gen_fused=True)


def _inject(w, spec: RefitSpec, version: int) -> None:
    if not spec.fault or spec.fault["version"] != version:
        return
    kind = spec.fault["kind"]
    state = w._refit_transport_state("nccl_reshard")
    if kind == "drop_last_bucket":
        # The header still announces every bucket; the last one is simply never sent.
        last = [m for m in state["schedule"] if m.copies is not None][-1]
        last.group = MutedGroup(last.group)
    elif kind == "flip_byte":
        # Corrupt the first bucket on the wire, after its checksum was computed.
        first = [m for m in state["schedule"] if m.copies is not None][0]
        first.group = FlippingGroup(first.group)
    else:
        raise ValueError(kind)


def _trainer(rank: int, spec: RefitSpec, plan, dtype) -> dict[str, Any]:
    train, gen = spec.train_par, spec.gen_par
    n_train, n_gen = train.world_size, gen.world_size
    config = spec.config

    def shards(version: int) -> dict[str, torch.Tensor]:
        return source_shards(plan, rank, seeded_state_dict(config, seed=version, dtype=dtype))

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"outcomes": []}
        local = shards(0)
        source: Any = config
        params: Any = local
        if spec.source == "dtensor":
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.train_port}", rank=rank,
                                    world_size=n_train)
            mesh = init_device_mesh("cpu", (n_train,), mesh_dim_names=("dp",))
            full = seeded_state_dict(config, seed=0, dtype=dtype)
            params = source = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
            local = {n: t.to_local() for n, t in params.items()}
        w = ShardTrainer(local_params=params, source=source, rank=rank, world_size=n_train,
                         device="cpu", timeout_s=spec.timeout_s)
        await w.init_collective("127.0.0.1", spec.update_port, n_train + n_gen, train_world_size=n_train)
        stage = train.coords(rank).pp_stage
        members = list(train.stage_ranks(stage))
        await w.init_nccl_reshard_comm_group(["127.0.0.1"] * train.pp, spec.stage_ports, train.pp, stage,
                                             len(members) + n_gen, members.index(rank))
        info = await w.prepare_nccl_reshard_refit_info(train, spec.gen, n_train, n_gen)
        await w.attach_transport("nccl_reshard", connect=False, plan=info, group=w.pp_comm_group, stage=stage,
                                 **spec.options)
        out["hash"] = info["hash"]
        for version in range(1, spec.refits + 1):
            for name, t in shards(version).items():
                local[name].copy_(t)
            if rank == 0:
                _inject(w, spec, version)
            try:
                rep = await w.nccl_reshard_refit(kv_scales=kv_scales(spec, version),
                                                 refit_timeout_s=spec.refit_timeout_s)
                out["outcomes"].append({"ok": True, "version": rep.version, "bytes": rep.bytes,
                                        "seconds": rep.seconds, "peak_extra_bytes": rep.peak_extra_bytes})
            except PolicyWorkerError as exc:
                out["outcomes"].append({"ok": False, "error": type(exc).__name__, "message": str(exc)[:300]})
                if not spec.go_on_after_failure:
                    break  # the groups may be aborted: recovery is a separate scenario
        await w.shutdown()
        return out

    return asyncio.run(main())


def kv_scales(spec: RefitSpec, version: int) -> dict[str, float]:
    """The kv scales trainer rank 0 sends with refit ``version``."""
    if spec.kv_scales_entries == 1:
        return {"layer0.k": 0.5 * version}
    return {f"model.layers.{i}.self_attn.k_scale": 0.5 * version + i for i in range(spec.kv_scales_entries)}


class OnDemandLanding:
    """A consumer of on-demand destinations: every other destination of the worker becomes a
    ``meta`` placeholder; ``open`` makes a fresh tensor, ``landed`` copies it into the real
    set (``real``, what the test checks) and drops it. Records the order of the calls, the
    most bytes open at once, and fails a call: ``fail`` maps a refit (the rollout's loop
    index) to "open" (its third open) or "landed" (its first hand-over)."""

    def __init__(self, w: RolloutWorker, fail: dict[int, str] | None = None) -> None:
        self.real = dict(w.params)
        self.placeholders = {n: torch.empty(t.shape, dtype=t.dtype, device="meta")
                             for i, (n, t) in enumerate(self.real.items()) if i % 2 == 0}
        w.params = {**self.real, **self.placeholders}
        w.landing = self
        self.fail, self.version = fail or {}, 0
        self.opened: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[int, str, str]] = []
        self.bytes_open = self.peak = 0

    def open(self, name: str) -> torch.Tensor:
        self.calls.append((self.version, "open", name))
        if self.fail.get(self.version) == "open" \
                and sum(1 for v, kind, _ in self.calls if v == self.version and kind == "open") == 3:
            raise MemoryError("test: no memory for the third landing tensor")
        like = self.placeholders[name]
        t = self.opened[name] = torch.full(like.shape, 7, dtype=like.dtype)
        self.bytes_open += t.numel() * t.element_size()
        self.peak = max(self.peak, self.bytes_open)
        return t

    def landed(self, name: str) -> None:
        self.calls.append((self.version, "landed", name))
        if self.fail.get(self.version) == "landed":
            raise RuntimeError("test: post-processing failed")
        t = self.opened.pop(name, None)
        if t is not None:
            self.real[name].copy_(t)
            self.bytes_open -= t.numel() * t.element_size()

    def start(self, version: int) -> None:
        self.version = version
        self.opened.clear()
        self.bytes_open = 0

    def summary(self) -> dict[str, Any]:
        return {"calls": self.calls, "peak": self.peak, "names": sorted(self.real),
                "placeholders": sorted(self.placeholders),
                "placeholder_bytes": sum(t.numel() * t.element_size() for t in self.placeholders.values()),
                "largest": max(t.numel() * t.element_size() for t in self.placeholders.values())}


def _served(w: RolloutWorker, landing: OnDemandLanding | None) -> dict[str, torch.Tensor]:
    have = w.weights()  # raises while torn or mid-refit
    return landing.real if landing is not None else have


def _rollout(g: int, spec: RefitSpec, plan, dtype) -> dict[str, Any]:
    train, gen = spec.train_par, spec.gen_par
    n_train, n_gen = train.world_size, gen.world_size

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"outcomes": [], "hash": plan.hash}
        w = RolloutWorker(rank=g, gen_world_size=n_gen, device="cpu", timeout_s=spec.timeout_s,
                          double_buffer=spec.double_buffer)
        await w.init_collective("127.0.0.1", spec.update_port, n_train + n_gen, train_world_size=n_train)
        await w.init_nccl_reshard_comm_groups(["127.0.0.1"] * train.pp, spec.stage_ports,
                                              [len(train.stage_ranks(s)) for s in range(train.pp)])
        w.load_refit_plan(plan.refit_info())
        await w.attach_transport("nccl_reshard", connect=False, plan=plan, groups=w.stage_groups, **spec.options)
        landing = OnDemandLanding(w, **spec.landing) if spec.landing is not None else None
        served = 0  # the last committed version
        version_box = [0]
        if spec.die_in_fanout is not None and spec.die_in_fanout[0] == g:
            _die_in_fanout(version_box, spec.die_in_fanout[1])
        for version in range(1, spec.refits + 1):
            version_box[0] = version
            if landing is not None:
                landing.start(version)
            t0 = time.perf_counter()
            refit = asyncio.ensure_future(w.receive_nccl_reshard_refit(refit_timeout_s=spec.refit_timeout_s))
            mid = await read_while(refit, w, dest_shards(plan, g, weights_of(spec.config, served, dtype))) \
                if spec.double_buffer else None
            try:
                rep = await refit
            except PolicyWorkerError as exc:
                out["outcomes"].append({"ok": False, "error": type(exc).__name__, "torn": w.torn,
                                        "weight_version": w.weight_version, "mid": mid, "message": str(exc)[:300]})
                try:
                    have = _served(w, landing)
                    want = dest_shards(plan, g, weights_of(spec.config, served, dtype))
                    out["serves_after_failure"] = True
                    out["serves_exact"] = all(same_bits(have[k], want[k]) for k in want)
                except PolicyWorkerError as serve_exc:
                    out["serves_after_failure"] = type(serve_exc).__name__
                if spec.go_on_after_failure:
                    continue
                break
            served = version
            want = dest_shards(plan, g, seeded_state_dict(spec.config, seed=version, dtype=dtype))
            have = _served(w, landing)
            exact = set(want) == set(have) and all(same_bits(have[k], want[k]) for k in want)
            out["outcomes"].append({"ok": True, "exact": exact, "version": rep.version, "bytes": rep.bytes,
                                    "seconds": time.perf_counter() - t0, "kv_scales": w.kv_scales,
                                    "report_kv_scales": rep.kv_scales, "peak_extra_bytes": rep.peak_extra_bytes, "mid": mid})
        out["weight_version"] = w.weight_version
        out["staging_bytes"] = w.staging_bytes
        out["landing"] = landing.summary() if landing is not None else None
        out["recv_expected"] = plan.recv_bytes_per_dst_rank()[g]
        await w.shutdown()
        return out

    return asyncio.run(main())


def weights_of(config, version: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full weights of ``version`` (0: the zeros a rollout allocates before any refit)."""
    full = seeded_state_dict(config, seed=max(version, 1), dtype=dtype)
    return {n: torch.zeros_like(t) for n, t in full.items()} if version == 0 else full


async def read_while(refit: asyncio.Future, w: RolloutWorker, want: dict[str, torch.Tensor]) -> dict[str, int]:
    """Read ``served()`` while ``refit`` runs; count reads made in flight and exact ones."""
    reads = in_flight = exact = 0
    while not refit.done():
        before = w.ledger.in_flight
        version, have = w.served()
        ok = set(have) == set(want) and all(same_bits(have[k], want[k]) for k in want)
        if before and w.ledger.in_flight:
            in_flight += 1
            exact += int(ok and version == w.weight_version)
        reads += 1
        await asyncio.sleep(0)
    return {"reads": reads, "in_flight": in_flight, "exact": exact}


def _die_in_fanout(version_box: list[int], version: int) -> None:
    """Make this process exit (as a SIGKILL would leave it: no clean-up) inside the relay
    phase of refit ``version``, as it posts its second fan-out message (its first is out)."""
    import os

    from policyworker.transports.nccl_reshard import relay as nccl_relay

    real = nccl_relay.post_fanout
    posted = [0]

    def dying(*args, **kwargs):
        if version_box[0] == version:
            posted[0] += 1
            if posted[0] == 2:
                os._exit(17)
        return real(*args, **kwargs)

    nccl_relay.post_fanout = dying


def refit_rank(rank: int, spec: RefitSpec) -> dict[str, Any]:
    torch.set_num_threads(1)
    if spec.nodes is not None:
        import os

        from policyworker.transports.nccl_reshard.relay import NODE_ENV

        os.environ[NODE_ENV] = spec.nodes[rank]
    dtype = getattr(torch, spec.dtype)
    train, gen = spec.train_par, spec.gen_par
    if spec.source == "dtensor":
        plan = _dtensor_plan(spec, dtype)
    else:
        plan = build_plan(spec.config, train, spec.gen, train.world_size, gen.world_size, dtype=dtype)
    if rank < train.world_size:
        return _trainer(rank, spec, plan, dtype)
    return _rollout(rank - train.world_size, spec, plan, dtype)
