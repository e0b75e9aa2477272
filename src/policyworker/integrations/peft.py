"""LoRA trainers: refit a PEFT model's adapter, not its frozen base.

A PEFT LoRA model names its tensors ``base_model.model.<hf name>`` with every targeted
linear split into ``<linear>.base_layer.weight`` (the frozen base) and
``<linear>.lora_A.<adapter>.weight`` / ``<linear>.lora_B.<adapter>.weight``. Here they
get the names a PEFT adapter checkpoint uses minus its prefix: the base under the plain
Hugging Face names (``<linear>.weight``, so the base's content hash equals the hash of
the checkpoint it was loaded from) and the factors as ``<linear>.lora_A.weight`` /
``<linear>.lora_B.weight``. The placement rules (:mod:`policyworker.layout.rules`) know
those names: ``A`` of a column-parallel layer is whole on every rank and ``B`` split by
rows like the base; the reverse under a row-parallel layer. A refit moves exactly those
factors; the scaling (``lora_alpha / r``, or ``/ sqrt(r)`` for rsLoRA) is metadata
(:class:`LoraMeta`), not a tensor.

:class:`LoraPolicyWorker` is a ``TorchPolicyWorker`` whose refits move only the
adapter. Its base is checked, never assumed: :func:`base_hash` hashes the base tensors
by name, dtype, shape and bytes, and a receiver that loaded its base elsewhere (vLLM
from a checkpoint) compares the hash at connect. A receiver on another base may be sent
this base once, along with the first adapter refit (a plan that carries both, then the
adapter-only plan: :meth:`LoraPolicyWorker.after_base_refit`).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import msgspec
import torch
from torch import nn

from policyworker.errors import ConfigError
from policyworker.layout.local import shard_views
from policyworker.layout.plan import ReshardPlan
from policyworker.layout.planner import as_parallelism, plan_from_layouts
from policyworker.layout.rules import dtype_name, rule_layout
from policyworker.transports.base import RefitReport
from policyworker.workers.torch_trainer import TorchPolicyWorker

__all__ = ["LoraMerger", "LoraMeta", "LoraPolicyWorker", "adapter_tensors", "base_hash", "base_tensors", "lora_meta",
           "lora_plan", "merge_lora", "tensor_hash"]

_PREFIX = "base_model.model."
_FACTOR = re.compile(r"(.+)\.lora_(A|B)\.([^.]+)\.weight")


class LoraMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What a receiver needs besides the factors: the adapter's PEFT config, as vLLM reads it.

    ``scaling`` is what multiplies ``B @ A`` (``lora_alpha / r``, rsLoRA ``/ sqrt(r)``).
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str]
    scaling: float

    def peft_config(self) -> dict[str, Any]:
        """The ``adapter_config.json`` fields vLLM's ``PEFTHelper`` needs."""
        return {"r": self.r, "lora_alpha": self.lora_alpha, "use_rslora": self.use_rslora,
                "target_modules": list(self.target_modules), "bias": "none", "peft_type": "LORA"}


