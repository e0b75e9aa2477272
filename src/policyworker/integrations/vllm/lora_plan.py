"""The LoRA refit plan into vLLM and the connect-time handshake (no vLLM import here).

Each vLLM worker publishes, on the update group's store, what it serves: its rank, the
content hash of the base it serves, the largest adapter rank it accepts, and the boxes
of the base its layers load (:class:`LoraEngineInfo`). The trainers read every one and
refuse a rank above the engine's ``max_lora_rank`` (``ConfigError``). A different base
depends on ``base``: ``"require_same"`` (the default) refuses it (``PlanMismatch``: the
adapter would be applied to other weights); ``"send_if_different"`` sends the trainers'
base once, with the first adapter refit. They plan their adapter factors from the
training layout to *whole* factors on every vLLM rank (vLLM's LoRA layers cut each
rank's slice themselves when the adapter is installed) and, when the base goes too, a
second plan for that first refit: the same factors plus the base into the boxes each
rank loads (as the dense backend's plan). Trainer rank 0 publishes both with the
adapter's metadata (:class:`LoraPlanInfo`). The vLLM workers check them again before a
byte moves. After the refit that carried the base succeeds (every rank's verdict
good), both sides attach the adapter-only plan: later refits move only the adapter.

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
from policyworker.integrations.vllm.plan import Needs, attach_trainer, needs_layout, publish, trainer_groups
from policyworker.layout.boxes import merge_layouts

__all__ = ["BASE_MODES", "ENGINE_KEY", "PLAN_KEY", "LoraEngineInfo", "LoraPlanInfo", "plan_for_vllm_lora",
           "prepare_vllm_lora_refit", "whole_layout"]

ENGINE_KEY = "vllm/lora/engine/{rank}"
PLAN_KEY = "vllm/lora/plan"
#: What the trainers do about an engine whose base differs from theirs.
BASE_MODES = ("require_same", "send_if_different")


class LoraEngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One vLLM rank: where it sits and which base it serves adapters on.

    ``base_needs``: the boxes of the base this rank loads (what a base send must
    deliver), or None with ``base_refusal`` saying why its base cannot be sent.
    """

    rank: int
    tp_size: int
    base_hash: str
    max_lora_rank: int
    base_needs: Needs | None = None
    base_refusal: str = ""


class LoraPlanInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the trainers publish: the adapter's metadata, their base's hash, the plan's bytes.

    ``base_plan``: the first refit's plan (the factors and the base) when the base is
    sent, else None; ``plan`` moves the factors only.
    """

    meta: LoraMeta
    base_hash: str
    plan: bytes
    base_plan: bytes | None = None


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
                       train_world_size: int, gen_world_size: int, *,
                       base: tuple[Mapping[str, tuple[tuple[int, ...], Any]], Sequence[Needs]] | None = None
                       ) -> ReshardPlan:
    """The factors from the trainers' layout (rules, the base's heads) to whole factors on each vLLM rank.

    ``base``: (the base's specs by checkpoint name, every vLLM rank's base needs): the
    plan carries the base too, from the same training layout into the boxes each rank
    loads, each byte once per rank.
    """
    train = as_parallelism(train_parallelism, "train")
    train.check_world_size(train_world_size, side="train")
    dst = whole_layout(specs, gen_world_size)
    if base is not None:
        base_specs, needs = base
        clash = sorted(set(base_specs) & set(specs))
        if clash:
            raise PlanError(f"{clash[0]!r} names both a base tensor and an adapter factor", param=clash[0])
        if len(needs) != gen_world_size:
            raise PlanError(f"base needs of {len(needs)} vLLM ranks for {gen_world_size} ranks")
        dst = merge_layouts([needs_layout(base_specs, needs), dst])
        specs = {**base_specs, **specs}
    src = rule_layout(specs, train, config=config, fused=False)
    return plan_from_layouts(specs, src, dst, train=train, gen=None, gen_fused=False)


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


def check_engines(engines: Sequence[LoraEngineInfo], base_hash: str, meta: LoraMeta,
                  base: str = "require_same") -> bool:
    """Whether the trainers' base must be sent (``base="send_if_different"`` and some rank
    serves another base). PlanMismatch for another base under ``"require_same"``,
    ConfigError for a rank the engine cannot hold or a base it cannot receive."""
    if base not in BASE_MODES:
        raise ConfigError(f"base must be one of {', '.join(map(repr, BASE_MODES))}, got {base!r}")
    send = False
    for e in engines:
        if meta.r > e.max_lora_rank:
            raise ConfigError(f"the adapter's rank {meta.r} exceeds vLLM rank {e.rank}'s max_lora_rank "
                              f"{e.max_lora_rank}", rank=e.rank)
        if e.base_hash == base_hash:
            continue
        if base == "require_same":
            raise PlanMismatch(f"vLLM rank {e.rank} serves another base model (checkpoint hash {e.base_hash[:12]}…, "
                               f"the trainer's base hashes to {base_hash[:12]}…): start vLLM from the trainer's "
                               "base checkpoint, or prepare with base='send_if_different' to send the trainers' "
                               "base once, with the first adapter refit", rank=e.rank)
        send = True
    if send:
        for e in engines:
            if e.base_needs is None:
                raise ConfigError(f"vLLM rank {e.rank} cannot receive the trainers' base: {e.base_refusal or '?'}",
                                  rank=e.rank)
    return send


def _check_same_base(store: Any, rank: int, base_hash: str) -> None:
    """A trainer other than rank 0, when the base may be sent: rank 0 (whose published plan
    the engines follow) holds this rank's base, so their shards make one base."""
    try:
        data = store.get(PLAN_KEY)
    except Exception as exc:  # the store raises DistStoreError/RuntimeError on timeouts
        raise translate_comm_error(exc, rank=rank, what="reading trainer rank 0's LoRA plan") from exc
    theirs = decode(data, LoraPlanInfo).base_hash
    if theirs != base_hash:
        raise PlanMismatch(f"trainer rank {rank}'s base hashes to {base_hash[:12]}…, rank 0's to {theirs[:12]}…: "
                           "the trainers must hold one base to send it", rank=rank)


