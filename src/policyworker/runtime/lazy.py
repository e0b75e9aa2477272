"""A package whose public names live in one of its modules, resolved on first use.

``transports/nccl_reshard/`` was one module; its package keeps the old import path
(``policyworker.transports.nccl_reshard:NcclReshardTransport``, the entry point) without
importing the transport when a sibling module is all that is needed::

    __getattr__ = reexport(__name__, "policyworker.transports.nccl_reshard.transport")
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

__all__ = ["reexport"]


def reexport(package: str, module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a sibling module by its name (what
    ``from . import x`` asks for), else ``module``'s attribute of that name."""

    def __getattr__(name: str) -> Any:
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        try:
            return getattr(importlib.import_module(module), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
