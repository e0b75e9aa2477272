"""Trainer processes that refit a real vLLM engine: the tests', the demo's and the bench's world.

The controller (the caller's process) holds the vLLM ``LLM``; ``TrainerPool`` spawns
``n`` trainer processes, each a ``TorchPolicyWorker`` over a Hugging Face causal LM
(the full model; rank ``r`` sends its tp shard). Version ``v``'s weights are the
model's own initialisation under ``torch.manual_seed(v)``, so the controller can build
the same weights for the Hugging Face oracle. Commands and replies are plain dicts on
multiprocessing queues between this parent and the children it spawned (local process
control, as in :mod:`policyworker.runtime.procs`); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue as _queue
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from policyworker.errors import PolicyWorkerError
from policyworker.runtime.procs import ProcessFailed, free_ports, process_context, start_process

__all__ = ["TrainerPool", "WorldSpec", "hf_model", "save_hf_model"]


@dataclass
class WorldSpec:
    """The Hugging Face config (``config`` kwargs for ``model_type``), trainer layout, bounds."""

    config: dict[str, Any]
    model_type: str = "qwen3"
    dtype: str = "float32"
    train: str = "tp=2"
    timeout_s: float = 60.0
    refit_timeout_s: float = 60.0
    reshard_options: dict[str, Any] = field(default_factory=dict)

    @property
    def n_train(self) -> int:
        from policyworker.layout.parallelism import Parallelism

        return Parallelism.parse(self.train).world_size

    # What a trainer process runs (a subclass trains something else, e.g. a LoRA adapter).
    def make_worker(self, rank: int) -> Any:
        """Trainer ``rank``'s worker over version 0's model."""
        from policyworker.workers.torch_trainer import TorchPolicyWorker

        return TorchPolicyWorker(hf_model(self, 0), rank=rank, world_size=self.n_train, device="cpu",
                                 timeout_s=self.timeout_s)

    def load(self, worker: Any, version: int) -> None:
        """The stand-in for a training step: the worker's model takes version ``version``'s weights."""
        import torch

        _load(worker.model, hf_model(self, version), torch)

    async def prepare(self, worker: Any, gen_world_size: int, train: str | None = None, **options: Any) -> dict:
        """Plan the worker's refits (``options``: more keyword arguments of the prepare call)."""
        from policyworker.integrations.vllm.plan import prepare_vllm_refit

        return await prepare_vllm_refit(worker, train or self.train, gen_world_size,
                                        **{**self.reshard_options, **options})


def hf_config(spec: WorldSpec) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(spec.model_type, **spec.config)


def hf_model(spec: WorldSpec, seed: int) -> Any:
    """The Hugging Face model with version ``seed``'s weights (deterministic on one machine)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(spec), torch_dtype=getattr(torch, spec.dtype))
    return model.eval()


def save_hf_model(spec: WorldSpec, seed: int, path: str) -> None:
    hf_model(spec, seed).save_pretrained(path, safe_serialization=True)


def shutdown_llm(llm: Any) -> None:
    """Stop a vLLM ``LLM``'s engine core (its processes) now, not at garbage collection."""
    shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
    if shutdown is not None:
        shutdown()


