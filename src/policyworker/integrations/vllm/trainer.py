"""The ``"policyworker"`` trainer engine of vLLM's trainer API (``WeightTransferTrainerFactory``).

vLLM 0.32 lets a trainer refit an engine without knowing the transport: every trainer
rank calls ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``
and then ``engine.send_weights()`` once per update, where ``init_info``'s class picks
the backend by name (``NCCLTrainerInitInfo`` → ``"nccl"``), ``client`` is the engine's
control plane (vLLM's HTTP or Ray client, :class:`LLMWeightSyncClient` for an offline
``LLM`` in this process, or anything with its four methods) and ``source`` yields the
trainer's ``(name, full tensor)`` pairs (``ModuleSource(model)``). With
:class:`PolicyworkerTrainerInitInfo` the same controller refits through this library's
road instead: each trainer rank sends only the boxes each vLLM rank loads, point to
point (``nccl_reshard``: gloo on CPU, NCCL on GPU), into the engine's
``"policyworker"`` backend (:mod:`.vllm`), committed by vLLM's own post-processing.

Registration: the ``vllm.general_plugins`` entry point (:func:`.vllm.register`) also
registers this trainer engine; a trainer process that never starts vLLM runs vLLM's own
``vllm.plugins.load_general_plugins()`` (or :func:`register_trainer`) first.

Each rank: ``trainer_init`` joins the update group (hosted by trainer rank 0 at
``host:update_port``) and the stage group (``stage_port``), while the sender (rank 0)
has the engine join them through ``client.init_weight_transfer_engine``; every rank then
reads the engine ranks' needs and builds the same plan (rank 0 publishes it), checked
against the tensors of a first pass over ``source``. ``send_weights`` iterates ``source``
(every rank, in lockstep: for FSDP the iteration is the all-gather) and sends version
``v + 1`` (``v``: ``init_info.version``, then each update's); the sender drives ``start_weight_update`` → ``update_weights({"version":
v + 1})`` (concurrently with the sends) → ``finish_weight_update(str(v + 1))``. Every
wait is bounded (``timeout_s``, ``refit_timeout_s``); a failed update raises on every
rank, the engine keeps serving ``v`` and the version does not advance.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from policyworker.errors import ConfigError, PolicyWorkerError, ProtocolError
from policyworker.workers.trainer import AbstractPolicyWorker

__all__ = ["BACKEND", "LLMWeightSyncClient", "PolicyworkerTrainerInitInfo", "PolicyworkerTrainerWeightTransferEngine",
           "register_trainer"]

BACKEND = "policyworker"
logger = logging.getLogger(__name__)


def register_trainer() -> None:
    """Register trainer engine ``"policyworker"`` with vLLM's ``WeightTransferTrainerFactory`` (lazily)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "PolicyworkerTrainerWeightTransferEngine")
    except ValueError:
        pass  # registered already (plugins may run more than once per process): the first stands


