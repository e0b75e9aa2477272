"""policyworker: move policy weights from trainers to rollout engines after every step.

Public surface (guarded by ``tests/test_public_api.py``): what users call — the
workers and their one refit road (``attach_transport`` / ``refit`` /
``detach_transport``), the commit ledger, the errors, the transport contract and the
built-in transport classes, the conformance suite, plans and model configs. Import
from here, not from submodules, unless you write a transport (then
``policyworker.transports.base`` and ``policyworker.config``). Transport classes and
``check_transport`` are imported on first use, so ``import policyworker`` loads no
transport.
"""

import importlib as _importlib

from policyworker.runtime.control import ControlClient
from policyworker.errors import (
    AccessDenied,
    CheckpointError,
    ConfigError,
    PeerLost,
    PlanError,
    PlanMismatch,
    PolicyWorkerError,
    ProcessFailed,
    ProtocolError,
    RefitAborted,
    RefitInProgress,
    RefitTimeout,
    TornWeights,
    TransportError,
    TransportLoadError,
    WorkerClosed,
)
from policyworker.layout import Parallelism, ReshardPlan, build_plan
from policyworker.ledger import WeightLedger
from policyworker.models import PRESETS, ModelConfig, get_preset
from policyworker.registry import TransportInfo, list_transports, load_transport
from policyworker.workers.rollout import RolloutWorker
from policyworker.workers.torch_trainer import TorchPolicyWorker
from policyworker.transports.base import RefitReport, Transport, TransportContext
from policyworker.workers.trainer import AbstractPolicyWorker

__version__ = "0.1.0"

_LAZY = {
    "NcclReshardTransport": "policyworker.transports.nccl_reshard.transport",
    "ZmqIpcTransport": "policyworker.transports.zmq.transport",
    "SglangIpcTransport": "policyworker.transports.sglang_ipc.transport",
    "InMemoryTransport": "policyworker.testing",
    "check_transport": "policyworker.testing",
    "SglangHttpEngine": "policyworker.transports.sglang_ipc.client",
    "InProcessSglangEngine": "policyworker.integrations.sglang.engine",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'policyworker' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AbstractPolicyWorker",
    "AccessDenied",
    "CheckpointError",
    "ConfigError",
    "ControlClient",
    "InMemoryTransport",
    "InProcessSglangEngine",
    "ModelConfig",
    "NcclReshardTransport",
    "PRESETS",
    "Parallelism",
    "PeerLost",
    "PlanError",
    "PlanMismatch",
    "PolicyWorkerError",
    "ProcessFailed",
    "ProtocolError",
    "RefitAborted",
    "RefitInProgress",
    "RefitReport",
    "RefitTimeout",
    "ReshardPlan",
    "RolloutWorker",
    "SglangHttpEngine",
    "SglangIpcTransport",
    "TornWeights",
    "TorchPolicyWorker",
    "Transport",
    "TransportContext",
    "TransportError",
    "TransportInfo",
    "TransportLoadError",
    "WeightLedger",
    "WorkerClosed",
    "ZmqIpcTransport",
    "__version__",
    "build_plan",
    "check_transport",
    "get_preset",
    "list_transports",
    "load_transport",
]
