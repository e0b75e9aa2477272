"""Wiring a refit world of Ray actors: which actor hosts which store, on which port.

A refit world needs ``1 + pp`` rendezvous stores: the update group's (hosted by
trainer rank 0) and one per pipeline stage (hosted by that stage's first trainer).
Each port must be free *on the node of the actor that hosts it*, so it is chosen
there (:func:`node_free_ports`, called inside that actor), and every other address
follows from the two layouts. :class:`RefitWiring` derives them in one place; its
:meth:`~RefitWiring.trainer` / :meth:`~RefitWiring.rollout` give each actor the exact
arguments of ``init_collective`` and the stage groups, and :func:`join_trainer` /
:func:`join_rollout` make those calls. Recovery is the same code with fresh ports (a
new *epoch*): a new update group is a new refit world.

Nothing here is an actor framework: the controller keeps its own actors, and the
workers run unchanged inside them. Only :func:`node_free_ports` imports Ray (the
``ray`` extra), lazily.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policyworker.runtime.procs import free_port
from policyworker.errors import ConfigError
from policyworker.layout.parallelism import Parallelism

__all__ = ["RefitWiring", "RolloutWiring", "TrainerWiring", "join_rollout", "join_trainer", "node_free_ports",
           "store_hosts"]


def node_free_ports(count: int) -> tuple[str, list[int]]:
    """This node's IP (as Ray names it) and ``count`` TCP ports free on it a moment ago.

    Call it inside the actor that will host the stores (the ports are probed where they
    will be bound). Ports are only reserved while probed: use them right away.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"count must be an int >= 1, got {count!r}")
    try:
        import ray
    except ImportError as exc:  # the extra is missing: say which one
        raise ConfigError("policyworker.integrations.ray needs Ray: pip install 'policyworker[ray]'") from exc
    ip = ray.util.get_node_ip_address()
    ports: list[int] = []
    while len(ports) < count:  # distinct ports: the OS may hand the same one out twice
        port = free_port(ip)
        if port not in ports:
            ports.append(port)
    return ip, ports


def store_hosts(train: Parallelism | str) -> dict[int, list[str]]:
    """Trainer rank → the stores it hosts: ``"update"`` (rank 0) and ``"stage<s>"``."""
    train = _par(train, "train")
    hosts: dict[int, list[str]] = {0: ["update"]}
    for stage in range(train.pp):
        hosts.setdefault(train.stage_ranks(stage)[0], []).append(f"stage{stage}")
    return hosts


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerWiring:
    """Arguments of a trainer's ``init_collective`` + ``init_nccl_reshard_comm_group``."""

    ip: str
    port: int
    world_size: int
    train_world_size: int
    stage_ips: tuple[str, ...]
    stage_ports: tuple[int, ...]
    pp_size: int
    stage: int
    sub_world_size: int
    rank_in_group: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutWiring:
    """Arguments of a rollout's ``init_collective`` + ``init_nccl_reshard_comm_groups``."""

    ip: str
    port: int
    world_size: int
    train_world_size: int
    stage_ips: tuple[str, ...]
    stage_ports: tuple[int, ...]
    trainers_per_stage: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RefitWiring:
    """Every address of one refit world (one epoch), derived from the layouts and stores.

    ``stores`` maps ``"update"`` and ``"stage<s>"`` to ``(ip, port)``: the ports the
    hosts of :func:`store_hosts` chose with :func:`node_free_ports`.
    """

    train: Parallelism
    gen: Parallelism
    stores: Mapping[str, tuple[str, int]]

    @classmethod
    def build(cls, train: Parallelism | str, gen: Parallelism | str,
              chosen: Mapping[int, tuple[str, Sequence[int]]]) -> RefitWiring:
        """``chosen``: trainer rank → ``node_free_ports(len(store_hosts(train)[rank]))``."""
        train, gen = _par(train, "train"), _par(gen, "gen")
        stores: dict[str, tuple[str, int]] = {}
        for rank, names in store_hosts(train).items():
            if rank not in chosen:
                raise ConfigError(f"trainer rank {rank} hosts {names} but chose no ports")
            ip, ports = chosen[rank]
            if len(ports) < len(names):
                raise ConfigError(f"trainer rank {rank} hosts {len(names)} stores but chose {len(ports)} ports")
            stores.update({name: (str(ip), int(port)) for name, port in zip(names, ports)})
        return cls(train=train, gen=gen, stores=stores)

    @property
    def world_size(self) -> int:
        return self.train.world_size + self.gen.world_size

    def _stages(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        addrs = [self.stores[f"stage{s}"] for s in range(self.train.pp)]
        return tuple(a[0] for a in addrs), tuple(a[1] for a in addrs)

    def trainer(self, rank: int) -> TrainerWiring:
        stage = self.train.coords(rank).pp_stage
        members = list(self.train.stage_ranks(stage))
        ips, ports = self._stages()
        ip, port = self.stores["update"]
        return TrainerWiring(ip=ip, port=port, world_size=self.world_size, train_world_size=self.train.world_size,
                             stage_ips=ips, stage_ports=ports, pp_size=self.train.pp, stage=stage,
                             sub_world_size=len(members) + self.gen.world_size,
                             rank_in_group=members.index(rank))

    def rollout(self) -> RolloutWiring:
        """The same for every generation rank (its rank is the worker's own)."""
        ips, ports = self._stages()
        ip, port = self.stores["update"]
        return RolloutWiring(ip=ip, port=port, world_size=self.world_size, train_world_size=self.train.world_size,
                             stage_ips=ips, stage_ports=ports,
                             trainers_per_stage=tuple(len(self.train.stage_ranks(s)) for s in range(self.train.pp)))


async def join_trainer(worker: Any, w: TrainerWiring) -> None:
    """Join the update group and this trainer's stage group (collective: every rank at once)."""
    await worker.init_collective(w.ip, w.port, w.world_size, train_world_size=w.train_world_size)
    await worker.init_nccl_reshard_comm_group(list(w.stage_ips), list(w.stage_ports), w.pp_size, w.stage,
                                              w.sub_world_size, w.rank_in_group)


async def join_rollout(worker: Any, w: RolloutWiring) -> None:
    """Join the update group and every stage group (collective: every rank at once)."""
    await worker.init_collective(w.ip, w.port, w.world_size, train_world_size=w.train_world_size)
    await worker.init_nccl_reshard_comm_groups(list(w.stage_ips), list(w.stage_ports), list(w.trainers_per_stage))


def _par(value: Parallelism | str, what: str) -> Parallelism:
    if isinstance(value, Parallelism):
        return value
    if isinstance(value, str):
        return Parallelism.parse(value)
    raise ConfigError(f"{what} must be a Parallelism or a layout string like 'tp=2', got {value!r}")
