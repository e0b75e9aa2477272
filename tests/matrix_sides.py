"""One side of one transport in the failure matrix: build, refit, fault points, recovery.

Each class is one process's view (``trainer`` or ``rollout``) of a 2-process world
(``memory``: both sides in one process). The trainer's bytes of version ``v`` are
``seeded_state_dict(seed=v)`` (``seed`` overrides it: a stale attempt's other bytes);
a rollout's reference is computed independently in its own process from the version it
committed (``reference``), never taken from the wire.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from policyworker import RolloutWorker, TorchPolicyWorker
from policyworker.layout import build_plan, dest_shards
from policyworker.models import get_preset, seeded_state_dict
from policyworker.models.toy_model import build_model

from .matrix_cells import OWN_BOUND_S, ZMQ_TIMEOUT_S

PRESET = "tiny"
CONFIG = get_preset(PRESET)
#: Small buckets / files: a refit is many messages, so "mid-bulk" is a real point.
NCCL_SETUP = {"bucket_bytes": 4096, "in_flight": 4}
SGLANG_SETUP = {"bucket_bytes": 16 << 10}


def weights(seed: int) -> dict[str, torch.Tensor]:
    return seeded_state_dict(CONFIG, seed=seed, dtype=torch.float32)


def load(model: torch.nn.Module, seed: int) -> None:
    new = weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new[name])


class Side:
    """Common shape; see the module docstring. ``cell`` is the cell's dict (ports, dirs, pids)."""

    transport = ""
    #: (object, attribute) whose k-th call is the fault point: k=1 before the bulk, k=MID mid-bulk.
    MID = 4
    SIGINT_AT: int | None = None  # default MID
    SIGINT_HOLD_S = 0.0  # see signal_self(hold_s=)

    def __init__(self, name: str, cell: dict[str, Any]) -> None:
        self.name, self.cell = name, cell
        self.stand_down_cell = cell["fault"] == "stand_down"
        self.timeout_s = OWN_BOUND_S if self.stand_down_cell else 30.0
        self.w: Any = None
        self.model = None
        self.epoch = 0

    # trainer: the refit of version v sends seed's bytes
    def _load(self, version: int, seed: int | None) -> None:
        load(self.model, version if seed is None else seed)

    def hook(self) -> tuple[Any, str] | None:
        return None

    def live(self) -> dict[str, torch.Tensor]:
        return self.w.params

    def reference(self, version: int) -> dict[str, torch.Tensor]:
        return weights(version)

    def rollouts(self) -> list[RolloutWorker]:
        return [self.w]

    def workers(self) -> list[Any]:
        return [self.w]

    async def mismatch(self, kind: str) -> None:
        raise NotImplementedError

    async def unmismatch(self, kind: str) -> None:
        raise NotImplementedError


