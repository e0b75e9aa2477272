"""The vLLM weight-transfer backends (dense, MoE, FP8, overlap, LoRA) and vLLM's trainer API.

Public names resolve lazily from :mod:`policyworker.integrations.vllm.backend`, so importing a sibling module does not
import it (runtime/lazy.py)."""

from policyworker.runtime.lazy import reexport

__getattr__ = reexport(__name__, "policyworker.integrations.vllm.backend")
