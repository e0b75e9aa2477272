"""The one way our commands and benchmarks hand out a JSON result (and the spread they report)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def write_json(path: str | Path | None, result: Any, *, echo: bool = False, indent: int = 2) -> None:
    """Write ``result`` as JSON to ``path`` (skipped when ``path`` is empty) and, with
    ``echo``, print the same text to stdout (the benchmarks' contract: JSON out)."""
    text = json.dumps(result, indent=indent)
    if echo:
        print(text)
    if path:
        Path(path).write_text(text + "\n", encoding="utf-8")


def ratio_spread(values: list[float]) -> dict[str, float | int]:
    """min / quartiles / max of per-pair ratios, and how many pairs (the benchmarks' ``ratio_spread``)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"min": min(values), "p25": q1, "p75": q3, "max": max(values), "pairs": len(values)}