@dataclass
class PolicyworkerTrainerInitInfo(TrainerInitInfo):
    """Trainer-side ``init_info`` (``rank`` is this trainer's rank; rank 0 sends the RPCs).

    ``host``/``update_port``: the update group's store, hosted by trainer rank 0;
    ``stage_port``: the stage group's (also on ``host``); ``world_size``: trainer ranks;
    ``gen_world_size``: the engine's ranks (its tp size; all engines' when several share
    the group). ``train``: the trainers' layout for the plan (default ``tp=<world_size>``:
    each rank sends its tp shard of the full tensors ``source`` yields). ``version``: the
    version the engine serves now. ``engine_init``: more ``init_info`` keys for the
    engine's backend (``commit``, ``cpu_linear``, ``rank_offset``; see the README).
    """

    backend: ClassVar[str] = BACKEND

    host: str
    update_port: int
    stage_port: int
    world_size: int
    gen_world_size: int
    train: str | None = None
    version: int = 0
    timeout_s: float = 120.0
    refit_timeout_s: float | None = 120.0
    device: str | None = None
    reshard_options: dict[str, Any] = field(default_factory=dict)
    engine_init: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for value, what, low in ((self.rank, "rank", 0), (self.update_port, "update_port", 0),
                                 (self.stage_port, "stage_port", 0), (self.world_size, "world_size", 1),
                                 (self.gen_world_size, "gen_world_size", 1), (self.version, "version", 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"init_info.{what} must be an int >= {low}, got {value!r}")
        if self.rank >= self.world_size:
            raise ConfigError(f"init_info.rank {self.rank} is outside the trainer world [0, {self.world_size})")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"init_info.host must be a non-empty string, got {self.host!r}")
        reserved = {"host", "update_port", "stage_ports", "trainers_per_stage", "timeout_s", "refit_timeout_s",
                    "reshard_options"} & set(self.engine_init)
        if reserved:
            raise ConfigError(f"init_info.engine_init may not set {sorted(reserved)}: the trainer engine sets them")

    def engine_info(self) -> dict[str, Any]:
        """The engine backend's ``init_info`` (JSON-safe)."""
        return {"host": self.host, "update_port": self.update_port, "stage_ports": [self.stage_port],
                "trainers_per_stage": [self.world_size], "gen_world_size": self.gen_world_size,
                "timeout_s": self.timeout_s, "refit_timeout_s": self.refit_timeout_s,
                "reshard_options": dict(self.reshard_options), **self.engine_init}


class LLMWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` in this process.

    ``finish_weight_update`` also resets the prefix cache: cached KV was computed with
    the previous weights.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)
        self.llm.reset_prefix_cache()


class _SourceWorker(AbstractPolicyWorker):
    """A trainer worker over the full tensors a vLLM ``WeightSource`` yielded last."""

    def __init__(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._specs = dict(specs)
        self.tensors: dict[str, torch.Tensor] = {}

    def _named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.tensors

    def _refit_model_source(self) -> Any:
        return self._specs

    def _refit_dtype(self) -> Any:
        dtypes = {d for _, d in self._specs.values() if d.is_floating_point}
        return dtypes.pop() if len(dtypes) == 1 else torch.bfloat16

    async def get_reference_policy_logprobs(self, *, data: Any, micro_batch_size: int | None = None) -> Any:
        raise ConfigError("the vLLM trainer engine's worker only moves weights; it has no reference policy")


class PolicyworkerTrainerWeightTransferEngine(TrainerWeightTransferEngine[PolicyworkerTrainerInitInfo]):
    """See the module docstring."""

    init_info_cls = PolicyworkerTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, info: PolicyworkerTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info = info
        self._meta = list(source.metadata())
        specs = {m.name: (tuple(m.shape), m.dtype) for m in self._meta}
        if len(specs) != len(self._meta):
            raise ConfigError("the WeightSource's metadata() names a parameter twice")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"policyworker-trainer-{info.rank}",
                                        daemon=True)
        self._thread.start()
        kwargs = {} if info.device is None else {"device": info.device}

        async def build() -> _SourceWorker:
            return _SourceWorker(specs, rank=info.rank, world_size=info.world_size, timeout_s=info.timeout_s, **kwargs)

        try:
            self.worker = self._call(build(), info.timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    @property
    def version(self) -> int:
        """The version of the last update sent (``init_info.version`` before the first).

        It advances only when every rank's send of it succeeded (the refit's shared
        verdict), on every rank alike; the engine serves it once rank 0's
        ``finish_weight_update`` returned (a failed commit is retried by the next update,
        one version higher).
        """
        return self.worker.refit_version

    def _call(self, coro: Any, timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # The worker's own deadlines bound every wait; this outer bound only catches a bug.
            return future.result(timeout_s + 30.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    @classmethod
    def trainer_init(cls, init_info: PolicyworkerTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> PolicyworkerTrainerWeightTransferEngine:
        if not isinstance(init_info, PolicyworkerTrainerInitInfo):
            raise ConfigError(f"init_info must be a PolicyworkerTrainerInitInfo, got {type(init_info).__name__}")
        if source is None:
            raise ConfigError("the policyworker trainer engine needs a WeightSource (e.g. ModuleSource(model))")
        if init_info.is_sender and client is None:
            raise ConfigError("trainer rank 0 drives the engine: pass its client")
        engine = cls(client=client, source=source, info=init_info)
        try:
            engine._load_source()  # the plan is checked against this rank's tensors when it is made
            engine._connect()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _connect(self) -> None:
        from policyworker.integrations.vllm.plan import prepare_vllm_refit

        info, w = self.info, self.worker
        n = info.world_size + info.gen_world_size

        async def join() -> None:
            w.refit_version = info.version
            await w.init_collective(info.host, info.update_port, n, train_world_size=info.world_size)
            await w.init_nccl_reshard_comm_group([info.host], [info.stage_port], 1, 0, n, info.rank)
            await prepare_vllm_refit(w, info.train or f"tp={info.world_size}", info.gen_world_size,
                                     **info.reshard_options)

        if not self.is_sender:
            self._call(join(), 3 * info.timeout_s)
            return
        # The engine blocks in init_weight_transfer_engine until every rank joined: ask it
        # on a side thread while this rank joins.
        _beside(lambda: self._call(join(), 3 * info.timeout_s), self.client.init_weight_transfer_engine,
                info.engine_info(), bound=3 * info.timeout_s + 30.0)

    def _load_source(self) -> None:
        """Iterate the source (every rank: it may be a collective) and check it against its metadata."""
        tensors: dict[str, torch.Tensor] = {}
        meta = iter(self._meta)
        for name, tensor in self.source:
            want = next(meta, None)
            if want is None or name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
                raise ConfigError(f"the WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} where its "
                                  f"metadata() says {want}", param=name)
            tensors[name] = tensor.detach()
        if len(tensors) != len(self._meta):
            raise ConfigError(f"the WeightSource yielded {len(tensors)} tensors, its metadata() {len(self._meta)}")
        self.worker.tensors = tensors

    def send_weights(self) -> None:
        """One update of version ``self.version + 1``; see the module docstring."""
        self._load_source()
        version = self.version + 1
        bound = self.info.refit_timeout_s or self.info.timeout_s

        def refit() -> Any:
            report = self._call(self.worker.refit("nccl_reshard", refit_timeout_s=self.info.refit_timeout_s), bound)
            if report.version != version:
                raise ProtocolError(f"trainer rank {self.info.rank} sent version {report.version}, expected {version}",
                                    rank=self.info.rank)
            return report

        if not self.is_sender:
            refit()
            return
        self.client.start_weight_update()
        # update_weights returns once the engine received everything: run it beside the sends.
        _beside(refit, self.client.update_weights, {"version": version}, bound=bound + 30.0)
        self.client.finish_weight_update(weight_version=str(version))

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        self._loop.close()

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.worker.shutdown(), self.worker.timeout_s)
        except PolicyWorkerError as exc:
            logger.warning("policyworker trainer engine: closing the groups failed: %s", exc)
        finally:
            self._stop_loop()


def _beside(ours: Any, rpc: Any, arg: Any, *, bound: float) -> Any:
    """Run ``rpc(arg)`` on a side thread while ``ours()`` runs here; return ours' result.

    Our error wins, with the engine's (waited for up to ``bound``: it fails too, usually
    for the same cause) added as a note; else the engine's error is raised.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        future = ex.submit(rpc, arg)
        try:
            result = ours()
        except BaseException as exc:
            done, _ = concurrent.futures.wait([future], timeout=bound)
            if done and future.exception() is not None:
                exc.add_note(f"the engine's {getattr(rpc, '__name__', 'call')} failed too: {future.exception()!r}")
            raise
        future.result(timeout=bound)
    return result
