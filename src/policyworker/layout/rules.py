"""Placement rules: which rank holds which box of each Hugging Face parameter.

Kinds (``tp`` below means ``etp`` for experts, see :mod:`.parallelism`):

=================  =========================================  ======================
kind               parameters                                 sharding
=================  =========================================  ======================
column             q/k/v_proj (weight, bias), gate/up_proj    dim 0 over tp
row                o_proj, down_proj                          dim 1 over tp
vocab              embed_tokens, lm_head                      dim 0 over tp
replicated         norms, q/k norms, the MoE router           whole on every rank
expert column/row  experts.E.{gate,up}/down_proj              expert E on its ep rank,
                                                              then column/row over etp
shared expert      shared_experts.{gate,up}/down_proj         column/row over tp
LoRA factor        <linear>.lora_A / .lora_B (.weight)        see :func:`_lora_rule`
=================  =========================================  ======================

Division rules. Attention shards by whole heads: tp must divide ``num_heads``; for
k/v either tp divides ``num_kv_heads`` or ``num_kv_heads`` divides tp, in which case
each kv head is replicated on ``tp / num_kv_heads`` consecutive tp ranks (as vLLM
does). MLP widths and the vocabulary may split unevenly, ``torch.chunk``-style
(see :func:`.boxes.chunk_bounds`); gate, up and down use the same split so the
shards still compose. ep must divide ``num_experts``; ``ep > 1`` on a dense model
is allowed and changes nothing.

Pipeline: layers split contiguously and as evenly as possible, the first
``num_layers % pp`` stages taking one extra layer (pp must not exceed num_layers).
``embed_tokens`` lives on stage 0, ``model.norm`` and ``lm_head`` on the last stage;
with tied embeddings there is no ``lm_head`` parameter and nothing is duplicated.

Fused generation targets (``fused=True``): per tp rank, ``self_attn.qkv_proj`` =
[q shard; k shard; v shard] (weight and, for Qwen2, bias) and ``mlp.gate_up_proj``
(per expert: ``mlp.experts.E.gate_up_proj``; shared expert: ``mlp.shared_experts.gate_up_proj``)
= [gate shard; up shard], stacked along
dim 0. A parameter no rule matches is a PlanError naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policyworker.errors import PlanError
from policyworker.layout.boxes import Layout, LocalSpec, Piece, chunk_bounds
from policyworker.layout.parallelism import Parallelism
from policyworker.models.config import ModelConfig

__all__ = ["ParamRule", "dtype_name", "layer_stages", "match_rule", "rule_layout"]

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_SHARED = re.compile(r"mlp\.shared_experts\.(gate|up|down)_proj\.weight")
_QKV = re.compile(r"self_attn\.(q|k|v)_proj\.(weight|bias)")
_LORA = re.compile(r"(.+)\.lora_(A|B)\.weight")


@dataclass(frozen=True, slots=True)
class ParamRule:
    """How one parameter is placed. ``heads`` is "q"/"kv" for head-wise splits."""

    kind: str
    dim: int | None = None           # the sharded tensor dim (None: replicated)
    layer: int | None = None
    expert: int | None = None
    heads: str | None = None
    fused: str | None = None         # fused generation tensor's name
    members: tuple[str, ...] = ()    # the fused tensor's members, in stacking order
    where: str = "layer"             # "first" | "last" | "layer" (pipeline stage)


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def match_rule(name: str, config: ModelConfig | None = None) -> ParamRule:
    """The rule for ``name``; PlanError naming it when no rule (of this family) applies.

    With a config, features the config lacks (qkv biases, q/k norms, experts) are
    unknown names too; without one every family's names are accepted.
    """
    lora = _LORA.fullmatch(name)
    if lora:
        return _lora_rule(match_rule(f"{lora.group(1)}.weight", config), lora.group(2), name)
    bias = config is None or config.qkv_bias
    qk_norm = config is None or config.qk_norm
    if name == "model.embed_tokens.weight":
        return ParamRule(VOCAB, 0, where="first")
    if name == "lm_head.weight" and (config is None or not config.tie_word_embeddings):
        return ParamRule(VOCAB, 0, where="last")
    if name == "model.norm.weight":
        return ParamRule(REPLICATED, where="last")
    m = _LAYER.fullmatch(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        prefix = f"model.layers.{layer}."
        if config is not None and layer >= config.num_layers:
            raise PlanError(f"parameter {name!r} names layer {layer} but the model has "
                            f"{config.num_layers}", param=name)
        moe = config is None or config.layer_is_moe(layer)
        dense = config is None or not config.layer_is_moe(layer)
        shared = config is None or (moe and config.num_shared_experts > 0)
        q = _QKV.fullmatch(rest)
        if q and (q.group(2) == "weight" or bias):
            suffix = q.group(2)
            members = tuple(f"{prefix}self_attn.{p}_proj.{suffix}" for p in "qkv")
            return ParamRule(COLUMN, 0, layer, heads="q" if q.group(1) == "q" else "kv",
                             fused=f"{prefix}self_attn.qkv_proj.{suffix}", members=members)
        if rest == "self_attn.o_proj.weight":
            return ParamRule(ROW, 1, layer, heads="q")
        if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") and qk_norm:
            return ParamRule(REPLICATED, layer=layer)
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return ParamRule(REPLICATED, layer=layer)
        if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight") and dense:
            members = (f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight")
            return ParamRule(COLUMN, 0, layer, fused=f"{prefix}mlp.gate_up_proj.weight",
                             members=members)
        if rest == "mlp.down_proj.weight" and dense:
            return ParamRule(ROW, 1, layer)
        if rest == "mlp.gate.weight" and moe:
            # The router is small and every token needs all of it: replicate (vLLM and
            # Megatron both do).
            return ParamRule(REPLICATED, layer=layer)
        sh = _SHARED.fullmatch(rest)
        if sh and shared:
            # The shared expert runs on every token: tensor-parallel like a dense MLP.
            if sh.group(1) == "down":
                return ParamRule(ROW, 1, layer)
            base = f"{prefix}mlp.shared_experts."
            return ParamRule(COLUMN, 0, layer, fused=f"{base}gate_up_proj.weight",
                             members=(f"{base}gate_proj.weight", f"{base}up_proj.weight"))
        e = _EXPERT.fullmatch(rest)
        if e and moe:
            expert = int(e.group(1))
            if config is not None and expert >= config.num_experts:
                raise PlanError(f"parameter {name!r} names expert {expert} but the model "
                                f"has {config.num_experts}", param=name)
            if e.group(2) == "down":
                return ParamRule(ROW, 1, layer, expert)
            base = f"{prefix}mlp.experts.{expert}."
            return ParamRule(COLUMN, 0, layer, expert,
                             fused=f"{base}gate_up_proj.weight",
                             members=(f"{base}gate_proj.weight", f"{base}up_proj.weight"))
    family = f" for family {config.family!r}" if config is not None else ""
    raise PlanError(f"no placement rule matches parameter {name!r}{family}", param=name)


def _lora_rule(base: ParamRule, which: str, name: str) -> ParamRule:
    """A LoRA factor of a linear layer, placed so that ``B @ A`` is sharded like the base.

    Column-parallel base (``W`` rows split): ``A [r, in]`` whole on every rank, ``B [out, r]``
    split by rows like ``W`` (by heads for q/k/v). Row-parallel base (``W`` columns split):
    ``A`` split by columns like ``W``, ``B`` whole. Never fused: each factor is its own tensor.
    """
    whole = ParamRule(REPLICATED, layer=base.layer, where=base.where)
    if base.kind == REPLICATED:
        return whole
    if base.kind not in (COLUMN, ROW) or base.expert is not None:
        raise PlanError(f"no LoRA placement for {name!r}: LoRA on {base.kind} layers is not supported", param=name)
    if (base.kind == COLUMN) != (which == "B"):
        return whole
    return ParamRule(base.kind, base.dim, base.layer, heads=base.heads, where=base.where)


#: The last call's rules: (config, names, {name: rule}). A plan places the same
#: names on both sides; matching them is a third of a large MoE's layout time.
_LAST_RULES: list[tuple[ModelConfig | None, tuple[str, ...], dict[str, ParamRule]]] = []


def _rules(specs: Mapping[str, Any], config: ModelConfig | None) -> dict[str, ParamRule]:
    """``{name: match_rule(name, config)}`` over ``specs`` (read-only to callers)."""
    names = tuple(specs)
    for last_config, last_names, rules in _LAST_RULES:
        if last_names == names and last_config == config:
            return rules
    rules = {name: match_rule(name, config) for name in names}
    _LAST_RULES[:] = [(config, names, rules)]
    return rules


def layer_stages(num_layers: int, pp: int) -> list[int]:
    """Stage of each layer: contiguous, the first ``num_layers % pp`` stages one longer."""
    if pp > num_layers:
        raise PlanError(f"pp={pp} exceeds num_layers={num_layers}: a stage would be empty")
    base, extra = divmod(num_layers, pp)
    out: list[int] = []
    for stage in range(pp):
        out.extend([stage] * (base + (stage < extra)))
    return out


def _check_model(config: ModelConfig, par: Parallelism) -> None:
    if config.num_heads % par.tp:
        raise PlanError(f"tp={par.tp} does not divide num_heads={config.num_heads} "
                        f"({config.name or config.family}): attention shards whole heads")
    kv = config.num_kv_heads
    if kv % par.tp and par.tp % kv:
        raise PlanError(f"tp={par.tp} and num_kv_heads={kv} do not divide one another: "
                        "kv heads can be split or replicated, not both")
    if config.is_moe and config.num_experts % par.ep:
        raise PlanError(f"ep={par.ep} does not divide num_experts={config.num_experts}")


_BARE_KV = ("pass a ModelConfig — ModelConfig.from_hf(model.config) for a Hugging Face model — as the plan's "
            "source (build_plan(config, ...), TorchPolicyWorker(refit_source=...)) so kv heads split or replicate "
            "by heads")


def _boxes(rule: ParamRule, shape: tuple[int, ...], parts: int,
           config: ModelConfig | None, name: str,
           head_dim: int | None = None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Box of each of the ``parts`` tp (or etp) indices.

    Without a config, k/v rows are split only where that is a split by whole heads:
    ``head_dim`` (read off a q/k norm) must be known and tp must divide the kv heads;
    otherwise (tp above the kv heads needs replication; an unknown head size may cut a
    head in two) PlanError says what to pass instead.
    """
    zero = (0,) * len(shape)
    if rule.dim is None:
        return [(zero, shape)]
    if rule.dim >= len(shape):
        raise PlanError(f"parameter {name!r} of shape {shape} has no dim {rule.dim} to shard",
                        param=name)
    size = shape[rule.dim]
    spans: list[tuple[int, int]]
    if rule.heads is not None and config is not None:
        heads = config.num_heads if rule.heads == "q" else config.num_kv_heads
        hd = config.head_dim
        if size != heads * hd:
            raise PlanError(f"parameter {name!r} dim {rule.dim} is {size}, expected "
                            f"{heads} heads x {hd}", param=name)
        if heads % parts == 0:
            per = heads // parts
            spans = [(i * per * hd, (i + 1) * per * hd) for i in range(parts)]
        else:  # heads divides parts: replicate each kv head over parts // heads ranks
            rep = parts // heads
            spans = [((i // rep) * hd, (i // rep + 1) * hd) for i in range(parts)]
    elif rule.heads is not None:
        if rule.heads == "kv" and parts > 1:
            if head_dim is None:
                raise PlanError(f"cannot split {name!r} over tp={parts} from bare shapes: the kv head size is "
                                f"unknown; {_BARE_KV}", param=name)
            if size % head_dim or (size // head_dim) % parts:
                raise PlanError(f"tp={parts} does not divide the {size // head_dim} kv heads of {name!r} "
                                f"(head_dim {head_dim}): rows would split heads or miss their replication; "
                                f"{_BARE_KV}", param=name)
        if size % parts:
            raise PlanError(f"tp={parts} does not divide dim {rule.dim} ({size}) of {name!r}; "
                            "pass the ModelConfig to split by heads", param=name)
        spans = [chunk_bounds(size, parts, i) for i in range(parts)]
    else:
        spans = [chunk_bounds(size, parts, i) for i in range(parts)]
    out = []
    for a, b in spans:
        start, stop = list(zero), list(shape)
        start[rule.dim], stop[rule.dim] = a, b
        out.append((tuple(start), tuple(stop)))
    return out


def rule_layout(
    specs: Mapping[str, tuple[tuple[int, ...], Any]],
    par: Parallelism,
    *,
    config: ModelConfig | None = None,
    fused: bool = False,
) -> Layout:
    """The layout the rules give ``specs`` (``{name: (shape, dtype)}``) under ``par``."""
    if config is not None:
        _check_model(config, par)
        num_layers = config.num_layers
    else:
        layers = [int(m.group(1)) for n in specs if (m := _LAYER.fullmatch(n))]
        num_layers = max(layers) + 1 if layers else 1
    stages = layer_stages(num_layers, par.pp)
    coords = [par.coords(r) for r in range(par.world_size)]
    by_stage = [coords[s * par.stage_size:(s + 1) * par.stage_size] for s in range(par.pp)]
    rules = _rules(specs, config)
    if config is None and par.ep > 1:
        experts = {r.expert for r in rules.values() if r.expert is not None}
        if experts and (max(experts) + 1) % par.ep:
            raise PlanError(f"ep={par.ep} does not divide the {max(experts) + 1} experts")
    num_experts = config.num_experts if config is not None else \
        1 + max((r.expert for r in rules.values() if r.expert is not None), default=-1)
    per_ep = max(1, num_experts // par.ep)
    # Bare specs: a q/k norm's length is the head size (Qwen3); else it is unknown.
    bare_head_dim = None if config is not None else next(
        (tuple(specs[n][0])[0] for n in specs if n.endswith(("self_attn.k_norm.weight", "self_attn.q_norm.weight"))),
        None)
    cache: dict[tuple[Any, ...], list[Any]] = {}
    box_of: dict[str, list[Any]] = {}
    tp, etp = par.tp, par.etp

    def boxes(name: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        got = box_of.get(name)
        if got is None:
            rule, shape = rules[name], tuple(specs[name][0])
            parts = 1 if rule.dim is None else (etp if rule.expert is not None else tp)
            key = (rule.kind, rule.dim, rule.heads, shape, parts)
            got = cache.get(key)
            if got is None:
                got = cache[key] = _boxes(rule, shape, parts, config, name, bare_head_dim)
            box_of[name] = got
        return got

    # Owners of expert e: the ranks of its stage whose ep_rank is e // per_ep.
    owners_of: dict[tuple[int, int], list[Any]] = {}
    for stage, ranks in enumerate(by_stage):
        for c in ranks:
            owners_of.setdefault((stage, c.ep_rank), []).append(c)
    pieces: dict[str, list[Piece]] = {}
    tensors: dict[int, dict[str, LocalSpec]] = {r: {} for r in range(par.world_size)}
    # Box tables live in `cache` for the whole call, so their ids are stable keys.
    entry_cache: dict[tuple[Any, ...], list[Any]] = {}
    owner_index: dict[tuple[Any, ...], list[tuple[int, int, dict[str, LocalSpec]]]] = {}
    member_tables: dict[str, tuple[int, ...]] = {}   # fused tensor -> its members' box tables
    new_tuple = tuple.__new__
    last = par.pp - 1
    for name, (shape, dtype) in specs.items():
        rule = rules[name]
        shape = tuple(shape)
        stage = 0 if rule.where == "first" else last if rule.where == "last" \
            else stages[rule.layer]  # type: ignore[index]
        table = boxes(name)
        dname = dtype if type(dtype) is str else dtype_name(dtype)
        nd = len(shape)
        zero = (0,) * nd
        tensor = name
        if fused and rule.fused is not None:
            tables = member_tables.get(rule.fused)
            if tables is None:
                missing = [m for m in rule.members if m not in specs]
                if missing:
                    raise PlanError(f"cannot fuse {rule.fused!r}: {missing} missing", param=name)
                tables = member_tables[rule.fused] = tuple(id(boxes(m)) for m in rule.members)
            tensor = rule.fused
            mine = rule.members.index(name)
            ekey: tuple[Any, ...] = (id(table), mine, tables, shape, dname)
            entries = entry_cache.get(ekey)
            if entries is None:
                member_rows = [[b[1][0] - b[0][0] for b in boxes(m)] for m in rule.members]
                # Member k starts where members 0..k-1 end on the same tp index.
                entries = entry_cache[ekey] = [
                    (a, b, (sum(rows[i] for rows in member_rows[:mine]),) + zero[1:],
                     LocalSpec((sum(rows[i] for rows in member_rows),) + shape[1:], dname))
                    for i, (a, b) in enumerate(table)]
        else:
            ekey = (id(table), dname)
            entries = entry_cache.get(ekey)
            if entries is None:
                entries = entry_cache[ekey] = [
                    (a, b, zero, LocalSpec(tuple(y - x for x, y in zip(a, b)), dname))
                    for a, b in table]
        expert = rule.expert is not None
        okey = (stage, rule.expert // per_ep if expert else -1, rule.dim is None, expert)
        owners = owner_index.get(okey)
        if owners is None:
            cs = owners_of.get((stage, okey[1]), []) if expert else by_stage[stage]
            owners = owner_index[okey] = [
                (c.rank, 0 if rule.dim is None else (c.etp_rank if expert else c.tp_rank), tensors[c.rank])
                for c in cs]
        # Hot loop (a million pieces for a 235B MoE on tp=8): tuple.__new__ skips the
        # NamedTuple's Python-level constructor; each owner comes with its rank's
        # tensor dict.
        out = pieces[name] = []
        add = out.append
        if tensor is name:
            for rank, i, mine_t in owners:
                start, stop, at, local = entries[i]
                add(new_tuple(Piece, (rank, tensor, start, stop, at)))
                if name in mine_t:
                    raise PlanError(f"rank {rank} holds {name!r} twice", rank=rank, param=name)
                mine_t[name] = local
        else:
            for rank, i, mine_t in owners:
                start, stop, at, local = entries[i]
                add(new_tuple(Piece, (rank, tensor, start, stop, at)))
                prev = mine_t.setdefault(tensor, local)
                if prev is not local and prev != local and (prev.shape[1:] != local.shape[1:]
                                                            or prev.dtype != dname):
                    raise PlanError(f"members of {tensor!r} differ in trailing shape or "
                                    "dtype", param=name)
    # Exact by construction: each local tensor's shape is computed from its pieces' boxes.
    return Layout(world_size=par.world_size,
                  stage_of_rank=tuple(c.pp_stage for c in coords),
                  pieces=pieces, tensors=tensors, exact=True)
