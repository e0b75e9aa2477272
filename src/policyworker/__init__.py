"""policyworker: move policy weights from trainers to rollout engines after every step.

Public surface (guarded by ``tests/test_public_api.py``): import from here, not from
submodules, unless you write a transport (then ``policyworker.transports.base``).
"""

from .comm import CommGroup, new_group
from .core import WorkerCore, private_runtime_dir
from .device import DeviceFacts, device_facts
from .control import ControlClient
from .errors import (
    AccessDenied,
    CheckpointError,
    ConfigError,
    PeerLost,
    PlanError,
    PlanMismatch,
    PolicyWorkerError,
    ProtocolError,
    RefitAborted,
    RefitTimeout,
    TornWeights,
    TransportError,
    TransportLoadError,
    WorkerClosed,
)
from .layout import Parallelism, ReshardPlan, build_plan
from .models import PRESETS, ModelConfig, build_model, get_preset
from .registry import TransportInfo, TransportRegistry, list_transports, load_transport
from .rollout import RolloutWorker
from .sglang_client import SglangHttpEngine
from .sglang_engine import InProcessSglangEngine
from .torch_worker import TorchPolicyWorker
from .transports.base import RefitReport, Transport, TransportContext
from .watchdog import Deadline, RefitWatchdog, process_watchdog
from .worker import AbstractPolicyWorker

__version__ = "0.1.0"

__all__ = [
    "AbstractPolicyWorker",
    "AccessDenied",
    "CheckpointError",
    "CommGroup",
    "ConfigError",
    "ControlClient",
    "Deadline",
    "DeviceFacts",
    "InProcessSglangEngine",
    "ModelConfig",
    "PRESETS",
    "Parallelism",
    "PeerLost",
    "PlanError",
    "PlanMismatch",
    "PolicyWorkerError",
    "ProtocolError",
    "RefitAborted",
    "RefitReport",
    "RefitTimeout",
    "RefitWatchdog",
    "ReshardPlan",
    "RolloutWorker",
    "SglangHttpEngine",
    "TorchPolicyWorker",
    "TornWeights",
    "Transport",
    "TransportContext",
    "TransportError",
    "TransportInfo",
    "TransportLoadError",
    "TransportRegistry",
    "WorkerClosed",
    "WorkerCore",
    "__version__",
    "build_model",
    "build_plan",
    "device_facts",
    "get_preset",
    "list_transports",
    "load_transport",
    "new_group",
    "private_runtime_dir",
    "process_watchdog",
]