# -- nccl_reshard over gloo: 1 trainer (tp=1) -> 1 rollout (tp=1) -------------------------
class NcclSide(Side):
    transport = "nccl_reshard"

    def plan(self, dtype=torch.float32):
        return build_plan(CONFIG, "tp=1", "tp=1", 1, 1, dtype=dtype)

    async def open(self, epoch: int) -> None:
        self.epoch = epoch
        if self.name == "trainer":
            self.model = build_model(CONFIG, seed=0, dtype=torch.float32)
            self.w = TorchPolicyWorker(self.model, rank=0, world_size=1, device="cpu", timeout_s=self.timeout_s)
        else:
            self.w = RolloutWorker(rank=0, gen_world_size=1, device="cpu", timeout_s=self.timeout_s)
        await self._join()
        # The setup, through the road with the wiring just built; the shims keep it on every rejoin.
        if self.name == "trainer":
            info = await self.w.prepare_nccl_reshard_refit_info("tp=1", "tp=1", 1, 1)
            await self.w.attach_transport("nccl_reshard", connect=False, plan=info, group=self.w.pp_comm_group,
                                          stage=0, **NCCL_SETUP)
        else:
            self.w.load_refit_plan(self.plan().refit_info())
            await self.w.attach_transport("nccl_reshard", connect=False, plan=self.plan(),
                                          groups=self.w.stage_groups, **NCCL_SETUP)

    async def _attach_setup(self, setup: dict[str, Any]) -> None:
        """Attach nccl_reshard again with ``setup``, its plan and wiring kept (it connects at the
        next refit, after the shims re-wire whatever changed meanwhile)."""
        att = self.w.attachment("nccl_reshard")
        wiring = {k: v for k, v in att.raw_setup.items() if k in ("group", "stage", "groups")}
        await self.w.attach_transport("nccl_reshard", connect=False, plan=att.plan, **wiring, **setup)

    async def _join(self) -> None:
        ports = self.cell["ports"][self.epoch]
        await self.w.init_collective("127.0.0.1", ports[0], 2, train_world_size=1)
        if self.name == "trainer":
            await self.w.init_nccl_reshard_comm_group(["127.0.0.1"], [ports[1]], 1, 0, 2, 0)
        else:
            await self.w.init_nccl_reshard_comm_groups(["127.0.0.1"], [ports[1]], [1])

    async def recover(self, epoch: int) -> None:
        self.epoch = epoch
        await self._join()

    async def fresh_connect(self) -> None:
        """Both sides join a new world (the last epoch's ports): every attachment connects
        again at the next refit, so the connect check runs on every rank."""
        await self.recover(len(self.cell["ports"]) - 1)

    async def refit(self, version: int, timeout: float, seed: int | None = None):
        if self.name == "trainer":
            self._load(version, seed)
            self.w.refit_version = version - 1
            return await self.w.nccl_reshard_refit(refit_timeout_s=timeout)
        return await self.w.receive_nccl_reshard_refit(refit_timeout_s=timeout)

    def hook(self):
        from policyworker.runtime.comm import CommGroup

        return CommGroup, "wait"

    def reference(self, version: int):
        return dest_shards(self.plan(), 0, weights(version))

    async def mismatch(self, kind: str) -> None:
        if kind == "options":
            await self._attach_setup({**NCCL_SETUP, "bucket_bytes": 2 * NCCL_SETUP["bucket_bytes"]})
        else:  # destinations of another plan (bf16), given explicitly: the committed ones are kept aside
            from policyworker.layout.apply import empty_local_tensors

            bad = self.plan(torch.bfloat16)
            self._kept = self.w.params
            self.w.load_refit_plan(bad.refit_info(),
                                   params={k: v.zero_() for k, v in
                                           empty_local_tensors(bad, "dst", 0, "cpu", flat=True).items()})

    async def unmismatch(self, kind: str) -> None:
        if kind == "options":
            await self._attach_setup(NCCL_SETUP)
        else:
            self.w.load_refit_plan(self.plan().refit_info(), params=self._kept)


class NcclLandingSide(NcclSide):
    """nccl_reshard whose rollout lands every other destination on demand
    (``RolloutWorker.landing``, as vLLM's ``staging="none"`` does): a ``meta`` placeholder,
    opened just before its first message and handed over (copied into the consumer's
    real set, which is what it serves) once complete. The fault points are nccl_reshard's
    (mid-bulk: some destinations open, some handed over). After a failed refit returns, no
    hand-over may follow (``landed_late``: what the consumer got in the half second after)."""

    transport = "nccl_landing"
    SETTLE_S = 0.5

    async def open(self, epoch: int) -> None:
        await super().open(epoch)
        if self.name == "rollout":
            from .refit_world import OnDemandLanding

            self.landing = OnDemandLanding(self.w)

    def live(self) -> dict[str, torch.Tensor]:
        return self.landing.real if self.name == "rollout" else self.w.params

    async def refit(self, version: int, timeout: float, seed: int | None = None):
        if self.name == "trainer":
            return await super().refit(version, timeout, seed)
        self.landing.start(version)
        try:
            return await super().refit(version, timeout, seed)
        finally:
            self._calls_at_return = len(self.landing.calls)

    async def after_step(self) -> dict[str, Any]:
        import anyio

        await anyio.sleep(self.SETTLE_S)
        late = [c for c in self.landing.calls[self._calls_at_return:] if c[1] == "landed"]
        return {"landed_late": len(late), "landing_calls": len(self.landing.calls)}


