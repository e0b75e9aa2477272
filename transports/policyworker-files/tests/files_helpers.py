"""Shared pieces of the plugin's tests: a tiny trainer/rollout pair and seeded weights."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from policyworker import RolloutWorker, TorchPolicyWorker
from policyworker.models import get_preset, seeded_state_dict
from policyworker.models.toy_model import build_model

PRESET = "tiny"


def weights(version: int) -> dict[str, torch.Tensor]:
    """The weights the trainer holds for ``version`` (every version different)."""
    return seeded_state_dict(get_preset(PRESET), seed=version, dtype=torch.float32)


def set_weights(model: torch.nn.Module, version: int) -> None:
    new = weights(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new[name])


def exact(have: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> bool:
    return set(have) == set(want) and all(torch.equal(have[k], want[k]) for k in want)


def make_trainer(*, rank: int = 0, world_size: int = 1, seed: int = 0) -> TorchPolicyWorker:
    return TorchPolicyWorker(build_model(get_preset(PRESET), seed=seed), rank=rank, world_size=world_size,
                             device="cpu", timeout_s=30.0)


def make_rollout(*, rank: int = 0, gen_world_size: int = 1) -> RolloutWorker:
    """A rollout whose destinations are zeros shaped like the tiny model's parameters."""
    model = build_model(get_preset(PRESET), seed=0)
    params = {name: torch.zeros_like(p.detach()) for name, p in model.named_parameters()}
    return RolloutWorker(rank=rank, gen_world_size=gen_world_size, params=params, device="cpu", timeout_s=30.0)


def listing(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def committed(directory: str) -> list[str]:
    return [n for n in listing(directory) if n.startswith("v")]


def flip_byte(path: str, offset: int) -> None:
    """Flip every bit of one byte of ``path`` in place (``offset`` < 0 counts from the end)."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        pos = f.tell()
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))
