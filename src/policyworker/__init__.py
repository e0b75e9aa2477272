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

from .control import ControlClient
from .errors import (
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
from .layout import Parallelism, ReshardPlan, build_plan
from .ledger import WeightLedger
from .models import PRESETS, ModelConfig, get_preset
from .registry import TransportInfo, list_transports, load_transport
from .rollout import RolloutWorker
from .torch_worker import TorchPolicyWorker
from .transports.base import RefitReport, Transport, TransportContext
from .worker import AbstractPolicyWorker

__version__ = "0.1.0"

_LAZY = {
    "NcclReshardTransport": "policyworker.transports.nccl_reshard",
    "ZmqIpcTransport": "policyworker.transports.zmq_ipc",
    "SglangIpcTransport": "policyworker.transports.sglang_ipc",
    "InMemoryTransport": "policyworker.testing",
    "check_transport": "policyworker.testing",
    "SglangHttpEngine": "policyworker.sglang_client",
    "InProcessSglangEngine": "policyworker.sglang_engine",
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