# -- zmq: a colocated pair on CPU index 0 of a private runtime dir -------------------------
class ZmqSide(Side):
    transport = "zmq"
    MID = 5

    def setup(self) -> dict[str, Any]:
        timeout = OWN_BOUND_S if self.stand_down_cell else ZMQ_TIMEOUT_S
        return {"staged": True, "bucket_bytes": 4096, "staging": 2, "timeout_s": timeout}

    def plan(self, dtype=torch.float32):
        return build_plan(CONFIG, "tp=1", "tp=1", 1, 1, dtype=dtype)

    async def open(self, epoch: int) -> None:
        kw = dict(rank=0, device="cpu", cpu_index=0, runtime_dir=self.cell["dir"], timeout_s=self.timeout_s)
        if self.name == "trainer":
            self.model = build_model(CONFIG, seed=0, dtype=torch.float32)
            self.w = TorchPolicyWorker(self.model, world_size=1, **kw)
        else:
            self.w = RolloutWorker(gen_world_size=1, **kw)
        self._reattach = False
        await self.w.attach_transport("zmq", plan=self.plan(), **self.setup())

    async def recover(self, epoch: int) -> None:
        # The rollout re-attaches (a new session) inside its next call; the trainer retries.
        self._reattach = self.name == "rollout"

    async def refit(self, version: int, timeout: float, seed: int | None = None):
        if self.name == "trainer":
            self._load(version, seed)
            return await self.w.refit("zmq", version=version, refit_timeout_s=timeout)
        if self._reattach:
            await self.w.attach_transport("zmq", plan=self.plan(), **self.setup())
            self._reattach = False
        return await self.w.refit("zmq", refit_timeout_s=timeout)

    def hook(self):
        from policyworker.transports.zmq.channel import Channel

        return Channel, "expect"

    def reference(self, version: int):
        return dest_shards(self.plan(), 0, weights(version))

    async def mismatch(self, kind: str) -> None:
        from policyworker.layout.apply import empty_local_tensors

        bad = self.plan(torch.bfloat16)
        self._kept = self.w.params
        self.w.params = {k: v.zero_() for k, v in empty_local_tensors(bad, "dst", 0, "cpu", flat=True).items()}
        self._bad_plan = bad
        self._reattach = "bad"

    async def unmismatch(self, kind: str) -> None:
        self.w.params = self._kept
        self._reattach = True

    async def refit_mismatched(self, timeout: float):
        self._reattach = False
        await self.w.attach_transport("zmq", plan=self._bad_plan, **self.setup())
        return await self.w.refit("zmq", refit_timeout_s=timeout)