def _peft_names(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    for name, p in model.named_parameters():
        yield name.removeprefix(_PREFIX), p


def adapter_tensors(model: nn.Module, adapter: str = "default") -> dict[str, nn.Parameter]:
    """The adapter's factors by plain name (``<linear>.lora_A.weight``): the live parameters."""
    out = {}
    for name, p in _peft_names(model):
        m = _FACTOR.fullmatch(name)
        if m and m.group(3) == adapter:
            out[f"{m.group(1)}.lora_{m.group(2)}.weight"] = p
    if not out:
        raise ConfigError(f"the model has no LoRA adapter {adapter!r} (is it a PEFT LoRA model?)")
    return out


def base_tensors(model: nn.Module) -> dict[str, nn.Parameter]:
    """The frozen base by its Hugging Face names (``<linear>.base_layer.weight`` -> ``<linear>.weight``)."""
    out = {}
    for name, p in _peft_names(model):
        if _FACTOR.fullmatch(name):
            continue
        out[name.replace(".base_layer.", ".")] = p
    return out


def lora_meta(model: nn.Module, adapter: str = "default") -> LoraMeta:
    """The adapter's rank, alpha and scaling from its PEFT config (ConfigError for what vLLM can't serve)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or adapter not in configs:
        raise ConfigError(f"the model has no PEFT config for adapter {adapter!r}")
    c = configs[adapter]
    if getattr(c, "rank_pattern", None) or getattr(c, "alpha_pattern", None):
        raise ConfigError("LoRA refit supports one rank and alpha for every module (no rank_pattern/alpha_pattern)")
    if getattr(c, "use_dora", False) or getattr(c, "bias", "none") != "none":
        raise ConfigError("LoRA refit supports plain LoRA factors (no DoRA, no LoRA biases)")
    r, alpha, rs = int(c.r), float(c.lora_alpha), bool(c.use_rslora)
    targets = c.target_modules if isinstance(c.target_modules, str) else sorted(c.target_modules)
    return LoraMeta(r=r, lora_alpha=alpha, use_rslora=rs, target_modules=[targets] if isinstance(targets, str)
                    else list(targets), scaling=alpha / math.sqrt(r) if rs else alpha / r)


def tensor_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors sorted by name: name, dtype, shape, then the bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}\n".encode())
        flat = t.contiguous().cpu().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def base_hash(model: nn.Module) -> str:
    """The content hash of the frozen base (plain names): what a receiver's checkpoint must hash to."""
    return tensor_hash(base_tensors(model))


def lora_plan(specs: Mapping[str, tuple[tuple[int, ...], Any]], config: Any, train: Any, gen: Any,
              train_world_size: int, gen_world_size: int) -> ReshardPlan:
    """The reshard plan of the adapter's factors (``specs``) from ``train`` to ``gen`` layouts.

    ``config`` (a ``ModelConfig``) splits the factors of q/k/v/o by heads as it splits the base.
    """
    train_p, gen_p = as_parallelism(train, "train"), as_parallelism(gen, "gen")
    train_p.check_world_size(train_world_size, side="train")
    gen_p.check_world_size(gen_world_size, side="gen")
    src = rule_layout(specs, train_p, config=config, fused=False)
    dst = rule_layout(specs, gen_p, config=config, fused=False)
    return plan_from_layouts(specs, src, dst, train=train_p, gen=gen_p, gen_fused=False)


def merge_lora(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``W + scaling * (B @ A)``, computed in float32 and cast to ``W``'s dtype (into ``out``).

    float32 weights: this is PEFT's own merge formula, equal bit for bit. bf16 weights:
    one rounding of the float32 result to bf16 (relative error at most 2**-8 per element).
    """
    delta = (lora_b.float() @ lora_a.float()) * scaling
    merged = weight.float() + delta
    if out is None:
        return merged.to(weight.dtype)
    return out.copy_(merged)


class LoraPolicyWorker(TorchPolicyWorker):
    """A ``TorchPolicyWorker`` over a PEFT LoRA model whose refits move only the adapter.

    The model holds the full factors (each trainer rank sends its shard of them, views,
    no copies); the plan places them by the rules (see the module docstring) with the
    base model's heads. ``meta`` and ``base_hash`` say, once at connect, what the
    receiver must scale by and which base it must hold.
    """

    def __init__(self, model: nn.Module, *, adapter: str = "default", **kwargs: Any) -> None:
        self.adapter = adapter
        self._adapter = adapter_tensors(model, adapter)
        self._base = base_tensors(model)
        self.meta = lora_meta(model, adapter)
        self._base_hash: str | None = None
        #: transport name -> (re-attach with the adapter-only plan, this rank's base bytes)
        self._after_base: dict[str, tuple[Callable[[], Awaitable[Any]], int]] = {}
        super().__init__(model, **kwargs)

    def base_hash(self) -> str:
        """The frozen base's content hash (computed once: the base never changes)."""
        if self._base_hash is None:
            self._base_hash = base_hash(self.model)
        return self._base_hash

    def adapter_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._adapter.values())

    def base_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The base's ``{checkpoint name: (shape, dtype)}`` (what a plan that sends the base places)."""
        return {name: (tuple(t.shape), t.dtype) for name, t in self._base.items()}

    def _named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._adapter

    def _plan_tensors(self, plan: ReshardPlan) -> Mapping[str, torch.Tensor]:
        if all(p.name in self._adapter for p in plan.params):
            return super()._plan_tensors(plan)
        # A plan that sends the base too: this rank's shards of both (views of the full tensors).
        rank = 0 if plan.body.train_world_size == 1 else self.rank
        return shard_views(plan, rank, {**self._base, **self._adapter})

    def after_base_refit(self, name: str, reattach: Callable[[], Awaitable[Any]] | None, *,
                         base_bytes: int = 0) -> None:
        """Transport ``name``'s attached plan sends the base too: after its next successful
        refit, ``await reattach()`` (attach the adapter-only plan, connected at the refit
        after) and report ``base_bytes`` (this rank's) in that refit's report. A failed
        refit changes nothing: the next one sends the base again. None forgets it."""
        if reattach is None:
            self._after_base.pop(name, None)
        else:
            self._after_base[name] = (reattach, int(base_bytes))

    async def refit(self, name: str, /, **kwargs: Any) -> RefitReport:
        """The road's refit; after the one that carried the base, the adapter-only plan
        (see :meth:`after_base_refit`) and ``base_bytes`` in its report."""
        report = await super().refit(name, **kwargs)
        then = self._after_base.pop(name, None)
        if then is None:
            return report
        reattach, base_bytes = then
        await reattach()
        return msgspec.structs.replace(report, base_bytes=base_bytes)

    def _refit_model_source(self) -> Any:
        return {name: (tuple(t.shape), t.dtype) for name, t in self._adapter.items()}

    def _refit_gen_config(self) -> Any:
        from policyworker.models import ModelConfig

        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return ModelConfig.from_hf(base.config)

    def _refit_dtype(self) -> Any:
        dtypes = {t.dtype for t in self._adapter.values()}
        return dtypes.pop() if len(dtypes) == 1 else torch.float32

    def lora_plan(self, train_parallelism: Any, gen_parallelism: Any, train_world_size: int,
                  gen_world_size: int) -> ReshardPlan:
        return lora_plan(self._refit_model_source(), self._refit_gen_config(), train_parallelism, gen_parallelism,
                         train_world_size, gen_world_size)

    async def prepare_nccl_reshard_refit_info(self, train_parallelism: Any, gen_parallelism: Any,
                                              train_world_size: int, gen_world_size: int) -> dict:
        """As ``TorchPolicyWorker``'s, for the adapter's factors (placed with the base's heads)."""
        self._ensure_open()
        plan = await self._run(self.lora_plan, train_parallelism, gen_parallelism, train_world_size, gen_world_size)
        return self._wire_plan("nccl_reshard", plan)



class LoraMerger:
    """Serve an adapter merged into a rollout's own weights: ``W = W0 + s·B·A`` after each commit.

    ``weights``: this rank's serving tensors of the targeted linears by plain name
    (``<linear>.weight``, shards in the same generation layout as the factors: the
    rules shard ``B`` like a column-parallel ``W``'s rows and ``A`` like a row-parallel
    ``W``'s columns, so the local product is exactly this rank's part of ``B @ A``).
    Their values now are the base ``W0``, kept (one copy) so every version merges onto the
    base, never onto the previous version. ``merge`` computes every merged tensor before
    writing any: a bad factor raises ``ConfigError`` with the weights unchanged.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], scaling: float) -> None:
        self.weights = dict(weights)
        self.scaling = float(scaling)
        self._base = {n: w.detach().clone() for n, w in self.weights.items()}

    def merge(self, factors: Mapping[str, torch.Tensor]) -> None:
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in factors.items():
            m = re.fullmatch(r"(.+)\.lora_(A|B)\.weight", name)
            if m is None:
                raise ConfigError(f"{name!r} is not a LoRA factor", param=name)
            pairs.setdefault(f"{m.group(1)}.weight", {})[m.group(2)] = t
        merged = {}
        with torch.no_grad():
            for target, ab in pairs.items():
                if target not in self.weights or set(ab) != {"A", "B"}:
                    raise ConfigError(f"cannot merge into {target!r}: no such weight here, or a factor is missing",
                                      param=target)
                w0, a, b = self._base[target], ab["A"], ab["B"]
                if (b.shape[0], a.shape[1]) != tuple(w0.shape) or a.shape[0] != b.shape[1]:
                    raise ConfigError(f"factors B{list(b.shape)} @ A{list(a.shape)} do not fit {target!r} "
                                      f"{list(w0.shape)}", param=target)
                merged[target] = merge_lora(w0, a, b, self.scaling)
            for target, value in merged.items():
                self.weights[target].copy_(value)
