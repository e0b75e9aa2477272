"""Computing a `ReshardPlan` from two layouts (or from rules).

Per parameter: the source pieces are grouped into *replica classes* (pieces with the
same box); the classes must tile the parameter exactly. Each destination piece is
intersected with every class; each non-empty intersection is one copy, sent by one
replica of that class. Intersections depend only on the boxes, and the boxes repeat
across layers and experts, so they are computed once per distinct (shape, source
boxes, destination boxes) and reused: planning Qwen3-30B-A3B's 18,867 parameters
costs a few hundred distinct intersections, not per-row work. A layer's experts are
planned once per run (:mod:`.runs`) and written as one `CopyRun` per pair.

Replica choice: copies are assigned largest first, each to the replica with the
fewest bytes so far (ties broken starting at ``dst_rank % replicas``), then emitted
in parameter order. This longest-processing-time greedy keeps the send bytes of
data-parallel and tp-replicated sources even (no rank-0 funnel) and is
deterministic, so every rank computes the same plan.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from math import prod
from typing import Any

from policyworker.errors import ConfigError, PlanError
from policyworker.layout.boxes import Layout, Piece, box_volume
from policyworker.layout.experts import expert_specs
from policyworker.layout.formats import PLAIN, AnyFormat, FormatTarget, split_gen_layout
from policyworker.layout.parallelism import Parallelism
from policyworker.layout.plan import (
    Copy,
    CopyRun,
    LocalTensor,
    ParamInfo,
    PlanBody,
    ReshardPlan,
    Transfer,
    WirePiece,
    dtype_size,
)
from policyworker.layout.rules import dtype_name, rule_layout
from policyworker.layout.runs import find_runs
from policyworker.models.config import ModelConfig
from policyworker.models.params import param_specs

__all__ = ["as_parallelism", "build_plan", "plan_from_layouts"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


def as_parallelism(value: Parallelism | str | Mapping[str, int], side: str) -> Parallelism:
    """Parallelism from itself, ``"tp=2,pp=2"`` or ``{"tp": 2, "pp": 2}`` (the edge)."""
    if isinstance(value, Parallelism):
        return value
    if isinstance(value, str):
        return Parallelism.parse(value)
    if isinstance(value, Mapping):
        unknown = set(value) - {"tp", "pp", "dp", "ep"}
        if unknown:
            raise ConfigError(f"{side} parallelism has unknown axes {sorted(unknown)}")
        return Parallelism(**{k: int(v) for k, v in value.items()})
    raise ConfigError(f"{side} parallelism must be a Parallelism, str or mapping, "
                      f"got {type(value).__name__}")


def _template(name: str, shape: tuple[int, ...], classes: tuple[Box, ...],
              dsts: tuple[Box, ...]) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...], int]]:
    """``(dst index, class index, start, stop, volume)`` of every non-empty intersection,
    after checking that the classes tile ``shape`` and the destinations lie inside it."""
    def inside(box: Box) -> bool:
        return len(box[0]) == len(shape) and all(
            0 <= a <= b <= s for a, b, s in zip(box[0], box[1], shape))

    total = 0
    live = []
    for ci, box in enumerate(classes):
        if not inside(box):
            raise PlanError(f"source box {box} of {name!r} lies outside shape {shape}",
                            param=name)
        vol = box_volume(*box)
        if vol:
            total += vol
            live.append(ci)
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            (s1, e1), (s2, e2) = classes[a], classes[b]
            if all(max(x, y) < min(u, v) for x, y, u, v in zip(s1, s2, e1, e2)):
                raise PlanError(f"source boxes {classes[a]} and {classes[b]} of {name!r} "
                                "overlap without being replicas", param=name)
    if total != prod(shape):
        raise PlanError(f"the training ranks hold {total} of the {prod(shape)} elements of "
                        f"{name!r}: the source layout does not cover it", param=name)
    out = []
    for di, (ds, de) in enumerate(dsts):
        if not inside((ds, de)):
            raise PlanError(f"destination box {(ds, de)} of {name!r} lies outside shape "
                            f"{shape}", param=name)
        for ci in live:
            cs, ce = classes[ci]
            start = tuple(max(a, b) for a, b in zip(ds, cs))
            stop = tuple(min(a, b) for a, b in zip(de, ce))
            if all(a < b for a, b in zip(start, stop)):
                out.append((di, ci, start, stop, box_volume(start, stop)))
    return out


_AT_CACHE: dict[tuple[Any, Any, Any], tuple[int, ...]] = {}


def _local_at(start: tuple[int, ...], piece_start: tuple[int, ...],
              piece_at: tuple[int, ...]) -> tuple[int, ...]:
    """Where global ``start`` lands in a local tensor holding a piece (memoised: the
    same few triples recur across layers and experts)."""
    key = (start, piece_start, piece_at)
    at = _AT_CACHE.get(key)
    if at is None:
        if len(_AT_CACHE) > 1 << 16:
            _AT_CACHE.clear()
        at = _AT_CACHE[key] = tuple(a - b + o for a, b, o in zip(start, piece_start, piece_at))
    return at


def _wire_layout(layout: Layout, pindex: Mapping[str, int],
                 tindex: dict[str, int]) -> list[LocalTensor]:
    # This loop sees every piece of a side (a million on a tp=8 generation side of a
    # 235B MoE): tuple unpacking instead of attribute reads, pieces grouped per rank
    # then per tensor name (no key tuple per piece), and no coverage sums for layouts
    # that are exact by construction (the rules').
    grouped: dict[int, dict[str, list[WirePiece]]] = {}
    held: dict[tuple[int, str], int] = {}
    volumes: dict[tuple[Any, Any], int] = {}
    check = not layout.exact
    for name, pieces in layout.pieces.items():
        pi = pindex[name]
        for rank, tensor, start, stop, at in pieces:
            mine = grouped.get(rank)
            if mine is None:
                mine = grouped[rank] = {}
            wp = WirePiece(pi, start, stop, at)
            same = mine.get(tensor)
            if same is None:
                mine[tensor] = [wp]
            else:
                same.append(wp)
            if check:
                key = (rank, tensor)
                box = (start, stop)
                vol = volumes.get(box)
                if vol is None:
                    vol = volumes[box] = box_volume(start, stop)
                held[key] = held.get(key, 0) + vol
    out = []
    sizes: dict[tuple[int, ...], int] = {}
    for rank in sorted(layout.tensors):
        mine = grouped.get(rank, {})
        for tname, spec in layout.tensors[rank].items():
            pieces = mine.get(tname, [])
            if check:
                covered = held.get((rank, tname), 0)
                size = sizes.get(spec.shape)
                if size is None:
                    size = sizes[spec.shape] = prod(spec.shape)
                if covered != size:
                    raise PlanError(f"local tensor {tname!r} of rank {rank} has {size} elements "
                                    f"but its pieces cover {covered}", rank=rank, param=tname)
            ti = tindex.get(tname)
            if ti is None:
                ti = tindex[tname] = len(tindex)
            out.append(LocalTensor(rank, ti, tuple(spec.shape), spec.dtype, pieces))
    return out


def plan_from_layouts(
    specs: Mapping[str, tuple[tuple[int, ...], Any]],
    src: Layout,
    dst: Layout,
    *,
    train: Parallelism | None = None,
    gen: Parallelism | None = None,
    gen_fused: bool = False,
    compress: bool = True,
    dest_format: AnyFormat = PLAIN,
) -> ReshardPlan:
    """The plan moving ``specs``' parameters from layout ``src`` to layout ``dst``.

    Every parameter must be fully held by ``src``; parameters absent from ``dst``
    are not moved. Names in either layout that ``specs`` lacks are a PlanError.
    ``compress=False`` writes every copy as a `Copy` (no `CopyRun`s): the same copies,
    for tests and for readers that want them flat (a format that is not
    ``compressible`` gets them flat too).
    ``dest_format`` (:mod:`.formats`): how copies land; the tensors it converts are
    those its target retyped in ``dst`` (``FormatTarget.shape_layouts`` makes such layouts).
    """
    params = [ParamInfo(n, tuple(s), dtype_name(d)) for n, (s, d) in specs.items()]
    pindex = {p.name: i for i, p in enumerate(params)}
    for side, lay in (("training", src), ("generation", dst)):
        extra = [n for n in lay.pieces if n not in pindex]
        if extra:
            raise PlanError(f"the {side} layout places {len(extra)} unknown parameters, "
                            f"e.g. {extra[0]!r}", param=extra[0])
    tindex: dict[str, int] = {}
    sources = _wire_layout(src, pindex, tindex)
    dests = _wire_layout(dst, pindex, tindex)

    # Pass 1: every copy as (param, dst piece, replicas, box, bytes, run, member), in
    # plan order. A run (a layer's experts, see .runs) is planned on its first block
    # and stands for `count` copies per job: cost grows with pairs, not experts.
    runs = find_runs([p.name for p in params], [p.shape for p in params], src, dst,
                     tindex) if compress and dest_format.compressible else []
    run_at = {r.first: ri for ri, r in enumerate(runs)}
    jobs: list[tuple[int, Piece, list[Piece], tuple[int, ...], tuple[int, ...], int, int, int]] = []
    cache: dict[tuple[Any, ...], list[Any]] = {}
    converted = dest_format.converted_tensors(dst)

    def plan_param(pi: int, count: int, run: int, member: int) -> None:
        p = params[pi]
        dpieces = dst.pieces.get(p.name)
        if not dpieces or not prod(p.shape):
            return  # not moved, or nothing to move
        spieces = src.pieces.get(p.name)
        if not spieces:
            raise PlanError(f"no training rank holds {p.name!r}", param=p.name)
        classes: dict[Box, list[Piece]] = {}
        for sp in spieces:
            classes.setdefault((sp.start, sp.stop), []).append(sp)
        ckeys = tuple(classes)
        dkeys = tuple((d.start, d.stop) for d in dpieces)
        key = (p.shape, ckeys, dkeys)
        template = cache.get(key)
        if template is None:
            template = cache[key] = _template(p.name, p.shape, ckeys, dkeys)
        isz = dtype_size(p.dtype) * count
        if converted and (dpieces[0].rank, dpieces[0].tensor) in converted:
            for di, ci, start, stop, _ in template:
                jobs.append((pi, dpieces[di], classes[ckeys[ci]], start, stop,
                             dest_format.box_nbytes(start, stop, p.dtype) * count, run, member))
            return
        for di, ci, start, stop, vol in template:
            jobs.append((pi, dpieces[di], classes[ckeys[ci]], start, stop, vol * isz, run, member))

    pi = 0
    while pi < len(params):
        ri = run_at.get(pi)
        if ri is None:
            plan_param(pi, 1, -1, 0)
            pi += 1
            continue
        run = runs[ri]
        for member in range(run.size):
            plan_param(pi + member, run.count, ri, member)
        pi += run.size * run.count

    # Pass 2: pick a replica per job; largest first (LPT) so that a few big tensors
    # (embeddings) do not unbalance the senders.
    load = [0] * src.world_size
    chosen = [job[2][0] for job in jobs]
    shared = []
    for j, job in enumerate(jobs):
        if len(job[2]) == 1:
            load[job[2][0].rank] += job[5]
        else:
            shared.append(j)
    shared.sort(key=lambda j: -jobs[j][5])
    ranks_of: dict[int, list[int]] = {}   # id of a replica list (alive in jobs) -> its ranks
    for j in shared:
        d, reps, n = jobs[j][1], jobs[j][2], jobs[j][5]
        ranks = ranks_of.get(id(reps))
        if ranks is None:
            ranks = ranks_of[id(reps)] = [r.rank for r in reps]
        # The least loaded replica, the first in the order starting at k.
        k = d.rank % len(reps)
        loads = [load[r] for r in ranks]
        least = min(loads)
        i = loads.index(least, k) if least in loads[k:] else loads.index(least)
        load[ranks[i]] += n
        chosen[j] = reps[i]

    # Pass 3: emit in plan order, grouped by (stage, src, dst); a run's jobs to one
    # pair become one CopyRun whose block is its members' copies.
    copies: dict[tuple[int, int, int], list[Copy]] = {}
    blocks: dict[tuple[int, int, int], dict[int, tuple[list[Copy], list[int], list[int]]]] = {}
    nbytes: dict[tuple[int, int, int], int] = {}
    stage_of = src.stage_of_rank
    for (pi, d, _, start, stop, n, ri, member), s in zip(jobs, chosen):
        pair = (stage_of[s.rank], s.rank, d.rank)
        c = Copy(pi, start, stop, tindex[s.tensor], _local_at(start, s.start, s.at),
                 tindex[d.tensor], _local_at(start, d.start, d.at))
        nbytes[pair] = nbytes.get(pair, 0) + n
        if ri < 0:
            bucket = copies.get(pair)
            if bucket is None:
                copies[pair] = [c]
            else:
                bucket.append(c)
        else:
            block = blocks.setdefault(pair, {}).get(ri)
            if block is None:
                block = blocks[pair][ri] = ([], [], [])
            block[0].append(c)
            block[1].append(runs[ri].src_steps[member])
            block[2].append(runs[ri].dst_steps[member])
    transfers = []
    for pair in sorted(nbytes):
        pair_runs = [CopyRun(b, runs[ri].count, runs[ri].size, ss, ds)
                     for ri, (b, ss, ds) in sorted(blocks.get(pair, {}).items())]
        transfers.append(Transfer(pair[0], pair[1], pair[2], nbytes[pair],
                                  copies.get(pair, []), pair_runs))
    body = PlanBody(
        train=None if train is None else train.to_dict(),
        gen=None if gen is None else gen.to_dict(),
        train_world_size=src.world_size, gen_world_size=dst.world_size,
        gen_fused=gen_fused, params=params,
        tensor_names=sorted(tindex, key=tindex.__getitem__),
        sources=sources, dests=dests, transfers=transfers, dest_format=dest_format,
    )
    return ReshardPlan(body)


def build_plan(
    config_or_param_specs: ModelConfig | Mapping[str, tuple[tuple[int, ...], Any]],
    train_parallelism: Parallelism | str | Mapping[str, int],
    gen_parallelism: Parallelism | str | Mapping[str, int],
    train_world_size: int,
    gen_world_size: int,
    *,
    gen_fused: bool = True,
    dtype: Any = "bfloat16",
    gen_format: FormatTarget | None = None,
) -> ReshardPlan:
    """The plan for a model under training and generation layouts given by the rules.

    Destination formats (:mod:`.formats`): the generation layout may carry a format
    option (``"tp=2,<option>=<value>"``, the registry's ``LAYOUT_OPTIONS``), or
    ``gen_format`` gives a `FormatTarget` (which may carry a per-parameter rule).

    ``config_or_param_specs``: a `ModelConfig` (parameters in ``dtype``) or
    ``{name: (shape, dtype)}``; with bare specs attention is split by rows, not heads,
    so tp must divide q/k/v rows. World sizes must equal ``tp * pp * dp`` of each side
    (ConfigError otherwise); bad layouts for the model are PlanError. Deterministic:
    equal inputs give equal bytes (and hash) on every rank.
    """
    with _no_gc():
        return _build_plan(config_or_param_specs, train_parallelism, gen_parallelism,
                           train_world_size, gen_world_size, gen_fused=gen_fused, dtype=dtype,
                           gen_format=gen_format)


@contextmanager
def _no_gc() -> Iterator[None]:
    # A 30B plan allocates about a million small acyclic tuples and structs; the
    # cyclic collector re-scanning them costs a third of the planning time.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build_plan(
    config_or_param_specs: ModelConfig | Mapping[str, tuple[tuple[int, ...], Any]],
    train_parallelism: Parallelism | str | Mapping[str, int],
    gen_parallelism: Parallelism | str | Mapping[str, int],
    train_world_size: int,
    gen_world_size: int,
    *,
    gen_fused: bool,
    dtype: Any,
    gen_format: FormatTarget | None = None,
) -> ReshardPlan:
    gen_parallelism, from_layout = split_gen_layout(gen_parallelism)
    target = gen_format or from_layout
    train = as_parallelism(train_parallelism, "train")
    gen = as_parallelism(gen_parallelism, "gen")
    train.check_world_size(train_world_size, side="train")
    gen.check_world_size(gen_world_size, side="gen")
    if isinstance(config_or_param_specs, ModelConfig):
        config: ModelConfig | None = config_or_param_specs
        specs: Mapping[str, tuple[tuple[int, ...], Any]] = param_specs(config)
        if dtype_name(dtype) != "bfloat16":
            specs = {n: (s, dtype_name(dtype)) for n, (s, _) in specs.items()}
    elif isinstance(config_or_param_specs, Mapping):
        config, specs = None, expert_specs(config_or_param_specs)  # fused experts: per-expert members
    else:
        raise ConfigError("build_plan needs a ModelConfig or a {name: (shape, dtype)} mapping, "
                          f"got {type(config_or_param_specs).__name__}")
    src = rule_layout(specs, train, config=config, fused=False)
    dst = rule_layout(specs, gen, config=config, fused=gen_fused)
    if target is None:
        return plan_from_layouts(specs, src, dst, train=train, gen=gen, gen_fused=gen_fused)
    src, dst = target.shape_layouts(specs, src, dst, train_tp=train.tp, gen_tp=gen.tp)
    return plan_from_layouts(specs, src, dst, train=train, gen=gen, gen_fused=gen_fused,
                             dest_format=target.dest_format)
