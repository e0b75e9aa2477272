"""The exception tree. Every error this library raises is one of these.

::

    PolicyWorkerError                  root: catch this to catch everything of ours
    ├── ConfigError                    bad arguments, bad layouts, bad options (ValueError too)
    │   └── PlanError                  a layout/model pair no plan can be made for
    ├── PlanMismatch                   ranks disagree on the reshard plan (hash differs)
    ├── TransportLoadError             a transport plugin is broken (packaging, not a refit failure)
    ├── TransportError                 a transport failed to move a refit (a retry may help)
    │   ├── PeerLost                   a peer process died or closed its connection
    │   ├── RefitAborted               a refit was aborted (watchdog, stand-down, explicit)
    │   │   └── RefitTimeout           ... because its deadline passed
    │   └── ProtocolError              a malformed, truncated or unexpected wire message
    ├── AccessDenied                   a control request without the group's token
    ├── TornWeights                    the rollout's in-place weights are partly updated
    ├── RefitInProgress                weights asked for (or a second refit) while a refit is in flight
    ├── ProcessFailed                  a spawned process of a world (demo, drill, tests) failed
    ├── CheckpointError                a checkpoint could not be written or read
    └── WorkerClosed                   the worker was shut down

Errors of zmq, gloo, nccl and http are translated into these at the transport
boundary (see :func:`translate_comm_error`); nothing from those libraries escapes a
public method. Context travels as attributes (``rank``, ``transport``, ``param``),
never only inside the message text.
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "CheckpointError",
    "ConfigError",
    "PeerLost",
    "PlanError",
    "PlanMismatch",
    "PolicyWorkerError",
    "ProcessFailed",
    "ProtocolError",
    "RefitInProgress",
    "RefitAborted",
    "RefitTimeout",
    "TornWeights",
    "TransportError",
    "TransportLoadError",
    "WorkerClosed",
]


class PolicyWorkerError(Exception):
    """Root of every error policyworker raises.

    ``rank``, ``transport`` and ``param`` carry context where known (else None).
    """

    def __init__(
        self,
        message: str = "",
        *,
        rank: int | None = None,
        transport: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.transport = transport
        self.param = param


class ConfigError(PolicyWorkerError, ValueError):
    """Invalid arguments, layouts or options. Raised before any state changes."""


class PlanError(ConfigError):
    """No reshard plan exists for this model and these layouts (e.g. an unknown param)."""


class PlanMismatch(PolicyWorkerError):
    """Ranks computed different reshard plans; raised at connect, never mid-refit."""


class TransportError(PolicyWorkerError):
    """A transport failed to connect or to move a refit."""


class TransportLoadError(PolicyWorkerError):
    """A transport plugin is broken: duplicate name, import failure, wrong type.

    ``entry_point`` and ``distribution`` name the culprit.
    """

    def __init__(
        self, message: str, *, entry_point: str | None = None, distribution: str | None = None
    ) -> None:
        super().__init__(message, transport=entry_point)
        self.entry_point = entry_point
        self.distribution = distribution


class PeerLost(TransportError):
    """A peer process died or closed its connection during a collective or a send."""


class RefitAborted(TransportError):
    """The refit was aborted before it completed; the version did not advance."""


class RefitTimeout(RefitAborted):
    """The refit's deadline (``refit_timeout_s``) passed; its groups were aborted."""


class ProtocolError(TransportError):
    """A wire message was malformed, truncated, or not the one the protocol expects."""


class AccessDenied(PolicyWorkerError):
    """A control endpoint refused a request (wrong or missing group token)."""


class TornWeights(PolicyWorkerError):
    """In-place weights were partly overwritten by a failed refit.

    The rollout refuses to serve until a full refit commits.
    """


class RefitInProgress(PolicyWorkerError):
    """The weights were asked for, or a second refit started, while a refit is in flight."""


class ProcessFailed(PolicyWorkerError):
    """A spawned process raised, died, or the world ran out of time; ``failures``: rank → detail."""

    def __init__(self, message: str, *, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class CheckpointError(PolicyWorkerError):
    """A checkpoint write or read failed; ``path`` names the file.

    A failed write never leaves a file at ``path`` (see ``policyworker.workers.checkpoint``).
    """

    def __init__(self, message: str, *, path: str | None = None, rank: int | None = None) -> None:
        super().__init__(message, rank=rank)
        self.path = path


class WorkerClosed(PolicyWorkerError):
    """The worker was shut down; no further calls are accepted."""


# Substrings gloo/nccl/c10d put in their RuntimeErrors when the other side is gone.
# Matching text is a last resort: torch raises plain RuntimeError/DistBackendError for
# these with no finer type, so this one translation point is the only place that looks.
_PEER_GONE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "connection refused",
    "Connection refused",
    "NCCL communicator was aborted",
    "remote process exited",
)
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout", "timeout")


def translate_comm_error(
    exc: BaseException,
    *,
    rank: int | None = None,
    transport: str | None = None,
    what: str = "collective",
) -> PolicyWorkerError:
    """Map an error from torch.distributed / zmq into our tree (return, don't raise).

    Our own errors pass through unchanged.
    """
    if isinstance(exc, PolicyWorkerError):
        return exc
    text = str(exc)
    ctx = {"rank": rank, "transport": transport}
    if any(m in text for m in _PEER_GONE_MARKERS):
        err: PolicyWorkerError = PeerLost(f"{what} lost its peer: {text}", **ctx)
    elif any(m in text for m in _TIMEOUT_MARKERS):
        err = RefitTimeout(f"{what} timed out: {text}", **ctx)
    else:
        err = TransportError(f"{what} failed: {type(exc).__name__}: {text}", **ctx)
    err.__cause__ = exc
    return err
