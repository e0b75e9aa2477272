"""Which pytest-xdist worker this process is: (its index, the number of workers); (0, 1)
outside xdist. The suite's conftest gives each worker a port slice by it, and the vLLM
tests a CPU core."""

from __future__ import annotations

import os


def worker_slot() -> tuple[int, int]:
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not name.startswith("gw") or not name[2:].isdigit():
        return 0, 1
    return int(name[2:]), max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
