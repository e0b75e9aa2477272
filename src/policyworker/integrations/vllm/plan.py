"""vLLM's destination layout and the reshard plan into it (no vLLM import here).

Each vLLM worker states what it *needs*: for every checkpoint (Hugging Face) parameter
its loaders read, the box of it this rank loads — derived from vLLM's own layers (see
``needs_from_vllm_model`` in :mod:`.vllm_targets`), so vLLM's choices (padded vocabulary, kv
heads replicated when tp exceeds them, tied embeddings, its fused ``qkv_proj`` /
``gate_up_proj`` members) are whatever the running engine does, not a copy of its rules.

The trainers gather every vLLM rank's needs from the update group's store, build the
plan from their own source layout (rules, a ``ModelConfig``, or DTensors) to those
boxes, and trainer rank 0 publishes the plan's bytes on the same store for the vLLM
workers. Every rank then checks the plan hash at connect (``nccl_reshard``), so a
disagreement fails before a byte moves.

Store keys (under the update group's prefix): ``vllm/needs/<gen rank>`` (msgpack
`Needs`), ``vllm/plan`` (the plan's canonical msgpack). A new update group (recovery)
has a fresh store, so stale keys never survive a rebuild.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from policyworker.config import positive_int
from policyworker.runtime._aio import run_in_executor
from policyworker.errors import ConfigError, PlanError, translate_comm_error
from policyworker.layout.boxes import Layout, LocalSpec, Piece
from policyworker.layout.formats.block_fp8 import Fp8Target, fp8_layout
from policyworker.layout.experts import expert_specs, split_expert_layout
from policyworker.layout.local import is_dtensor
from policyworker.layout.parallelism import Parallelism
from policyworker.layout.plan import ReshardPlan
from policyworker.layout.planner import as_parallelism, plan_from_layouts
from policyworker.layout.rules import dtype_name, rule_layout

__all__ = ["NEEDS_KEY", "PLAN_KEY", "Need", "Needs", "attach_trainer", "fp8_target", "needs_layout", "plan_for_vllm",
           "prepare_vllm_refit", "publish", "read_needs", "source_layout"]

NEEDS_KEY = "vllm/needs/{rank}"
PLAN_KEY = "vllm/plan"


class Need(msgspec.Struct, frozen=True, array_like=True):
    """Box ``[start, stop)`` of checkpoint parameter ``name`` (full ``shape``) that a rank loads."""

    name: str
    shape: tuple[int, ...]
    start: tuple[int, ...]
    stop: tuple[int, ...]


class Needs(msgspec.Struct, frozen=True, kw_only=True):
    """One vLLM rank's needs, in vLLM's parameter order, and what it runs in."""

    rank: int
    tp_rank: int
    tp_size: int
    dtype: str
    needs: list[Need]
    #: Block size of the boxes that land as block-FP8 (0: none), and their names.
    fp8_block: int = 0
    fp8: list[str] = msgspec.field(default_factory=list)


_NEEDS_DECODER = msgspec.msgpack.Decoder(Needs)


def encode_needs(needs: Needs) -> bytes:
    return msgspec.msgpack.encode(needs)


def decode_needs(data: bytes) -> Needs:
    try:
        return _NEEDS_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise PlanError(f"malformed vLLM needs: {exc}") from exc


def needs_layout(specs: Mapping[str, tuple[tuple[int, ...], Any]], needs_by_rank: Sequence[Needs]) -> Layout:
    """The generation `Layout`: rank ``g`` holds each of its needed boxes as its own local tensor.

    Checks vLLM's model against the trainer's: every needed name must be a trainer
    parameter of the same full shape, and every trainer parameter must be needed by
    some vLLM rank (a parameter nobody loads means the two models differ).
    """
    pieces: dict[str, list[Piece]] = {}
    tensors: dict[int, dict[str, LocalSpec]] = {}
    for g, needs in enumerate(needs_by_rank):
        if needs.rank != g:
            raise PlanError(f"vLLM needs of rank {needs.rank} were published as rank {g}", rank=g)
        mine = tensors[g] = {}
        for need in needs.needs:
            spec = specs.get(need.name)
            if spec is None:
                raise PlanError(f"vLLM rank {g} loads {need.name!r}, which the trainer's model does not have",
                                rank=g, param=need.name)
            shape, dtype = tuple(spec[0]), dtype_name(spec[1])
            if shape != tuple(need.shape):
                raise PlanError(f"{need.name!r} is {list(shape)} in the trainer's model but {list(need.shape)} in "
                                "vLLM's", rank=g, param=need.name)
            if len(need.start) != len(shape) or len(need.stop) != len(shape) or any(
                    not 0 <= a <= b <= s for a, b, s in zip(need.start, need.stop, shape)):
                raise PlanError(f"vLLM rank {g} needs box {need.start}..{need.stop} of {need.name!r} {list(shape)}",
                                rank=g, param=need.name)
            if need.name in mine:
                raise PlanError(f"vLLM rank {g} needs {need.name!r} twice", rank=g, param=need.name)
            mine[need.name] = LocalSpec(tuple(b - a for a, b in zip(need.start, need.stop)), dtype)
            pieces.setdefault(need.name, []).append(
                Piece(g, need.name, tuple(need.start), tuple(need.stop), (0,) * len(shape)))
    unused = [n for n in specs if n not in pieces]
    if unused:
        raise PlanError(f"{len(unused)} trainer parameters are loaded by no vLLM rank, e.g. {unused[0]!r}: the "
                        "trainer's model and vLLM's differ", param=unused[0])
    world = len(needs_by_rank)
    return Layout(world_size=world, stage_of_rank=(0,) * world, pieces=pieces, tensors=tensors)


def fp8_target(needs_by_rank: Sequence[Any]) -> Fp8Target | None:
    """The plan's FP8 target from every vLLM rank's needs (None: nothing lands as FP8).

    Exactly the names the ranks said land as FP8 (so vLLM's ``ignored_layers`` and
    ``lm_head`` stay as vLLM loads them); every rank must agree on them and the block.
    """
    blocks = {n.fp8_block for n in needs_by_rank}
    if blocks == {0}:
        return None
    if len(blocks) != 1:
        raise PlanError(f"vLLM ranks disagree on the FP8 block size: {sorted(blocks)}")
    names: set[str] = set()
    for needs in needs_by_rank:
        names.update(needs.fp8)
    for needs in needs_by_rank:
        loaded = {n.name for n in needs.needs}
        if (loaded & names) != set(needs.fp8):
            raise PlanError(f"vLLM rank {needs.rank} loads as FP8 other tensors than its peers", rank=needs.rank)
    if not names:
        raise PlanError("vLLM ranks announce an FP8 block size but no FP8 tensors")
    return Fp8Target(block=blocks.pop(), match="|".join(re.escape(n) for n in sorted(names)))


def source_layout(source: Any, train: Parallelism, train_world_size: int, *, dtype: Any = "bfloat16"):
    """``(specs, layout)`` of the trainers: from a ModelConfig or specs (rules) or DTensors."""
    from policyworker.models.config import ModelConfig
    from policyworker.models.params import param_specs

    train.check_world_size(train_world_size, side="train")
    if isinstance(source, Mapping) and source and all(is_dtensor(t) for t in source.values()):
        from policyworker.layout.dtensor import dtensor_layout, dtensor_specs

        return split_expert_layout(dtensor_specs(source), dtensor_layout(source, world_size=train_world_size))
    if isinstance(source, ModelConfig):
        specs = {n: (s, dtype_name(dtype)) for n, (s, _) in param_specs(source).items()}
        return specs, rule_layout(specs, train, config=source, fused=False)
    if isinstance(source, Mapping):
        specs = {n: (tuple(s), dtype_name(d)) for n, (s, d) in expert_specs(source).items()}
        return specs, rule_layout(specs, train, fused=False)
    raise ConfigError(f"a refit source must be a ModelConfig, {{name: (shape, dtype)}} or DTensors, got "
                      f"{type(source).__name__}")


def plan_for_vllm(source: Any, train_parallelism: Any, train_world_size: int, needs_by_rank: Sequence[Needs], *,
                  dtype: Any = "bfloat16") -> ReshardPlan:
    """The plan from the trainers' layout to the boxes vLLM's ranks need (deterministic)."""
    train = as_parallelism(train_parallelism, "train")
    if not needs_by_rank:
        raise ConfigError("a vLLM plan needs at least one vLLM rank")
    specs, src = source_layout(source, train, train_world_size, dtype=dtype)
    dst = needs_layout(specs, needs_by_rank)
    sizes = {n.tp_size for n in needs_by_rank}
    # One engine of tp ranks is described by Parallelism(tp); several engines are not.
    gen = Parallelism(tp=len(needs_by_rank)) if sizes == {len(needs_by_rank)} else None
    fp8 = fp8_target(needs_by_rank)
    if fp8 is None:
        return plan_from_layouts(specs, src, dst, train=train, gen=gen, gen_fused=False)
    # Block-FP8 vLLM layers: those boxes are quantized by the trainers' pack step.
    src = fp8_layout(src, specs, fp8, tp=train.tp, side="train", retype=False)
    dst = fp8_layout(dst, specs, fp8, tp=max(sizes), side="gen", retype=True)
    return plan_from_layouts(specs, src, dst, train=train, gen=gen, gen_fused=False, dest_format=fp8.dest_format,
                             compress=False)


def read_needs(store: Any, gen_world_size: int, *, what: str = "vLLM needs") -> list[Needs]:
    """Every vLLM rank's needs from the update group's store (waits up to the store's timeout)."""
    out = []
    for g in range(gen_world_size):
        try:
            data = store.get(NEEDS_KEY.format(rank=g))
        except Exception as exc:  # the store raises DistStoreError/RuntimeError on timeouts
            raise translate_comm_error(exc, rank=g, what=f"reading {what} of vLLM rank {g}") from exc
        out.append(decode_needs(bytes(data)))
    return out


def trainer_groups(worker: Any, gen_world_size: int, caller: str) -> tuple[Any, int]:
    """(the update group, the training world size) of a trainer about to plan into vLLM;
    ``ConfigError`` before any store is read if it has not joined its groups or
    ``gen_world_size`` is not an int >= 1."""
    group = worker.model_update_group
    if group is None or worker.pp_comm_group is None:
        raise ConfigError(f"join the update group and the stage group before {caller}", rank=worker.rank)
    positive_int(gen_world_size, "gen_world_size")
    return group, worker.train_world_size if worker.train_world_size is not None else worker.world_size


async def prepare_vllm_refit(worker: Any, train_parallelism: Any, gen_world_size: int, **setup: Any) -> dict:
    """Trainer side: plan this trainer's refits into vLLM and attach ``nccl_reshard`` with it.

    Call on every trainer after ``init_collective`` and ``init_nccl_reshard_comm_group``
    (the vLLM engines join the same groups in ``init_weight_transfer_engine``), instead
    of ``prepare_nccl_reshard_refit_info``. Reads every vLLM rank's needs from the update
    group's store, computes the plan from this trainer's refit source, (rank 0) publishes
    it for the vLLM workers, and attaches ``nccl_reshard`` with it and ``setup`` (its
    ``bucket_bytes``, ``checksum``, ...: equal to the engines' ``reshard_options``; this
    rank's tensors are checked against the plan now: ``ConfigError``, not mid-refit). Then each update
    is ``await worker.refit("nccl_reshard", refit_timeout_s=...)``, which connects the
    first time, inside its deadline, as the engines' first refit does. Returns the
    plan's info dict.
    """
    group, train_world_size = trainer_groups(worker, gen_world_size, "prepare_vllm_refit")
    src = worker.refit_source()
    source, dtype = src.model, src.dtype

    def build() -> ReshardPlan:
        needs = read_needs(group.store, gen_world_size)
        plan = plan_for_vllm(source, train_parallelism, train_world_size, needs, dtype=dtype)
        if worker.rank == 0:
            publish(group.store, PLAN_KEY, plan.to_wire(), worker.rank, "the vLLM plan")
        return plan

    plan = await run_in_executor(None, build)
    await attach_trainer(worker, plan, setup)
    return plan.refit_info()


def publish(store: Any, key: str, data: bytes, rank: int, what: str) -> None:
    """``store.set(key, data)``, its errors typed."""
    try:
        store.set(key, data)
    except Exception as exc:  # the store raises DistStoreError/RuntimeError when its host is gone
        raise translate_comm_error(exc, rank=rank, what=f"publishing {what}") from exc


async def attach_trainer(worker: Any, plan: ReshardPlan, setup: Mapping[str, Any]) -> None:
    """Attach ``nccl_reshard`` on a trainer: ``plan``, its stage group, ``setup``.

    The connect is left to the first refit (inside its deadline): the engines connect in
    theirs.
    """
    from policyworker.transports.nccl_reshard.transport import stage_members

    stage = next((s for s, ranks in enumerate(stage_members(plan)) if worker.rank in ranks), None)
    if stage is None:
        raise ConfigError(f"train rank {worker.rank} is in no stage of the plan", rank=worker.rank)
    wired = {"group": worker.pp_comm_group, "stage": stage}
    reserved = sorted(set(wired) & set(setup) | {"plan", "connect"} & set(setup))
    if reserved:
        raise ConfigError(f"setup may not set {reserved}: prepare sets them", rank=worker.rank)
    await worker.attach_transport("nccl_reshard", connect=False, plan=plan, **setup, **wired)
