"""The one way our commands and benchmarks hand out a JSON result."""

from __future__ import annotations

import json
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
