"""A LoRA engine's base, sent once: received with the first adapter refit, committed with it.

A ``"policyworker-lora"`` engine serves adapters on the base it loaded. When the
trainers prepared with ``base="send_if_different"`` and their base hashes otherwise,
their first plan carries their base too (:mod:`.lora_plan`), into the boxes this rank's
layers load (:func:`base_needs`: the dense backend's targets, read through vLLM's LoRA
wrappers). The base then travels like a dense refit into vLLM: into a staging set no
live layer references (:class:`~.stage.VllmStage`, one set: it is received and
committed once, then dropped), post-processed with vLLM's own code off the live layers
(:meth:`PendingBase.prepare`), and swapped in by the commit right before the adapter is
installed (:meth:`PendingBase.commit`). Until that commit vLLM serves what it served:
a refit that fails on the wire leaves nothing of the base live, the engine keeps its
old base hash, and the next connect sends the base again.

Memory: one staging copy of this rank's base while it is pending (half what the dense
backend keeps: it never receives a second version).
"""

from __future__ import annotations

from typing import Any

import torch

from policyworker.errors import ConfigError, PlanMismatch
from policyworker.layout.plan import ReshardPlan
from policyworker.integrations.vllm.loader_check import check_with_vllm_loaders
from policyworker.integrations.vllm.plan import Needs
from policyworker.integrations.vllm.stage import Prepared, VllmStage
from policyworker.integrations.vllm.targets import Target, needs_of, vllm_targets

__all__ = ["PendingBase", "base_needs"]


def base_needs(model: torch.nn.Module, *, rank: int, tp_rank: int, tp_size: int,
               dtype: Any) -> tuple[list[Target] | None, Needs | None, str]:
    """``(targets, needs, "")`` of the base this rank loads, or ``(None, None, why not)``.

    Never raises for an unsupported layer: an engine whose base cannot be sent still
    serves adapters on its own base (the trainers learn why when they would send it).
    """
    try:
        targets = vllm_targets(model)
    except ConfigError as exc:
        return None, None, str(exc)
    needs = needs_of(targets, rank=rank, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
    if needs.fp8_block or any(t.derived for t in targets):
        return None, None, "its base has block-FP8 layers; the LoRA backend sends unquantized bases only"
    return targets, needs, ""


class PendingBase:
    """The trainers' base on its way into this vLLM rank (see the module docstring).

    ``plan``: the trainers' first plan (the base and the factors); ``needs``: what this
    rank loads (``rank`` its generation rank). Checks that the plan delivers exactly
    those boxes (``PlanMismatch``) and vLLM's loaders place them as the staging does.
    """

    def __init__(self, model: torch.nn.Module, targets: list[Target], needs: Needs, plan: ReshardPlan,
                 base_hash: str, *, rank: int, device: torch.device, cpu_linear: str,
                 copy_into_live: bool) -> None:
        self.plan = plan
        self.base_hash = base_hash
        #: Every byte of the base landed (the refit that carried it succeeded).
        self.received = False
        want = {n.name: (tuple(n.start), tuple(n.stop)) for n in needs.needs}
        got, wire = {}, {}
        for local in plan.local_tensors("dst", rank).values():
            for p in local.pieces:
                name = plan.params[p.param].name
                if name in want:
                    got[name] = (tuple(p.start), tuple(p.stop))
                    wire[name] = local.dtype
        if got != want:
            missing = sorted(set(want) - set(got))
            raise PlanMismatch(f"the trainers' base plan does not deliver what vLLM rank {rank} loads"
                               f"{f' (e.g. {missing[0]!r})' if missing else ''}", rank=rank)
        self.stage = VllmStage(model, targets, device=device, once=True)
        self.stage.cpu_linear = cpu_linear
        self.stage.copy_into_live = copy_into_live
        check_with_vllm_loaders(self.stage)
        self.stage.set_wire_dtypes(wire)
        self.nbytes = sum(v.numel() * v.element_size() for v in self.receive_views().values())

    def receive_views(self) -> dict[str, torch.Tensor]:
        """Where the base's boxes land (by checkpoint name)."""
        return self.stage.receive_views()

    def prepare(self) -> Prepared:
        """vLLM's post-processing of the received base, on copies of the layers (nothing live changes)."""
        if not self.received:
            raise ConfigError("the trainers' base has not been received; nothing to commit")
        return self.stage.prepare()

    def commit(self, prepared: Prepared) -> None:
        """Swap the prepared base into the live layers (attribute moves; a failure part way
        leaves some layers on the new base)."""
        self.stage.commit(prepared)