# -- files: a shared directory (plugin) -----------------------------------------------------
class FilesSide(Side):
    transport = "files"
    MID = 3

    def setup(self) -> dict[str, Any]:
        return {"directory": self.cell["dir"], "fsync": False, "file_bytes": 8192,
                "timeout_s": OWN_BOUND_S if self.stand_down_cell else 30.0}

    async def open(self, epoch: int) -> None:
        self.model = build_model(CONFIG, seed=0, dtype=torch.float32)
        if self.name == "trainer":
            self.w = TorchPolicyWorker(self.model, rank=0, world_size=1, device="cpu", timeout_s=self.timeout_s)
        else:
            params = {n: torch.zeros_like(p.detach()) for n, p in self.model.named_parameters()}
            self.w = RolloutWorker(rank=0, gen_world_size=1, params=params, device="cpu", timeout_s=self.timeout_s)
        await self.w.attach_transport("files", **self.setup())

    async def recover(self, epoch: int) -> None:
        return None  # nothing documented: the directory is the channel

    async def refit(self, version: int, timeout: float, seed: int | None = None):
        if self.name == "trainer":
            version = self.w.transport_version("files") + 1  # the writer continues its numbering
            self._load(version, seed)
            return await self.w.refit("files", refit_timeout_s=timeout)
        return await self.w.refit("files", refit_timeout_s=timeout)

    def hook(self):
        if self.name == "trainer":
            from policyworker_files import writer

            return writer, "_write_file"
        return torch, "frombuffer"  # the reader's copy: one call per tensor

    async def mismatch(self, kind: str) -> None:
        self._kept = self.w.params
        bad = dict(self._kept)
        name = next(iter(bad))
        bad[name] = torch.zeros(bad[name].numel() + 1, dtype=bad[name].dtype)
        self.w.params = bad

    async def unmismatch(self, kind: str) -> None:
        self.w.params = self._kept
        await self.w.attach_transport("files", **self.setup())

    async def refit_mismatched(self, timeout: float):
        await self.w.attach_transport("files", **self.setup())
        return await self.w.refit("files", refit_timeout_s=timeout)


class FilesDeltaSide(FilesSide):
    """The files plugin in delta mode: version ``v`` is :func:`delta_weights` (``v``), so
    every version after the first is written as a delta. Fault points: the writer's
    encoding of a tensor (mid-version: some delta blobs written, none committed); the
    reader's ``torch.frombuffer`` of a tensor's blob while it applies a delta (mid-replay)."""

    transport = "files_delta"

    def setup(self) -> dict[str, Any]:
        return {**super().setup(), "delta": True}

    def _load(self, version: int, seed: int | None) -> None:
        new = delta_weights(version)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(new[name])

    def reference(self, version: int) -> dict[str, torch.Tensor]:
        return delta_weights(version)

    def hook(self):
        if self.name == "trainer":
            from policyworker.layout import delta

            return delta, "encode"
        return torch, "frombuffer"


def delta_weights(version: int) -> dict[str, torch.Tensor]:
    """Version 0's weights with ~2% of the elements' lowest bit flipped per version after it."""
    from policyworker.testing.delta_weights import versioned_state

    return versioned_state(weights(0), [0.02] * version)


# -- memory: both sides in one process, one hub -----------------------------------------------
class MemorySide(Side):
    transport = "memory"

    async def open(self, epoch: int) -> None:
        self.model = build_model(CONFIG, seed=0, dtype=torch.float32)
        timeout = OWN_BOUND_S if self.stand_down_cell else 30.0
        if self.name == "trainer":
            self.w = TorchPolicyWorker(self.model, rank=0, world_size=1, device="cpu", timeout_s=self.timeout_s)
        else:
            params = {n: torch.zeros_like(p.detach()) for n, p in self.model.named_parameters()}
            self.w = RolloutWorker(rank=0, gen_world_size=1, params=params, device="cpu", timeout_s=self.timeout_s)
        await self.w.attach_transport("memory", hub=self.cell["hub"], timeout_s=timeout)

    async def recover(self, epoch: int) -> None:
        return None

    async def refit(self, version: int, timeout: float, seed: int | None = None):
        if self.name == "trainer":
            self._load(version, seed)
            return await self.w.refit("memory", version=version, refit_timeout_s=timeout)
        return await self.w.refit("memory", refit_timeout_s=timeout)


