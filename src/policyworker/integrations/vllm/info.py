"""The typed ``init_info`` / ``update_info`` of the ``"policyworker"`` vLLM backend
(:mod:`.backend`): what a controller passes to ``init_weight_transfer_engine`` and
``update_weights``, checked when vLLM parses them (a bad value is a ``ConfigError``
before anything joins or moves)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from policyworker.errors import ConfigError
from policyworker.integrations.vllm.staging import validate as validate_staging

__all__ = ["PolicyworkerInitInfo", "PolicyworkerUpdateInfo"]


@dataclass
class PolicyworkerInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``init_weight_transfer_engine`` (JSON-safe; see the README recipe).

    ``host``/``update_port``: the update group's store (hosted by trainer rank 0);
    ``stage_ports[s]`` (on ``stage_hosts[s]``, default ``host``): stage ``s``'s group,
    whose trainers (``trainers_per_stage[s]`` of them) come first. This engine's ranks
    are generation ranks ``rank_offset .. rank_offset + tp - 1`` of ``gen_world_size``
    (default: this engine's tp size; more when several engines share one update group).
    """

    host: str
    update_port: int
    stage_ports: list[int]
    trainers_per_stage: list[int]
    stage_hosts: list[str] | None = None
    rank_offset: int = 0
    gen_world_size: int | None = None
    timeout_s: float = 120.0
    refit_timeout_s: float | None = 120.0
    reshard_options: dict[str, Any] = field(default_factory=dict)
    #: How the commit puts the post-processed state in place: ``"swap"`` installs it
    #: (no copies), ``"copy"`` copies into live tensors of unchanged shape (what CUDA
    #: graphs and compiled models need), ``"auto"``: swap only for eager models on CPU.
    commit: str = "auto"
    #: CPU only: ``"prepack"`` (vLLM's default kernels: each commit runs its oneDNN / sgl
    #: prepack, a copy of every linear weight), ``"torch"`` (vLLM's plain
    #: ``torch.nn.functional.linear`` path, which reads the received tensors as they are:
    #: the commit is a swap) or ``"background"`` (served as with "torch" at commit, then
    #: prepacked layer by layer on a background thread). No effect on GPU, where
    #: unquantized layers read the parameter as is anyway.
    cpu_linear: str = "prepack"
    #: ``update_weights`` starts the receive and returns; vLLM keeps generating on the
    #: committed version until ``finish_weight_update`` (integrations/vllm/overlap.py).
    overlap: bool = False
    #: Where the next version is staged: ``"device"`` (one set on the engine's device),
    #: ``"host"`` (host memory, pinned on CUDA), ``"none"`` (into vLLM's live tensors: a
    #: failed refit leaves the engine torn) or ``"auto"`` (from free memory; the choice and
    #: why are in ``engine.staging_report``). docs/vllm-staging.md.
    staging: str = "auto"

    def __post_init__(self) -> None:
        validate_staging(self.staging, overlap=self.overlap,
                         delta=bool(isinstance(self.reshard_options, dict) and self.reshard_options.get("delta")))
        if self.staging == "none" and self.cpu_linear == "background":
            raise ConfigError("init_info.staging='none' cannot prepack in the background (the packed copy is a "
                              "second set); use cpu_linear='torch' or 'prepack'")
        if self.commit not in ("auto", "swap", "copy"):
            raise ConfigError(f"init_info.commit must be 'auto', 'swap' or 'copy', got {self.commit!r}")
        if self.cpu_linear not in ("prepack", "torch", "background"):
            raise ConfigError(f"init_info.cpu_linear must be 'prepack', 'torch' or 'background', "
                              f"got {self.cpu_linear!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"init_info.host must be a non-empty string, got {self.host!r}")
        n = len(self.stage_ports)
        if n == 0 or len(self.trainers_per_stage) != n or (self.stage_hosts is not None and len(self.stage_hosts) != n):
            raise ConfigError("init_info: stage_ports, trainers_per_stage (and stage_hosts) need one entry per "
                              "pipeline stage")
        for value, what in ((self.rank_offset, "rank_offset"), (self.update_port, "update_port")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"init_info.{what} must be an int >= 0, got {value!r}")


@dataclass
class PolicyworkerUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``update_weights``: the version the trainers are sending now."""

    version: int
    refit_timeout_s: float | None = None
    #: Overlap this update (True) or receive inside ``update_weights`` (False); None: ``init_info.overlap``.
    overlap: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ConfigError(f"update_info.version must be an int >= 1, got {self.version!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ConfigError(f"update_info.overlap must be true, false or null, got {self.overlap!r}")