async def prepare_vllm_lora_refit(worker: Any, train_parallelism: Any, gen_world_size: int, *,
                                  base: str = "require_same", **setup: Any) -> dict:
    """Trainer side (a ``LoraPolicyWorker``): plan this trainer's adapter refits into vLLM.

    Call on every trainer after ``init_collective`` and ``init_nccl_reshard_comm_group``
    (the vLLM workers of backend ``"policyworker-lora"`` join the same groups in
    ``init_weight_transfer_engine``). Checks every vLLM rank's base hash against this
    trainer's base, computes the plan, (rank 0) publishes it, and attaches
    ``nccl_reshard`` with it and ``setup`` (as ``prepare_vllm_refit``). Then ``await
    worker.refit("nccl_reshard", ...)`` sends the adapter.

    ``base``: ``"require_same"`` refuses an engine on another base (``PlanMismatch``);
    ``"send_if_different"`` sends this trainer's base (its shard of it) with the first
    refit, into every vLLM rank, when any rank's base differs — that refit's report has
    ``base_bytes``; later ones move the adapter only. Every trainer must hold the same
    base (checked: ``PlanMismatch``).
    """
    if base not in BASE_MODES:
        raise ConfigError(f"base must be one of {', '.join(map(repr, BASE_MODES))}, got {base!r}")
    group, train_world_size = trainer_groups(worker, gen_world_size, "prepare_vllm_lora_refit")
    src = worker.refit_source()
    source, config = src.model, src.gen_config

    def build() -> tuple[ReshardPlan, ReshardPlan | None]:
        mine = worker.base_hash()
        engines = read_engines(group.store, gen_world_size)
        plan = plan_for_vllm_lora(source, config, train_parallelism, train_world_size, gen_world_size)
        first = None
        if base == "send_if_different" and any(e.base_hash != mine for e in engines) \
                and all(e.base_needs is not None for e in engines):
            first = plan_for_vllm_lora(source, config, train_parallelism, train_world_size, gen_world_size,
                                       base=(worker.base_specs(), [e.base_needs for e in engines]))
        if worker.rank == 0:
            # Published before the checks: the vLLM workers check it too and fail at
            # once, instead of waiting out the store's timeout for a plan never sent.
            info = LoraPlanInfo(meta=worker.meta, base_hash=mine, plan=plan.to_wire(),
                                base_plan=None if first is None else first.to_wire())
            publish(group.store, PLAN_KEY, encode(info), worker.rank, "the vLLM LoRA plan")
        check_engines(engines, mine, worker.meta, base)
        if base == "send_if_different" and worker.rank != 0:
            _check_same_base(group.store, worker.rank, mine)
        return plan, first

    plan, first = await run_in_executor(None, build)
    await attach_trainer(worker, plan if first is None else first, setup)
    if first is None:
        worker.after_base_refit("nccl_reshard", None)
        return plan.refit_info()
    sent = sum(t.nbytes for t in first.sends(worker.rank)) - sum(t.nbytes for t in plan.sends(worker.rank))
    worker.after_base_refit("nccl_reshard", lambda: attach_trainer(worker, plan, setup), base_bytes=sent)
    return first.refit_info()