# -- sglang_ipc: 2 trainer ranks -> the in-process engine (tp 2) on rank 0 ---------------------
class SglangSide(Side):
    """``rollout`` = trainer rank 0 with the engine and its 2 rollouts; ``trainer`` = rank 1."""

    transport = "sglang_ipc"
    MID = 2
    SIGINT_AT = 1  # rank 1 has few waits: interrupted later, its part may be complete already
    # Its executor holds still after sending the signal, past the refit deadline: the interrupt
    # lands mid-refit, and rank 0 never sees rank 1's part complete (it would commit the refit).
    SIGINT_HOLD_S = 4.5

    async def open(self, epoch: int) -> None:
        from policyworker.integrations.sglang.engine import InProcessSglangEngine

        self.epoch = epoch
        self.rank = 0 if self.name == "rollout" else 1
        self.model = build_model(CONFIG, seed=0, dtype=torch.float32)
        self.w = TorchPolicyWorker(self.model, rank=self.rank, world_size=2, device="cpu", timeout_s=self.timeout_s)
        self._setup = SGLANG_SETUP
        self._rollouts: list[RolloutWorker] = []
        self.engine = None
        if self.rank == 0:
            for i in range(2):
                r = RolloutWorker(rank=i, gen_world_size=2, device="cpu", timeout_s=10.0)
                r.params = {n: torch.zeros_like(p.detach()) for n, p in self.model.named_parameters()}
                self._rollouts.append(r)
            self.engine = InProcessSglangEngine(self._rollouts)
        await self._join()

    async def _join(self) -> None:
        await self.w.init_collective("127.0.0.1", self.cell["ports"][self.epoch][0], 2, train_world_size=2)
        await self._attach()

    async def _attach(self) -> None:
        """The engine layout with this side's setup, through the road (as connect_sglang_rollout_engines
        attaches: a tuple of counts, no offsets)."""
        await self.w.attach_transport("sglang_ipc", engine_gpu_counts=(2,), engine_gpu_offsets=None, **self._setup)

    async def recover(self, epoch: int) -> None:
        self.epoch = epoch
        await self._join()

    async def refit(self, version: int, timeout: float, seed: int | None = None):
        self._load(version, seed)
        # Explicit versions: a replacement rank announces the survivors' version (the recipe).
        return await self.w.refit("sglang_ipc", version=version, engine=self.engine, refit_timeout_s=timeout)

    def hook(self):
        if self.rank == 0:
            from policyworker.integrations.sglang.engine import InProcessSglangEngine

            return InProcessSglangEngine, "update_weights_from_tensor"
        from policyworker.runtime.comm import CommGroup

        return CommGroup, "wait"

    def live(self) -> dict[str, torch.Tensor]:
        return {f"{i}.{k}": v for i, r in enumerate(self._rollouts) for k, v in r.params.items()}

    def reference(self, version: int):
        want = weights(version)
        return {f"{i}.{k}": v for i in range(len(self._rollouts)) for k, v in want.items()}

    def rollouts(self) -> list[RolloutWorker]:
        return self._rollouts

    def workers(self) -> list[Any]:
        return [*self._rollouts, self.w]

    async def mismatch(self, kind: str) -> None:
        self._setup = {"bucket_bytes": 2 * SGLANG_SETUP["bucket_bytes"]}  # attached by refit_mismatched

    async def unmismatch(self, kind: str) -> None:
        self._setup = SGLANG_SETUP  # attached at the next rejoin

    async def refit_mismatched(self, timeout: float):
        await self._attach()
        return await self.refit(2, timeout)

    async def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


SIDES = {c.transport: c for c in (NcclSide, NcclLandingSide, ZmqSide, FilesSide, FilesDeltaSide, MemorySide,
                                   SglangSide)}


def side_names(transport: str, rank: int) -> list[str]:
    """Which sides process ``rank`` of a transport's world runs."""
    if transport == "memory":
        return ["trainer", "rollout"]
    if transport == "sglang_ipc":
        return ["rollout", "trainer"][rank:rank + 1]
    return ["trainer", "rollout"][rank:rank + 1]


def world_size(transport: str) -> int:
    return 1 if transport == "memory" else 2


def pid() -> int:
    return os.getpid()
