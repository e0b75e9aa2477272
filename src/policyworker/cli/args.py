"""Argument types of the command line: each rejects bad input at parse time, in one line."""

from __future__ import annotations

import argparse
import json
import os
import types
from collections.abc import Callable
from pathlib import Path

from policyworker.models.config import ModelConfig, get_preset

__all__ = ["int_at_least", "json_path", "model_config", "positive_float"]


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum {low}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def json_path(text: str) -> str:
    """A path the result can be written to: its directory exists and is writable."""
    parent = Path(text).expanduser().resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {str(parent)!r} is not writable")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    return text


def model_config(ref: str) -> ModelConfig:
    """A preset's name, or a Hugging Face ``config.json`` (or the model directory holding one).

    The config is read as JSON (no transformers import, no weights); unknown model types
    and layouts the rules cannot place are ``ConfigError``.
    """
    from policyworker.errors import ConfigError
    from policyworker.models.config import model_config_from_hf

    path = Path(ref).expanduser()
    if not path.exists():
        if os.sep in ref or ref.endswith(".json"):
            raise ConfigError(f"model config {ref!r} does not exist")
        return get_preset(ref)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"model directory {ref!r} has no config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read model config {str(path)!r}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"model config {str(path)!r} is not a JSON object")
    raw.setdefault("name_or_path", str(path.parent))
    return model_config_from_hf(types.SimpleNamespace(**raw))
