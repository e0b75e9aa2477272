"""The sglang_ipc transport (SGLang's update_weights_from_tensor).

Public names resolve lazily from :mod:`policyworker.transports.sglang_ipc.transport`, so importing a sibling module does not
import it (runtime/lazy.py)."""

from policyworker.runtime.lazy import reexport

__getattr__ = reexport(__name__, "policyworker.transports.sglang_ipc.transport")
