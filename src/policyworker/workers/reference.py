"""The reference policy of a ``TorchPolicyWorker``: its weights checked and copied once,
the batches it scores checked, and per-token log-probs of a forward.

The worker swaps these CPU copies into the model's parameters for
``get_reference_policy_logprobs`` (on its refit executor); everything here is
stateless: checks that raise ``ConfigError`` before any weight moves, and the math.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from policyworker.errors import ConfigError
from policyworker.layout.local import is_dtensor

__all__ = ["check_batch", "check_micro_batch_size", "check_values", "cpu_copies", "local_shard",
           "reference_sources", "token_logprobs"]


def check_micro_batch_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"micro_batch_size must be an int > 0, got {value!r}")
    return value


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage, as FSDP2 keeps it); others as they are."""
    return t.to_local() if is_dtensor(t) else t


def reference_sources(
    model: nn.Module, unique: list[tuple[str, nn.Parameter]], names: dict[str, int], state: Any
) -> list[torch.Tensor]:
    """One source tensor per unique parameter, validated against the model (ConfigError)."""
    if state is None:
        return [p for _, p in unique]
    if not isinstance(state, Mapping):
        raise ConfigError(f"reference_state_dict must be a mapping of name -> tensor, got {type(state).__name__}")
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    unknown = sorted(k for k in state if k not in names and k not in buffers)
    if unknown:
        raise ConfigError(f"reference_state_dict names no parameter of the model: {unknown[:5]}", param=unknown[0])
    sources: list[torch.Tensor | None] = [None] * len(unique)
    for key, value in state.items():
        if key not in names:
            continue  # a buffer: buffers are not policy weights and are not swapped
        param = unique[names[key]][1]
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"reference_state_dict[{key!r}] is a {type(value).__name__}, not a tensor", param=key)
        if is_dtensor(param) and not is_dtensor(value):
            raise ConfigError(f"reference_state_dict[{key!r}] is a plain tensor but the model's parameter is a "
                              "DTensor (FSDP2): pass DTensors sharded like the model's, e.g. its state_dict()",
                              param=key)
        if value.shape != param.shape:
            raise ConfigError(
                f"reference_state_dict[{key!r}] has shape {tuple(value.shape)}, the model's {tuple(param.shape)}",
                param=key,
            )
        if sources[names[key]] is None:
            sources[names[key]] = value
    missing = [unique[i][0] for i, src in enumerate(sources) if src is None]
    if missing:
        raise ConfigError(f"reference_state_dict lacks {len(missing)} parameter(s): {missing[:5]}", param=missing[0])
    return sources  # type: ignore[return-value]


def cpu_copies(sources: list[torch.Tensor], like: list[tuple[str, nn.Parameter]], pin: bool) -> list[torch.Tensor]:
    """CPU tensors shaped and typed like the parameters (cast to the parameter's dtype)."""
    out = []
    with torch.no_grad():
        for src, (_, param) in zip(sources, like):
            shard = local_shard(param)  # FSDP2: each rank keeps its own shard of the reference
            dst = torch.empty(shard.shape, dtype=shard.dtype, device="cpu", pin_memory=pin)
            dst.copy_(local_shard(src).detach())
            out.append(dst)
    return out


def _logits_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ConfigError(
        f"the model's forward returned {type(output).__name__}; expected a logits tensor or an object with .logits"
    )


def check_batch(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Structural checks, cheap enough for the loop; values are checked on the executor."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"data must be a mapping with input_ids and input_lengths, got {type(data).__name__}")
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise ConfigError(f"data lacks {key!r} (has {sorted(map(str, data))})")
        if not isinstance(data[key], torch.Tensor):
            raise ConfigError(f"data[{key!r}] must be a torch.Tensor, got {type(data[key]).__name__}")
    ids, lengths = data["input_ids"], data["input_lengths"]
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ConfigError(f"input_ids must be an int64 tensor [B, S], got {ids.dtype} of shape {tuple(ids.shape)}")
    if lengths.dim() != 1 or lengths.shape[0] != ids.shape[0] or lengths.dtype not in (torch.int64, torch.int32):
        raise ConfigError(
            f"input_lengths must be an int64 tensor [B={ids.shape[0]}], got {lengths.dtype} of shape {tuple(lengths.shape)}"
        )
    return ids, lengths


def check_values(ids: torch.Tensor, lengths: torch.Tensor,
                 vocab: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Value checks (on the executor): lengths in [0, S], token ids in [0, vocab) inside them.

    Returns (ids with padding zeroed, lengths, the valid mask), all on the CPU.
    """
    ids, lengths = ids.to("cpu", torch.int64), lengths.to("cpu", torch.int64)
    seq = ids.shape[1]
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > seq):
        raise ConfigError(f"input_lengths must lie in [0, S={seq}], got values in [{int(lengths.min())}, {int(lengths.max())}]")
    valid = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
    real = ids[valid]
    if real.numel() and int(real.min()) < 0:
        raise ConfigError("input_ids holds negative token ids inside input_lengths")
    if isinstance(vocab, int) and real.numel() and int(real.max()) >= vocab:
        raise ConfigError(f"input_ids holds token id {int(real.max())} >= the model's vocab_size {vocab}")
    # Padding may hold anything (-100, pad ids); causal attention never lets it
    # reach the valid positions, so any in-range id does.
    return torch.where(valid, ids, 0), lengths, valid


def token_logprobs(model: nn.Module, chunk: torch.Tensor) -> torch.Tensor:
    """``[b, w]`` ids -> ``[b, w-1]`` float32 log p(chunk[:, 1:] | prefix)."""
    logits = _logits_of(model(chunk))
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(chunk.shape):
        raise ConfigError(f"the model returned logits of shape {tuple(logits.shape)} for input_ids {tuple(chunk.shape)}")
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, chunk[:, 1:].unsqueeze(-1)).squeeze(-1)
