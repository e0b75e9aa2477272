"""Pairs of real workers for :func:`~policyworker.testing.check_transport`, from public API only.

:class:`TransportPair` is what a conformance factory returns: a trainer-side worker
and a ``RolloutWorker``, not yet attached, plus the setup each side attaches with.
:func:`plain_pair` builds one for a plan-less transport from a dict of tensors (the
trainer is a ``TorchPolicyWorker`` over a module holding copies of them, the rollout
holds zeros of the same names, dtypes and shapes).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from policyworker.transports.base import Transport

__all__ = ["TransportPair", "plain_pair", "tensor_module"]


@dataclass
class TransportPair:
    """One sender and one receiver worker that refit over one transport, not yet attached.

    ``sender``: a trainer-side worker (``TorchPolicyWorker`` or another
    ``AbstractPolicyWorker``); ``receiver``: a ``RolloutWorker``. ``transport``: the
    registered name, or a zero-argument callable returning a fresh ``Transport``
    instance (called once per side; for transports under test that are not installed).
    ``sender_setup`` / ``receiver_setup``: what each side's ``attach_transport`` gets
    (``plan=`` included for a transport that reshards). ``source``: the sender's live
    tensors the suite changes before each refit (default: ``sender.model``'s
    parameters). ``expected(source)``: what the receiver must hold afterwards (default:
    the same tensors by name). ``close`` (optional): releases what the factory built
    besides the workers (groups, directories); the suite shuts the workers down itself.
    """

    sender: Any
    receiver: Any
    transport: str | Callable[[], Transport]
    sender_setup: Mapping[str, Any] = field(default_factory=dict)
    receiver_setup: Mapping[str, Any] = field(default_factory=dict)
    source: Mapping[str, torch.Tensor] | None = None
    expected: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] = lambda p: p
    close: Callable[[], Awaitable[None]] | None = None

    def sources(self) -> Mapping[str, torch.Tensor]:
        if self.source is not None:
            return self.source
        model = getattr(self.sender, "model", None)
        if model is None:
            from policyworker.errors import ConfigError

            raise ConfigError("TransportPair.source is required when the sender has no .model")
        return dict(model.named_parameters())

    def instance(self) -> str | Transport:
        """What ``attach_transport`` gets: the name, or a fresh instance."""
        return self.transport if isinstance(self.transport, str) else self.transport()

    @property
    def name(self) -> str:
        if isinstance(self.transport, str):
            return self.transport
        return getattr(self.transport, "name", "") or type(self.transport()).name


class _Holder(nn.Module):
    pass


def tensor_module(params: Mapping[str, torch.Tensor]) -> nn.Module:
    """A module whose parameters are copies of ``params`` under the same dotted names
    (integer tensors included, as parameters that need no grad)."""
    from policyworker.errors import ConfigError

    root = _Holder()
    for name, tensor in params.items():
        *path, leaf = name.split(".")
        mod = root
        try:
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, _Holder())
                mod = mod._modules[part]
            mod.register_parameter(leaf, nn.Parameter(tensor.detach().clone(),
                                                      requires_grad=tensor.is_floating_point()))
        except (KeyError, TypeError) as exc:  # torch's refusals of a name: empty, taken by nn.Module
            raise ConfigError(f"tensor name {name!r} cannot be a module path ({exc}); rename it", param=name) from exc
    return root


def plain_pair(
    transport: str | Callable[[], Transport],
    params: Mapping[str, torch.Tensor],
    *,
    setup: Mapping[str, Any] | None = None,
    sender_setup: Mapping[str, Any] | None = None,
    receiver_setup: Mapping[str, Any] | None = None,
    receiver_params: Mapping[str, torch.Tensor] | None = None,
    close: Callable[[], Awaitable[None]] | None = None,
    timeout_s: float = 30.0,
) -> TransportPair:
    """A CPU pair for a plan-less transport: a ``TorchPolicyWorker`` over copies of
    ``params`` and a ``RolloutWorker`` holding zeros like them (or like
    ``receiver_params``). ``setup`` goes to both sides, ``sender_setup`` /
    ``receiver_setup`` to one (they win over ``setup``)."""
    from policyworker.workers.rollout import RolloutWorker
    from policyworker.workers.torch_trainer import TorchPolicyWorker

    module = tensor_module(params)
    sender = TorchPolicyWorker(module, device="cpu", timeout_s=timeout_s)
    dst = {k: torch.zeros_like(v) for k, v in (receiver_params or params).items()}
    receiver = RolloutWorker(params=dst, device="cpu", timeout_s=timeout_s)
    return TransportPair(sender, receiver, transport, {**(setup or {}), **(sender_setup or {})},
                         {**(setup or {}), **(receiver_setup or {})}, dict(module.named_parameters()), close=close)
