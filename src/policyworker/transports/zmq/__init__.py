"""The zmq transport (colocated; CUDA IPC or shared memory).

Public names resolve lazily from :mod:`policyworker.transports.zmq.transport`, so importing a sibling module does not
import it (runtime/lazy.py)."""

from policyworker.runtime.lazy import reexport

__getattr__ = reexport(__name__, "policyworker.transports.zmq.transport")
