"""The LoRA refit plan into vLLM and the connect-time handshake (no vLLM import here).

Each vLLM worker publishes, on the update group's store, what it serves: its rank, the
content hash of the base checkpoint it loaded, and the largest adapter rank it accepts
(:class:`LoraEngineInfo`). The trainers read every one, refuse a different base
(``PlanMismatch``: the adapter would be applied to other weights) or a rank above the
engine's ``max_lora_rank`` (``ConfigError``), plan their adapter factors from the
training layout to *whole* factors on every vLLM rank (vLLM's LoRA layers cut each
rank's slice themselves when the adapter is installed), and trainer rank 0 publishes
the plan with the adapter's metadata (:class:`LoraPlanInfo`). The vLLM workers check
it again before a byte moves.

Store keys (under the update group's prefix): ``vllm/lora/engine/<gen rank>`` and
``vllm/lora/plan``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from policyworker.runtime._aio import run_in_executor
from policyworker.errors import ConfigError, PlanError, PlanMismatch, translate_comm_error
from policyworker.layout.boxes import Layout, LocalSpec, Piece
from policyworker.layout.plan import ReshardPlan
from policyworker.layout.planner import as_parallelism, plan_from_layouts
from policyworker.layout.rules import dtype_name, rule_layout
from policyworker.integrations.peft import LoraMeta
from policyworker.integrations.vllm.plan import attach_trainer, publish, trainer_groups

__all__ = ["ENGINE_KEY", "PLAN_KEY", "LoraEngineInfo", "LoraPlanInfo", "plan_for_vllm_lora",
           "prepare_vllm_lora_refit", "whole_layout"]

ENGINE_KEY = "vllm/lora/engine/{rank}"
PLAN_KEY = "vllm/lora/plan"


class LoraEngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One vLLM rank: where it sits and which base it serves adapters on."""

    rank: int
    tp_size: int
    base_hash: str
    max_lora_rank: int


class LoraPlanInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the trainers publish: the adapter's metadata, their base's hash, the plan's bytes."""

    meta: LoraMeta
    base_hash: str
    plan: bytes


def encode(msg: Any) -> bytes:
    return msgspec.msgpack.encode(msg)


def decode(data: bytes, kind: type) -> Any:
    try:
        return msgspec.msgpack.decode(bytes(data), type=kind)
    except msgspec.DecodeError as exc:
        raise PlanError(f"malformed {kind.__name__}: {exc}") from exc


def whole_layout(specs: Mapping[str, tuple[tuple[int, ...], Any]], world_size: int) -> Layout:
    """Every rank holds every tensor whole (a replicated destination)."""
    pieces: dict[str, list[Piece]] = {}
    tensors: dict[int, dict[str, LocalSpec]] = {g: {} for g in range(world_size)}
    for name, (shape, dtype) in specs.items():
        shape = tuple(shape)
        zero = (0,) * len(shape)
        pieces[name] = [Piece(g, name, zero, shape, zero) for g in range(world_size)]
        for g in range(world_size):
            tensors[g][name] = LocalSpec(shape, dtype_name(dtype))
    return Layout(world_size=world_size, stage_of_rank=(0,) * world_size, pieces=pieces, tensors=tensors, exact=True)


def plan_for_vllm_lora(specs: Mapping[str, tuple[tuple[int, ...], Any]], config: Any, train_parallelism: Any,
                       train_world_size: int, gen_world_size: int) -> ReshardPlan:
    """The factors from the trainers' layout (rules, the base's heads) to whole factors on each vLLM rank."""
    train = as_parallelism(train_parallelism, "train")
    train.check_world_size(train_world_size, side="train")
    src = rule_layout(specs, train, config=config, fused=False)
    return plan_from_layouts(specs, src, whole_layout(specs, gen_world_size), train=train, gen=None,
                             gen_fused=False)


def read_engines(store: Any, gen_world_size: int) -> list[LoraEngineInfo]:
    out = []
    for g in range(gen_world_size):
        try:
            data = store.get(ENGINE_KEY.format(rank=g))
        except Exception as exc:  # the store raises DistStoreError/RuntimeError on timeouts
            raise translate_comm_error(exc, rank=g, what=f"reading the LoRA info of vLLM rank {g}") from exc
        info = decode(data, LoraEngineInfo)
        if info.rank != g:
            raise PlanError(f"vLLM LoRA info of rank {info.rank} was published as rank {g}", rank=g)
        out.append(info)
    return out


def check_engines(engines: Sequence[LoraEngineInfo], base_hash: str, meta: LoraMeta) -> None:
    """PlanMismatch for another base, ConfigError for a rank the engine cannot hold."""
    for e in engines:
        if e.base_hash != base_hash:
            raise PlanMismatch(f"vLLM rank {e.rank} serves another base model (checkpoint hash {e.base_hash[:12]}…, "
                               f"the trainer's base hashes to {base_hash[:12]}…): refit the base first or start "
                               "vLLM from the trainer's base checkpoint", rank=e.rank)
        if meta.r > e.max_lora_rank:
            raise ConfigError(f"the adapter's rank {meta.r} exceeds vLLM rank {e.rank}'s max_lora_rank "
                              f"{e.max_lora_rank}", rank=e.rank)


async def prepare_vllm_lora_refit(worker: Any, train_parallelism: Any, gen_world_size: int, **setup: Any) -> dict:
    """Trainer side (a ``LoraPolicyWorker``): plan this trainer's adapter refits into vLLM.

    Call on every trainer after ``init_collective`` and ``init_nccl_reshard_comm_group``
    (the vLLM workers of backend ``"policyworker-lora"`` join the same groups in
    ``init_weight_transfer_engine``). Checks every vLLM rank's base hash against this
    trainer's base, computes the plan, (rank 0) publishes it, and attaches
    ``nccl_reshard`` with it and ``setup`` (as ``prepare_vllm_refit``). Then ``await worker.refit("nccl_reshard", ...)`` sends the
    adapter.
    """
    group, train_world_size = trainer_groups(worker, gen_world_size, "prepare_vllm_lora_refit")
    src = worker.refit_source()
    source, config = src.model, src.gen_config

    def build() -> ReshardPlan:
        base = worker.base_hash()
        engines = read_engines(group.store, gen_world_size)
        plan = plan_for_vllm_lora(source, config, train_parallelism, train_world_size, gen_world_size)
        if worker.rank == 0:
            # Published before the checks: the vLLM workers check it too and fail at
            # once, instead of waiting out the store's timeout for a plan never sent.
            publish(group.store, PLAN_KEY, encode(LoraPlanInfo(meta=worker.meta, base_hash=base, plan=plan.to_wire())),
                    worker.rank, "the vLLM LoRA plan")
        check_engines(engines, base, worker.meta)
        return plan

    plan = await run_in_executor(None, build)
    await attach_trainer(worker, plan, setup)
    return plan.refit_info()
