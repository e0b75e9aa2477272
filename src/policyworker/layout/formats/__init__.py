"""Destination formats: the registry.

* :mod:`.base` — the contract (`DestFormat`, `FormatTarget`, `PullLaunch`).
* :mod:`.plain` — `PlainFormat`: bytes land as they were sent (a plan's default).
* :mod:`.block_fp8` (+ :mod:`.block_fp8_grid`, :mod:`.block_fp8_pack`) —
  `BlockFp8Format` and its planning input `Fp8Target` (``fp8=block128``).

`AnyFormat` is every format a plan's wire form may carry (a msgspec tagged union on
``"name"``); `split_gen_layout` reads a format option out of a generation layout.
Adding a format is a module here plus one entry in each of the two tables below
(``docs/formats.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from policyworker.layout.formats import block_fp8
from policyworker.layout.formats.base import DestFormat, FormatTarget, PullLaunch
from policyworker.layout.formats.block_fp8 import BlockFp8Format, Fp8Target
from policyworker.layout.formats.plain import PlainFormat

__all__ = ["LAYOUT_OPTIONS", "PLAIN", "AnyFormat", "BlockFp8Format", "DestFormat", "Fp8Target", "FormatTarget",
           "PlainFormat", "PullLaunch", "layout_fields", "split_gen_layout"]

#: Every format the plan's wire form knows, by its tag.
AnyFormat = PlainFormat | BlockFp8Format

PLAIN = PlainFormat()

#: Generation-layout options that pick a format: key -> parser of the option's value.
LAYOUT_OPTIONS: Mapping[str, Callable[[str], FormatTarget]] = {
    block_fp8.LAYOUT_KEY: block_fp8.parse_layout_option,
}


def split_gen_layout(value: Any) -> tuple[Any, FormatTarget | None]:
    """``"tp=2,fp8=block128"`` -> (``"tp=2"``, ``Fp8Target(block=128)``); a mapping with
    a format key likewise; anything else passes through with ``None``. One format
    option at most (the last one given wins, as a repeated key does)."""
    if isinstance(value, str) and any(key in value for key in LAYOUT_OPTIONS):
        keep, target = [], None
        for item in value.split(","):
            key, _, val = item.strip().partition("=")
            if key.strip() in LAYOUT_OPTIONS:
                target = LAYOUT_OPTIONS[key.strip()](val.strip())
            elif item.strip():
                keep.append(item.strip())
        return ",".join(keep) or "tp=1", target
    if isinstance(value, Mapping) and any(key in value for key in LAYOUT_OPTIONS):
        rest = {k: v for k, v in value.items() if k not in LAYOUT_OPTIONS}
        target = None
        for key, val in value.items():
            if key in LAYOUT_OPTIONS:
                target = LAYOUT_OPTIONS[key](str(val))
        return rest, target
    return value, None


def layout_fields(target: FormatTarget | None) -> dict[str, str | None]:
    """``{option key: value or None}`` for every layout option (a report's columns)."""
    out: dict[str, str | None] = dict.fromkeys(LAYOUT_OPTIONS)
    if target is not None:
        key, val = target.layout_option()
        out[key] = val
    return out