def greedy_tokens(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Hugging Face transformers' greedy continuation of each token-id prompt (the oracle)."""
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


# -- the trainer process ---------------------------------------------------------------
def _trainer_main(rank: int, spec: WorldSpec, commands: Any, replies: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        asyncio.run(_trainer(rank, spec, commands, replies))
    except BaseException as exc:  # report it, then exit: the controller sees the reply
        replies.put({"ok": False, "error": type(exc).__name__, "message": str(exc)[:500], "fatal": True})
        raise


async def _trainer(rank: int, spec: WorldSpec, commands: Any, replies: Any) -> None:
    from policyworker.testing.faults import die_after_waits

    from policyworker.transports.nccl_reshard.relay import NODE_ENV

    w = spec.make_worker(rank)
    model = w.model
    loop = asyncio.get_running_loop()
    own_node = os.environ.get(NODE_ENV)
    while True:
        cmd = await loop.run_in_executor(None, commands.get, True, 600.0)
        kind = cmd["cmd"]
        try:
            if kind == "stop":
                await w.shutdown()
                replies.put({"ok": True})
                return
            if kind == "connect":
                # The node this trainer claims from now on (a fake one puts the trainers on
                # another "node" than the engines, so the refit relays); None: its own.
                node = cmd.get("node") or own_node
                if node is None:
                    os.environ.pop(NODE_ENV, None)
                else:
                    os.environ[NODE_ENV] = node
                w.refit_version = cmd["version"]
                await w.init_collective("127.0.0.1", cmd["update_port"], spec.n_train + cmd["gen_world_size"],
                                        train_world_size=spec.n_train)
                await w.init_nccl_reshard_comm_group(["127.0.0.1"], [cmd["stage_port"]], 1, 0,
                                                     spec.n_train + cmd["gen_world_size"], rank)
                info = await spec.prepare(w, cmd["gen_world_size"], cmd.get("train"), **cmd.get("prepare", {}))
                plan = w.attachment("nccl_reshard").plan
                replies.put({"ok": True, "hash": info["hash"], "total_bytes": plan.total_bytes,
                             "send_bytes": {t.dst: t.nbytes for t in plan.sends(rank)}})
            elif kind == "ceiling":
                seconds = await loop.run_in_executor(None, _ceiling_sends, w, rank, cmd)
                replies.put({"ok": True, "seconds": seconds})
            elif kind == "save":
                t0 = time.perf_counter()
                await loop.run_in_executor(None, functools.partial(model.save_pretrained, cmd["path"],
                                                                   safe_serialization=True))
                replies.put({"ok": True, "seconds": time.perf_counter() - t0})
            elif kind == "load":  # the stand-in for a training step: version v's weights
                spec.load(w, cmd["version"])
                replies.put({"ok": True})
            elif kind == "refit":
                if cmd.get("load", True):
                    spec.load(w, cmd["version"])
                # die_after_waits: SIGKILL after this trainer's k-th wait of the refit;
                # stall_after_waits: SIGSTOP there (frozen until the controller's resume).
                remove = None
                if cmd.get("die_after_waits"):
                    remove = die_after_waits(cmd["die_after_waits"])
                elif cmd.get("stall_after_waits"):
                    remove = die_after_waits(cmd["stall_after_waits"], signal.SIGSTOP)
                t0 = time.perf_counter()
                try:
                    rep = await w.refit("nccl_reshard", kv_scales=cmd.get("kv_scales"),
                                        refit_timeout_s=cmd.get("refit_timeout_s") or spec.refit_timeout_s)
                finally:
                    if remove is not None:  # a refit that ended before the k-th wait: no leak into the next
                        remove()
                replies.put({"ok": True, "version": rep.version, "bytes": rep.bytes, "seconds": rep.seconds,
                             "wall": time.perf_counter() - t0, "notes": list(rep.notes),
                             "wire_bytes": rep.wire_bytes, "kv_scales": rep.kv_scales, "base_bytes": rep.base_bytes})
            else:
                replies.put({"ok": False, "error": "ValueError", "message": f"unknown command {kind!r}"})
        except PolicyWorkerError as exc:
            replies.put({"ok": False, "error": type(exc).__name__, "message": str(exc)[:500]})


def _load(model: Any, fresh: Any, torch: Any) -> None:
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
            p.copy_(q)


def _ceiling_sends(w: Any, rank: int, cmd: dict[str, Any]) -> list[float]:
    """Plain gloo sends of this trainer's plan bytes to each vLLM rank's stand-in, per round."""
    import torch

    from policyworker.runtime.comm import new_group

    plan = w.attachment("nccl_reshard").plan
    sends = [(t.dst, torch.ones(t.nbytes, dtype=torch.uint8)) for t in plan.sends(rank)]
    group = new_group(host="127.0.0.1", port=cmd["port"], rank=rank, world_size=cmd["world_size"],
                      name="ceiling", timeout_s=w.timeout_s)
    try:
        out = []
        for _ in range(cmd["rounds"]):
            group.barrier()
            t0 = time.perf_counter()
            works = [group.isend(buf, cmd["n_train"] + dst) for dst, buf in sends]
            group.wait_all(works)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        group.close()


class TrainerPool:
    """``n_train`` trainer processes, driven by commands; see the module docstring."""

    def __init__(self, spec: WorldSpec) -> None:
        self.spec = spec
        self._ctx = process_context()
        self.procs: list[Any] = [None] * spec.n_train
        self._commands: list[Any] = [None] * spec.n_train
        self._replies: list[Any] = [None] * spec.n_train
        for rank in range(spec.n_train):
            self.start(rank)

    def start(self, rank: int) -> None:
        """(Re)start trainer ``rank`` as a fresh process."""
        commands, replies = self._ctx.Queue(), self._ctx.Queue()
        p = start_process(_trainer_main, (rank, self.spec, commands, replies), env={"OMP_NUM_THREADS": "1"})
        self.procs[rank], self._commands[rank], self._replies[rank] = p, commands, replies

    def send(self, cmd: dict[str, Any], ranks: list[int] | None = None) -> None:
        for r in range(self.spec.n_train) if ranks is None else ranks:
            self._commands[r].put(cmd)

    def reply(self, rank: int, timeout_s: float) -> dict[str, Any]:
        """The next reply of ``rank``; ProcessFailed if it died or ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._replies[rank].get(timeout=0.2)
            except _queue.Empty:
                p = self.procs[rank]
                if not p.is_alive():
                    raise ProcessFailed(f"trainer {rank} exited with code {p.exitcode}",
                                        failures={rank: f"exit code {p.exitcode}"}) from None
                if time.monotonic() > deadline:
                    raise ProcessFailed(f"trainer {rank} did not answer in {timeout_s} s",
                                        failures={rank: "timeout"}) from None

    def replies(self, timeout_s: float, ranks: list[int] | None = None) -> list[dict[str, Any]]:
        return [self.reply(r, timeout_s) for r in (range(self.spec.n_train) if ranks is None else ranks)]

    def connect(self, gen_world_size: int, version: int, train: str | None = None,
                prepare: dict[str, Any] | None = None, node: str | None = None) -> dict[str, Any]:
        """Fresh ports; tell every trainer to join them. Returns the ``init_info`` for vLLM.

        ``train``: plan from this trainer layout (same world size) instead of the spec's;
        ``prepare``: more keyword arguments of the trainers' prepare call; ``node``: the
        node the trainers claim (``POLICYWORKER_NODE``; None: their own)."""
        update_port, stage_port = free_ports(2)
        self.send({"cmd": "connect", "update_port": update_port, "stage_port": stage_port,
                   "gen_world_size": gen_world_size, "version": version, "train": train,
                   "prepare": dict(prepare or {}), "node": node})
        return {"host": "127.0.0.1", "update_port": update_port, "stage_ports": [stage_port],
                "trainers_per_stage": [self.spec.n_train], "timeout_s": self.spec.timeout_s,
                "refit_timeout_s": self.spec.refit_timeout_s, "reshard_options": dict(self.spec.reshard_options)}

    def resume(self, rank: int) -> None:
        """SIGCONT trainer ``rank`` (one that a ``stall_after_waits`` refit froze)."""
        os.kill(self.procs[rank].pid, signal.SIGCONT)

    def wait_dead(self, rank: int, timeout_s: float) -> int | None:
        self.procs[rank].join(timeout_s)
        return self.procs[rank].exitcode

    def close(self, timeout_s: float = 10.0) -> None:
        for r, p in enumerate(self.procs):
            if p is not None and p.is_alive():
                self._commands[r].put({"cmd": "stop"})
        for p in self.procs:
            if p is not None:
                p.join(timeout_s)
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(2.0)
