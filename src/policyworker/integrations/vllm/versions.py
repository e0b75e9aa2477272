"""Which weight version a vLLM engine served at which step, readable by a controller.

The backend counts the model's forward passes (one per engine step on an eager engine)
and records ``(version, step count at its commit)`` for every commit. A controller
reads that record through vLLM's ``collective_rpc``, one dict per worker:

* offline ``LLM`` / ``AsyncLLM``: ``collective_rpc(weight_versions)`` (a function: vLLM
  serializes it only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), or, with
  ``worker_extension_cls=EXTENSION``, ``collective_rpc("policyworker_weight_versions")``;
* ``vllm serve`` (``VLLM_SERVER_DEV_MODE=1``, which the weight-transfer routes need
  anyway) with ``--worker-extension-cls`` set to :data:`EXTENSION`:
  ``POST /collective_rpc {"method": "policyworker_weight_versions"}``.

The record: ``version`` (committed, 0: none yet), ``torn``, ``steps`` (forward passes so
far), ``commits`` (``[version, step]`` pairs, oldest first) and ``receiving`` (the
overlapped receive in flight: its version, the step it started at, whether every
byte ``landed`` and whether its post-processing ended too (``ready``: then
``finish_weight_update`` will only swap); None when none is). See
docs/vllm-overlap.md for what this attributes and what it cannot.
"""

from __future__ import annotations

from typing import Any

from policyworker.errors import ConfigError

__all__ = ["EXTENSION", "WeightVersionsExtension", "weight_versions"]

#: ``worker_extension_cls`` / ``--worker-extension-cls`` value that adds the RPC method.
EXTENSION = "policyworker.integrations.vllm.versions.WeightVersionsExtension"


def weight_versions(worker: Any) -> dict[str, Any]:
    """The version record of the ``"policyworker"`` backend inside vLLM ``worker``."""
    from policyworker.integrations.vllm.backend import PolicyworkerWeightTransferEngine

    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, PolicyworkerWeightTransferEngine):
        raise ConfigError(f"this vLLM worker's weight-transfer backend is {type(engine).__name__}, not the "
                          f"policyworker backend: no version record")
    return engine.versions()


class WeightVersionsExtension:
    """A vLLM worker extension: ``collective_rpc("policyworker_weight_versions")`` by name
    (the only form vLLM's HTTP ``/collective_rpc`` route accepts)."""

    def policyworker_weight_versions(self) -> dict[str, Any]:
        return weight_versions(self)

    def policyworker_step_times(self, since: float = 0.0) -> list[tuple[float, float]]:
        """(start, end) of the kept forward passes that started at or after ``since``
        (``time.monotonic()`` of this host): how long the engine stood still between steps."""
        weight_versions(self)  # refuses a worker without our backend
        return self.weight_transfer_engine.steps.times(since)

    def policyworker_engine_steps(self, since: float = 0.0) -> list[tuple[float, float]]:
        """(start, end) of this worker's engine steps that started at or after ``since``
        (``execute_model`` call to ``sample_tokens`` return, :mod:`.steps`): the engine is idle
        between two. Recording starts at the first call, which returns []."""
        weight_versions(self)
        from policyworker.integrations.vllm.steps import WorkerSteps

        return WorkerSteps.of(self).times(since)

    def policyworker_refit_times(self) -> dict[str, float]:
        """Monotonic times of the phases of the last overlapped refit that reached
        ``finish_weight_update`` on this rank ({} if none)."""
        weight_versions(self)
        last = self.weight_transfer_engine.last_overlap
        return dict(last.times) if last is not None else {}
