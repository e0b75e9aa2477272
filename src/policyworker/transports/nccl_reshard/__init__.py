"""The nccl_reshard transport (full, delta, relayed).

Public names resolve lazily from :mod:`policyworker.transports.nccl_reshard.transport`, so importing a sibling module does not
import it (runtime/lazy.py)."""

from policyworker.runtime.lazy import reexport

__getattr__ = reexport(__name__, "policyworker.transports.nccl_reshard.transport")
