"""A fabric model: what a plan's bytes cost on real links, next to other refit strategies.

This is arithmetic, not a measurement. A `Fabric` says how many GPUs share a node
and an NVLink domain, each GPU's NVLink and NIC bandwidth (GB/s = 1e9 bytes/s, one
direction), and which GPU each training and generation rank runs on. A message from
GPU ``a`` to GPU ``b`` leaves through ``a``'s port of its kind and enters through
``b``'s: ``local`` when ``a == b`` (a device copy; not a link, so not in the bound),
``nvlink`` inside one NVLink domain, ``nic`` across domains. Switches are taken as
non-blocking: only the GPUs' own ports limit.

Three strategies, for one plan's model and layouts:

* ``plan`` — our `ReshardPlan`: each generation rank receives its shard's bytes,
  each from one trainer. ``bound_s`` is the max over ports of bytes / bandwidth
  (perfect overlap). ``ordered_s`` follows nccl_reshard's message order: every
  transfer is cut into ``bucket_bytes`` buckets (``ceil(nbytes / bucket)``, the last
  one short) and messages go in rounds of key ``(bucket index, src, dst)``; each round
  takes the max over ports of its bytes / bandwidth and rounds do not overlap. The
  plan's real schedule keeps up to ``in_flight`` messages outstanding, so rounds
  overlap partly: expect between ``bound_s`` and ``ordered_s``.
* ``broadcast`` — training rank 0 gathers the whole model and broadcasts it to every
  generation rank, as NeMo RL's packed broadcast, checkpoint-engine's broadcast and
  vLLM's stock nccl weight transfer do. Both phases are taken at their best: the
  gather takes each box rank 0 lacks from a holder in its NVLink domain when there is
  one, else across the fabric into the root's node through the NICs of that node's
  GPUs that are ranks of the refit, then over NVLink to the root; the broadcast is a
  pipelined multi-ring one (NCCL's, one ring per NIC): every receiver takes in the
  whole model at ``min(nvlink, k * nic)`` across domains, ``nvlink`` inside one, where
  ``k`` is the fewest GPUs of the refit on a node the rings enter or leave (a ring
  hop is a rank of the communicator: a GPU outside it carries nothing, and one GPU
  reaches the network through its own NIC). ``bound_s`` pipelines the phases bucket by
  bucket and pays both fills: the first bucket is gathered before it is broadcast
  (its share of the gather) or the last one broadcast after it is gathered, and the
  ring's last rank gets its first chunk one chunk per hop later
  (:data:`RING_CHUNK_BYTES`, NCCL's); ``sequential_s`` adds the phases.
* ``full_tensor`` — every generation rank receives every parameter whole (vLLM's m2n
  transfer): each source box's replicas share the receivers round robin (receiver g
  from replica ``g % replicas``), so senders are as balanced as in the plan.
* ``topology`` — the relay routes (:mod:`.topology`, NVLink domains as nodes): each
  class crosses into a domain once and its entry relays it over NVLink. ``bound_s``
  is the larger of the ports' bound and the relay path: an entry forwards a message
  once it landed, so its last message goes out to each of its ``k`` fan-out ranks
  after everything it relays came in; nccl_reshard cuts the messages into a relaying
  entry to ``bucket // k`` (``relay_message_bytes``), so that drain is at most one
  bucket through the entry's NVLink port.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from policyworker.errors import ConfigError
from policyworker.layout.classes import per_plan
from policyworker.layout.plan import ReshardPlan, dtype_size

__all__ = ["Fabric", "Placement", "fabric_report", "format_fabric_report", "load_fabric",
           "ordered_time", "port_bound"]

GB = 1e9
KINDS = ("nvlink", "nic", "local")
# NCCL's ring broadcast moves a chunk of one step of its channel buffer per hop:
# NCCL_BUFFSIZE (4 MiB by default) / NCCL_STEPS (8) with the Simple protocol that
# large messages use. A pipelined ring's last rank gets its first chunk one chunk
# per hop after the root sends it: the broadcast's fill.
RING_CHUNK_BYTES = (4 << 20) // 8


class Fabric(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A cluster's links and where the ranks run (JSON or TOML; see ``benchmarks/fabrics``).

    GPUs are numbered globally, node ``n`` holding ``n * gpus_per_node ...``; an NVLink
    domain is ``nvlink_domain_gpus`` consecutive GPUs (default: one node; 72 on a
    GB200 NVL72). Trainers sit on ``train_gpus`` (default: consecutive from
    ``train_first_gpu``), generation ranks on ``gen_gpus`` (default: consecutive from
    ``gen_first_gpu``, itself by default the first node after the trainers). A GPU
    may be on both lists (colocated). ``bucket_mb`` is nccl_reshard's bucket.
    """

    name: str = ""
    gpus_per_node: int
    nvlink_gbps: float
    nic_gbps: float
    nvlink_domain_gpus: int | None = None
    train_gpus: list[int] | None = None
    gen_gpus: list[int] | None = None
    train_first_gpu: int = 0
    gen_first_gpu: int | None = None
    bucket_mb: float = 16.0
    notes: str = ""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ConfigError(f"fabric gpus_per_node must be >= 1, got {self.gpus_per_node}")
        for key in ("nvlink_gbps", "nic_gbps", "bucket_mb"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"fabric {key} must be > 0, got {getattr(self, key)}")
        dom = self.domain_gpus
        if dom < 1 or dom % self.gpus_per_node:
            raise ConfigError(f"fabric nvlink_domain_gpus={dom} must be a positive multiple "
                              f"of gpus_per_node={self.gpus_per_node}")
        for key in ("train_gpus", "gen_gpus"):
            gpus = getattr(self, key)
            if gpus is not None and (any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus)):
                raise ConfigError(f"fabric {key} must be distinct GPU indices >= 0")
        if self.train_first_gpu < 0 or (self.gen_first_gpu is not None and self.gen_first_gpu < 0):
            raise ConfigError("fabric train_first_gpu / gen_first_gpu must be >= 0")

    @property
    def domain_gpus(self) -> int:
        return self.nvlink_domain_gpus or self.gpus_per_node

    def bandwidth(self, kind: str) -> float:
        """Bytes per second of one GPU's port of ``kind`` (one direction)."""
        return (self.nvlink_gbps if kind == "nvlink" else self.nic_gbps) * GB

    def kind(self, a: int, b: int) -> str:
        if a == b:
            return "local"
        return "nvlink" if a // self.domain_gpus == b // self.domain_gpus else "nic"

    def place(self, train_world_size: int, gen_world_size: int) -> Placement:
        """GPU of each rank; ConfigError when a list's length does not match a world."""
        def side(gpus: list[int] | None, first: int, n: int, what: str) -> tuple[int, ...]:
            if gpus is None:
                return tuple(range(first, first + n))
            if len(gpus) != n:
                raise ConfigError(f"fabric {what}_gpus lists {len(gpus)} GPUs for {n} "
                                  f"{what} ranks")
            return tuple(gpus)

        train = side(self.train_gpus, self.train_first_gpu, train_world_size, "train")
        gen_first = self.gen_first_gpu
        if gen_first is None:
            end = self.train_first_gpu + train_world_size
            gen_first = -(-end // self.gpus_per_node) * self.gpus_per_node
        return Placement(train, side(self.gen_gpus, gen_first, gen_world_size, "gen"))


@dataclass(frozen=True, slots=True)
class Placement:
    train: tuple[int, ...]
    gen: tuple[int, ...]


def load_fabric(path: str | Path) -> Fabric:
    """A `Fabric` from a ``.json`` or ``.toml`` file; ConfigError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read fabric file {path}: {exc}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"fabric file {path} is not valid "
                          f"{'TOML' if path.suffix == '.toml' else 'JSON'}: {exc}") from None
    try:
        return msgspec.convert(data, Fabric)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"fabric file {path}: {exc}") from None


# -- ports ---------------------------------------------------------------------------
Port = tuple[int, str, str]   # (gpu, kind, "out" | "in")


def _add(ports: dict[Port, float], fabric: Fabric, a: int, b: int, nbytes: float) -> str:
    kind = fabric.kind(a, b)
    if kind != "local":
        ports[(a, kind, "out")] = ports.get((a, kind, "out"), 0) + nbytes
        ports[(b, kind, "in")] = ports.get((b, kind, "in"), 0) + nbytes
    return kind


def port_bound(fabric: Fabric, ports: dict[Port, float]) -> tuple[float, Port | None]:
    """Max over ports of bytes / bandwidth, and the port that sets it."""
    best, where = 0.0, None
    for port, nbytes in ports.items():
        t = nbytes / fabric.bandwidth(port[1])
        if t > best:
            best, where = t, port
    return best, where


def _pairs_result(fabric: Fabric, place: Placement,
                  pairs: Iterable[tuple[int, int, float]]) -> dict[str, Any]:
    """Ports, per-kind totals and per-rank bytes of (train rank, gen rank, bytes) flows."""
    ports: dict[Port, float] = {}
    by_kind = dict.fromkeys(KINDS, 0.0)
    sent = [dict.fromkeys(KINDS, 0.0) for _ in place.train]
    got = [dict.fromkeys(KINDS, 0.0) for _ in place.gen]
    for s, d, n in pairs:
        kind = _add(ports, fabric, place.train[s], place.gen[d], n)
        by_kind[kind] += n
        sent[s][kind] += n
        got[d][kind] += n
    bound, port = port_bound(fabric, ports)
    return {"bytes_by_kind": {k: int(v) for k, v in by_kind.items()},
            "bound_s": bound, "bound_port": _port_name(port),
            "sent_by_train_rank": [{k: int(v) for k, v in x.items()} for x in sent],
            "received_by_gen_rank": [{k: int(v) for k, v in x.items()} for x in got],
            "_ports": ports}


def _port_name(port: Port | None) -> str | None:
    return None if port is None else f"gpu {port[0]} {port[1]} {port[2]}"


def ordered_time(fabric: Fabric, place: Placement, transfers: list[tuple[int, int, int]],
                 bucket: int) -> float:
    """Sum over message rounds of each round's port bound (see the module docstring)."""
    index: dict[Port, int] = {}
    rows: list[int] = []
    fulls: list[int] = []
    rests: list[int] = []
    for s, d, n in transfers:
        a, b = place.train[s], place.gen[d]
        kind = fabric.kind(a, b)
        if kind == "local" or n <= 0:
            continue
        full, rest = divmod(n, bucket)
        for port in ((a, kind, "out"), (b, kind, "in")):
            rows.append(index.setdefault(port, len(index)))
            fulls.append(full)
            rests.append(rest)
    if not rows:
        return 0
    # Bytes per (port, round) as integers: a full bucket in each round below `full`,
    # the rest in round `full`; then per round the max over ports of bytes / bandwidth
    # (a port's bytes are exact integers, so this is port_bound's float, port by port).
    row, full, rest = (np.asarray(x, np.int64) for x in (rows, fulls, rests))
    nrounds = int((full + (rest > 0)).max())
    step = np.zeros((len(index), nrounds + 1), np.int64)
    np.add.at(step, (row, 0), bucket)
    np.add.at(step, (row, full), -bucket)
    got = np.cumsum(step, axis=1)
    np.add.at(got, (row, full), rest)
    rate = np.asarray([fabric.bandwidth(port[1]) for port in index])
    per_round = (got[:, :nrounds] / rate[:, None]).max(axis=0)
    return sum(per_round.tolist())


# -- strategies ----------------------------------------------------------------------
@per_plan
def _classes(plan: ReshardPlan) -> list[tuple[int, list[int]]]:
    """(bytes, holder ranks) of every distinct source box of every parameter."""
    boxes: dict[tuple[int, Any, Any], list[int]] = {}
    for lt in plan.body.sources:
        rank = lt.rank
        for p in lt.pieces:
            boxes.setdefault((p.param, p.start, p.stop), []).append(rank)
    params = plan.params
    volumes: dict[tuple[Any, Any], int] = {}
    out = []
    for (pi, start, stop), ranks in boxes.items():
        vol = volumes.get((start, stop))
        if vol is None:
            vol = volumes[(start, stop)] = prod(b - a for a, b in zip(start, stop))
        out.append((vol * dtype_size(params[pi].dtype), sorted(ranks)))
    return out


@per_plan
def _full_tensor_pairs(plan: ReshardPlan) -> list[tuple[int, int, float]]:
    # Replica i of a box with R holders serves receivers g = i (mod R): aggregate per
    # (sender, R, i) first so the cost is boxes + senders * receivers * distinct R.
    acc: dict[int, dict[int, list[float]]] = {}
    for nbytes, ranks in _classes(plan):
        R = len(ranks)
        for i, s in enumerate(ranks):
            acc.setdefault(s, {}).setdefault(R, [0.0] * R)[i] += nbytes
    out = []
    for s, by_r in acc.items():
        for g in range(plan.body.gen_world_size):
            n = sum(v[g % R] for R, v in by_r.items())
            if n:
                out.append((s, g, n))
    return out


@per_plan
def _model_bytes(plan: ReshardPlan) -> int:
    return sum(prod(p.shape) * dtype_size(p.dtype) for p in plan.params)


@per_plan
def _held_elsewhere(plan: ReshardPlan) -> dict[tuple[int, ...], int]:
    """Bytes of the source boxes training rank 0 lacks, per holder set (first-seen order)."""
    out: dict[tuple[int, ...], int] = {}
    for nbytes, ranks in _classes(plan):
        if 0 not in ranks:
            key = tuple(ranks)
            out[key] = out.get(key, 0) + nbytes
    return out


def _world_gpus_per_node(fabric: Fabric, place: Placement) -> dict[int, int]:
    """GPUs of the refit (training or generation ranks) on each node."""
    out: dict[int, int] = {}
    for g in set(place.train) | set(place.gen):
        out[g // fabric.gpus_per_node] = out.get(g // fabric.gpus_per_node, 0) + 1
    return out


def _broadcast(plan: ReshardPlan, fabric: Fabric, place: Placement, bucket: int) -> dict[str, Any]:
    model = _model_bytes(plan)
    root = place.train[0]
    dom = fabric.domain_gpus
    node = fabric.gpus_per_node
    world = _world_gpus_per_node(fabric, place)
    gather = dict.fromkeys(("nvlink", "nic"), 0.0)
    # Summed per holder set: byte counts are integers far below 2**53, so the float
    # sums are exact in any order.
    for ranks, nbytes in _held_elsewhere(plan).items():
        near = any(place.train[r] // dom == root // dom for r in ranks)
        gather["nvlink" if near else "nic"] += nbytes
    # Generous: the root's node takes the far bytes in through the NICs of all its GPUs
    # in the refit and hands them (and the near ones) to the root over NVLink.
    gather_s = max(gather["nic"] / (world[root // node] * fabric.bandwidth("nic")),
                   (gather["nic"] + gather["nvlink"]) / fabric.bandwidth("nvlink"))
    far = sorted({g // node for g in place.gen if g // dom != root // dom})
    if far:
        k = min(world[n] for n in [root // node, *far])
        rate = min(fabric.bandwidth("nvlink"), k * fabric.bandwidth("nic"))
    else:
        rate = fabric.bandwidth("nvlink")
    cast_s = model / rate
    # Fills. The ring passes every generation GPU; it enters each far domain once
    # (a NIC hop), every other hop is NVLink (leaving out the root's hops to the
    # trainers whose NICs the rings leave through: generous).
    # A ring's chunk is at most its share of the model (k rings across domains).
    chunk = min(RING_CHUNK_BYTES, model / (k if far else 1))
    hops = len(set(place.gen) - {root})
    nic_hops = len({g // dom for g in place.gen if g // dom != root // dom})
    ring_fill = (nic_hops * chunk / fabric.bandwidth("nic")
                 + (hops - nic_hops) * chunk / fabric.bandwidth("nvlink"))
    share = min(1.0, bucket / model) if model else 0.0
    pipelined = max(gather_s * share + cast_s, gather_s + cast_s * share)
    nic = model * len(far)
    total = model * len(place.gen)
    return {"model_bytes": model, "gather_bytes_by_kind": {k: int(v) for k, v in gather.items()},
            "gather_s": gather_s, "broadcast_s": cast_s, "bound_s": pipelined + ring_fill,
            "sequential_s": gather_s + cast_s + ring_fill, "ring_fill_s": ring_fill,
            "bucket_fill_s": pipelined - max(gather_s, cast_s), "ring_gpus_per_node": k if far else None,
            "bytes_by_kind": {"nvlink": int(total - nic), "nic": int(nic), "local": 0},
            "received_per_gen_rank": model}


def _topology(plan: ReshardPlan, fabric: Fabric, place: Placement, bucket: int) -> dict[str, Any]:
    """The topology-aware routes (:mod:`.topology`) with NVLink domains as nodes."""
    from policyworker.layout.topology import relay_message_bytes, relay_routes

    dom = fabric.domain_gpus
    routes = relay_routes(plan, [g // dom for g in place.train], [g // dom for g in place.gen])
    ports: dict[Port, float] = {}
    by_kind = dict.fromkeys(KINDS, 0.0)
    got = [dict.fromkeys(KINDS, 0.0) for _ in place.gen]
    relay_in: dict[int, float] = {}  # per entry: seconds its relayed classes take to come in
    fan = routes.entry_fanouts()      # per entry: the most ranks one of its classes fans out to
    # Bytes per (sender, receiver) pair first: a MoE has a million routes over a few
    # thousand pairs.
    first, relayed_in, hops = routes.flows()
    for (s, e), n in first.items():
        kind = _add(ports, fabric, place.train[s], place.gen[e], n)
        by_kind[kind] += n
        got[e][kind] += n
        if (s, e) in relayed_in and kind != "local":
            relay_in[e] = relay_in.get(e, 0.0) + relayed_in[(s, e)] / fabric.bandwidth(kind)
    for (e, d), n in hops.items():
        kind = _add(ports, fabric, place.gen[e], place.gen[d], n)
        by_kind[kind] += n
        got[d][kind] += n
    bound, port = port_bound(fabric, ports)
    # An entry forwards a message once it landed: its last message goes out to each of
    # its k fan-out ranks after it took in everything it relays. nccl_reshard cuts the
    # messages into a relaying entry to relay_message_bytes(bucket, k), so that drain
    # is k such messages through the entry's NVLink port. It bounds the refit only
    # when longer than the ports' bound (an entry that takes its relayed classes
    # first hides it under its other bytes).
    drain = {e: k * relay_message_bytes(bucket, k) / fabric.bandwidth("nvlink") for e, k in fan.items()}
    relay_path = max((relay_in.get(e, 0.0) + drain[e] for e in fan), default=0.0)
    fill = max(drain.values(), default=0.0)
    return {"bytes_by_kind": {k: int(v) for k, v in by_kind.items()}, "bound_s": max(bound, relay_path),
            "bound_port": _port_name(port) if bound >= relay_path else "relay path",
            "ports_bound_s": bound, "relay_path_s": relay_path, "pipeline_fill_s": fill,
            "cross_node_bytes": routes.cross_node_bytes, "relayed_bytes": routes.relayed_bytes,
            "received_by_gen_rank": [{k: int(v) for k, v in x.items()} for x in got]}


def fabric_report(plan: ReshardPlan, fabric: Fabric, *, bucket_bytes: int | None = None
                  ) -> dict[str, Any]:
    """The fabric model for ``plan`` (JSON-safe; see the module docstring)."""
    place = fabric.place(plan.body.train_world_size, plan.body.gen_world_size)
    bucket = int(bucket_bytes or fabric.bucket_mb * 2**20)
    transfers = [(t.src, t.dst, t.nbytes) for t in plan.transfers]
    ours = _pairs_result(fabric, place, transfers)
    ours.pop("_ports")
    ours["ordered_s"] = ordered_time(fabric, place, transfers, bucket)
    full = _pairs_result(fabric, place, _full_tensor_pairs(plan))
    full.pop("_ports")
    return {
        "fabric": msgspec.to_builtins(fabric),
        "placement": {"train_gpus": list(place.train), "gen_gpus": list(place.gen)},
        "bucket_bytes": bucket,
        "model": "lower bounds from bytes / port bandwidth; not a measurement",
        "plan": ours,
        "broadcast": _broadcast(plan, fabric, place, bucket),
        "full_tensor": full,
        "topology": _topology(plan, fabric, place, bucket),
    }


def format_fabric_report(d: dict[str, Any], *, per_rank: bool = True) -> str:
    """A human table of `fabric_report`'s dict."""
    f = d["fabric"]

    def gib(n: float) -> str:
        return f"{n / 2**30:9.2f} GiB"

    def kinds(x: dict[str, int]) -> str:
        return "  ".join(f"{k} {gib(x[k]).strip()}" for k in KINDS)

    p, b, m, t = d["plan"], d["broadcast"], d["full_tensor"], d["topology"]
    lines = [
        f"fabric {f['name'] or '(unnamed)'}: {f['gpus_per_node']} GPUs/node, NVLink domain "
        f"{f['nvlink_domain_gpus'] or f['gpus_per_node']} GPUs, NVLink {f['nvlink_gbps']:g} GB/s, "
        f"NIC {f['nic_gbps']:g} GB/s per GPU; bucket {d['bucket_bytes'] / 2**20:g} MiB",
        "  MODEL (bytes / bandwidth lower bounds), not a measurement",
        f"  {'strategy':<14}{'bound s':>10}{'ordered s':>11}   bytes by link kind",
        f"  {'plan':<14}{p['bound_s']:>10.6f}{p['ordered_s']:>11.3f}   {kinds(p['bytes_by_kind'])}",
        f"  {'broadcast':<14}{b['bound_s']:>10.6f}{'':>11}   {kinds(b['bytes_by_kind'])}"
        f"  (gather {b['gather_s']:.3f} s, broadcast {b['broadcast_s']:.3f} s, fills "
        f"{(b['bucket_fill_s'] + b['ring_fill_s']) * 1e3:.3f} ms)",
        f"  {'full_tensor':<14}{m['bound_s']:>10.6f}{'':>11}   {kinds(m['bytes_by_kind'])}",
        f"  {'topology':<14}{t['bound_s']:>10.6f}{'':>11}   {kinds(t['bytes_by_kind'])}"
        f"  (relays {gib(t['relayed_bytes']).strip()}, relay path {t['relay_path_s']:.3f} s "
        f"incl. drain {t['pipeline_fill_s'] * 1e3:.3f} ms)",
        f"  plan bound set by {p['bound_port']}; full_tensor by {m['bound_port']}",
    ]
    if per_rank:
        lines.append("  plan, received per generation rank (nvlink / nic / local GiB):")
        rows = p["received_by_gen_rank"]
        for i in range(0, len(rows), 4):
            lines.append("   " + "  ".join(
                f"{i + j:>4}: {r['nvlink'] / 2**30:6.2f}/{r['nic'] / 2**30:6.2f}/"
                f"{r['local'] / 2**30:5.2f}" for j, r in enumerate(rows[i:i + 4])))
        lines.append("  plan, sent per training rank (nvlink / nic / local GiB):")
        rows = p["sent_by_train_rank"]
        for i in range(0, len(rows), 4):
            lines.append("   " + "  ".join(
                f"{i + j:>4}: {r['nvlink'] / 2**30:6.2f}/{r['nic'] / 2**30:6.2f}/"
                f"{r['local'] / 2**30:5.2f}" for j, r in enumerate(rows[i:i + 4])))
    return "\n".join(lines)
