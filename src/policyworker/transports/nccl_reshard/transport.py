"""nccl_reshard: trainers send each generation rank exactly its plan's bytes, point to point.

Groups: one per pipeline stage (the stage's trainers first, then every generation
rank), given at attach time — a trainer passes its stage's ``group`` and ``stage``, a
receiver every stage's ``groups`` (stage → group); the seed methods
``init_nccl_reshard_comm_group`` / ``RolloutWorker.init_nccl_reshard_comm_groups``
build them — plus the worker's update group (``ctx.update_group``) for the small
leftovers. NCCL on GPU, gloo on CPU: the same code.

One refit, both sides:

1. Per (stage, src, dst) transfer, a header (magic, version, bytes, buckets, plan
   hash) then the transfer's buckets (``bucket_copies``: at most ``bucket_bytes``
   each). Every message has a global key ``(round, src, dst)`` — round -1 for the
   header, then the bucket index — and **both sides issue their messages in
   increasing key order** with at most ``in_flight`` outstanding, posted in
   batches (one ``batch_isend_irecv`` per group: on NCCL one coalesced call on the
   group's own communicator; a batch holds headers or buckets, never both). The
   pending message with the smallest key is then posted on both of its ends, so it
   completes: no cycle of waits, whatever the layouts (the deadlock hazard of
   point-to-point schedules).
2. Sender: a message whose single source region is contiguous goes out as a view of
   the parameter (no copy); others are packed into a ring of ``staging`` buffers of
   ``bucket_bytes`` that lives across refits. Receiver: likewise straight into a
   contiguous destination region, else through its ring and ``unpack``. Copies of
   1 MiB and more travel as their own messages so that they can go direct; smaller
   ones share packed buckets. Up to ``in_flight`` messages are outstanding per rank.
3. After the bulk, over ``model_update_group`` (:func:`exchange_leftovers`): every
   rank sends its verdict to rank 0, which answers everyone with (failures,
   version, kv-scales as msgpack bytes — never pickle — lost peers). A receiver
   commits only when every expected byte arrived and every rank's verdict is good;
   the trainer's refit succeeds only then too.

On CUDA the refit runs on the transport's own stream; headers are read through an
event on it (no device sync inside the window) and the consumer gets an event
(``ctx.ready``) after which the received bytes are in place.

Bytes land in place as they arrive, so a receiver that fails after the first
bucket is *torn* (the worker marks it and refuses to serve until a full refit).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policyworker.config import positive_int

import torch

from policyworker.errors import (
    ConfigError,
    PeerLost,
    PlanMismatch,
    RefitAborted,
    TransportError,
)
from policyworker.layout.apply import pack
from policyworker.layout.plan import ReshardPlan
from policyworker.transports.base import RefitReport, Transport, TransportContext
from policyworker.transports.nccl_reshard.schedule import (
    _DirectSpans,
    _header_rows,
    _schedule,
    plan_hash63,
    stage_members,
)
from policyworker.transports.nccl_reshard import delta as nccl_delta
from policyworker.transports.nccl_reshard.attempts import check_fresh, spoil
from policyworker.transports.nccl_reshard.receive import bucket_crc, recv_bulk
from policyworker.transports.nccl_reshard.delta_state import DeltaSettings, check_verify, forget_verified
from policyworker.transports.nccl_reshard.verdict import exchange_leftovers

__all__ = ["NcclReshardTransport", "exchange_leftovers", "stage_members"]

_log = logging.getLogger(__name__)

@dataclass(frozen=True, kw_only=True, slots=True)
class NcclReshardSetup:
    """Attach-time setup. ``bucket_bytes``/``checksum`` must match on every rank.

    Trainer: ``group`` (its stage's group) and ``stage``. Receiver: ``groups``
    (stage → group, every stage of the plan). ``delta`` (every rank): refits carry only
    the changed elements when every receiver holds the trainers' last version
    (:mod:`.nccl_delta`); ``delta_max_fraction`` and ``delta_full_every`` (trainers)
    say when a refit is full anyway. ``delta_verify`` (receivers): how a receiver proves
    its bytes after a delta, ``"full"`` (default: a checksum pass over every byte it
    holds) or ``"incremental"`` (its checksums from its last verified commit, updated by
    the changed units; proves the result only if nothing wrote its bytes since: see
    :mod:`.nccl_delta`).
    """

    bucket_bytes: int = 16 << 20
    in_flight: int = 16
    staging: int = 2
    checksum: bool = False
    group: Any = None
    stage: int | None = None
    groups: Any = None
    # "auto": when the ranks span nodes, each byte crosses into a node once and is
    # relayed inside it (:mod:`.relay`; full refits only); "off": every rank
    # receives from trainers.
    relay: str = "auto"
    delta: bool = False
    delta_max_fraction: float = 0.25
    delta_full_every: int | None = None
    delta_verify: str = "full"

    def __post_init__(self) -> None:
        check_verify(self.delta_verify)
        if self.relay not in ("auto", "off"):
            raise ConfigError(f"relay must be 'auto' or 'off', got {self.relay!r}", transport="nccl_reshard")
        positive_int(self.bucket_bytes, "bucket_bytes", minimum=1024)
        if not 0.0 <= self.delta_max_fraction <= 1.0:
            raise ConfigError(f"delta_max_fraction must be in [0, 1], got {self.delta_max_fraction!r}")
        if self.delta_full_every is not None:
            positive_int(self.delta_full_every, "delta_full_every")
        positive_int(self.in_flight, "in_flight")
        positive_int(self.staging, "staging")
        if self.stage is not None:
            positive_int(self.stage, "stage", minimum=0)
        if self.groups is not None and not isinstance(self.groups, Mapping):
            raise ConfigError(f"groups must map stage -> group, got {type(self.groups).__name__}")


@dataclass(frozen=True, kw_only=True, slots=True)
class NcclReshardOptions:
    """Per-refit options: ``kv_scales`` (name → float; trainer rank 0's are sent);
    ``delta=False`` (trainer) makes this refit full when the attachment has delta on;
    ``delta_verify`` (receiver) overrides the setup's for this refit."""

    kv_scales: Any = None
    delta: bool | None = None
    delta_verify: str | None = None

    def __post_init__(self) -> None:
        from policyworker.layout.local import validate_kv_scales

        if self.delta_verify is not None:
            check_verify(self.delta_verify)
        object.__setattr__(self, "kv_scales", validate_kv_scales(self.kv_scales))


class NcclReshardTransport(Transport):
    """See the module docstring. ``bucket_bytes`` and ``checksum`` must match on every rank."""

    name = "nccl_reshard"
    Setup = NcclReshardSetup
    Options = NcclReshardOptions
    needs_plan = True
    lands_on_demand = True  # full refits (receive.py); a delta applies to bytes already held

    @classmethod
    def from_setup(cls, setup: NcclReshardSetup) -> NcclReshardTransport:
        transport = cls(bucket_bytes=setup.bucket_bytes, in_flight=setup.in_flight, staging=setup.staging,
                        checksum=setup.checksum, relay=setup.relay)
        if setup.delta:
            transport.delta = DeltaSettings(setup.delta_max_fraction, setup.delta_full_every, setup.delta_verify)
        return transport

    def __init__(
        self, *, bucket_bytes: int = 16 << 20, in_flight: int = 16, staging: int = 2, checksum: bool = False,
        relay: str = "auto",
    ) -> None:
        for value, what, low in ((bucket_bytes, "bucket_bytes", 1024), (in_flight, "in_flight", 1),
                                 (staging, "staging", 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{what} must be an int >= {low}, got {value!r}", transport=self.name)
        self.bucket_bytes = bucket_bytes
        self.in_flight = in_flight  # messages outstanding per rank
        self.staging = min(staging, in_flight)  # staging buffers (bucket_bytes each) per rank
        self.checksum = bool(checksum)
        self.relay = relay
        self._closed = False
        self._active: list[Any] = []  # groups of the refit in progress (abort() aborts them)
        self.delta: DeltaSettings | None = None  # delta mode (see nccl_delta), set from the setup

    def abort(self) -> None:
        for group in list(self._active):
            group.abort()

    # -- connect ---------------------------------------------------------------------
    async def connect(self, ctx: TransportContext) -> None:
        if self._closed:
            raise TransportError("transport is closed", transport=self.name)
        if not isinstance(ctx.plan, ReshardPlan):
            raise ConfigError("nccl_reshard needs ctx.plan (a ReshardPlan)", transport=self.name)
        await ctx.blocking(self._connect, ctx)

    @staticmethod
    def _wire(ctx: TransportContext) -> None:
        """Adopt the groups of ``ctx.setup`` (attach) into the state; keep the state's otherwise."""
        setup = ctx.setup
        if setup is not None:
            if ctx.role == "send" and setup.group is not None:
                ctx.state["group"], ctx.state["stage"] = setup.group, setup.stage or 0
            if ctx.role == "receive" and setup.groups is not None:
                ctx.state["groups"] = dict(setup.groups)
        if ctx.update_group is not None:
            ctx.state["update_group"] = ctx.update_group
        need = "group" if ctx.role == "send" else "groups"
        if ctx.state.get(need) is None:
            raise ConfigError(f"nccl_reshard ({ctx.role}) needs {need}= at attach (the stage group"
                              f"{'' if ctx.role == 'send' else 's'})", rank=ctx.rank, transport="nccl_reshard")

    def _connect(self, ctx: TransportContext) -> None:
        forget_verified(ctx.state)  # a reconnect: the next delta's check is a full one
        self._wire(ctx)
        plan = ctx.plan
        members = stage_members(plan)
        mine = torch.tensor([plan_hash63(plan), self.bucket_bytes, int(self.checksum) + 2 * (self.delta is not None),
                             int(self.relay == "auto")],
                            dtype=torch.int64)
        groups = [ctx.state["group"]] if ctx.role == "send" else list(ctx.state["groups"].values())
        if ctx.role == "send":
            stage = ctx.state["stage"]
            if ctx.rank not in members[stage]:
                raise ConfigError(f"train rank {ctx.rank} is not in stage {stage} of the plan", rank=ctx.rank)
        elif len(groups) != len(members):
            raise ConfigError(f"plan has {len(members)} stages, rollout joined {len(groups)} stage groups")
        self._check_fresh(ctx)
        for group in groups:
            dev = group.device
            gathered = [torch.zeros(4, dtype=torch.int64, device=dev) for _ in range(group.world_size)]
            live = not group.aborted
            try:
                group.all_gather(gathered, mine.to(dev))
            except BaseException:  # a peer that never joined: this collective may stay posted
                self._spoiled(ctx, [group] if live else [])
                raise
            rows = [g.cpu().tolist() for g in gathered]
            if any(r[0] != rows[0][0] for r in rows):
                raise PlanMismatch(
                    f"ranks of group {group.name!r} hold different reshard plans (hashes differ)",
                    rank=ctx.rank, transport=self.name,
                )
            if any(r[1:] != rows[0][1:] for r in rows):
                raise ConfigError(
                    f"ranks of group {group.name!r} disagree on bucket_bytes/checksum/delta/relay: "
                    f"{sorted({tuple(r[1:]) for r in rows})}",
                    rank=ctx.rank, transport=self.name,
                )
        device = groups[0].device
        bulk = self._route(ctx, plan)
        schedule = ctx.state["schedule"] = _schedule(bulk, ctx, self.bucket_bytes, ctx.state.get("bulk_caps"))
        ctx.state["direct_spans"] = _DirectSpans()  # keyed by schedule index: new schedule, new spans
        pair_bytes: dict[tuple[int, int], int] = {}
        for m in schedule:
            if m.copies is not None:
                pair = (m.key[1], m.key[2])
                pair_bytes[pair] = pair_bytes.get(pair, 0) + m.nbytes
        ctx.state["pair_bytes"] = pair_bytes  # (src, dst) -> payload bytes; in every header
        if ctx.role == "receive" and ctx.state.get("fanouts"):
            from policyworker.transports.nccl_reshard.relay import merge_fanouts

            # The relays' messages join this rank's schedule: one global order (relay.py).
            schedule = ctx.state["schedule"] = merge_fanouts(schedule, ctx.state["fanouts"], ctx.rank,
                                                             ctx.state["groups"][0], len(members[0]))
        # A copy the plan's format converts cannot be cut below the format's unit (a
        # quantization block), which may exceed a tiny bucket_bytes, and it is always
        # packed; the ring slots then grow to the largest such message.
        fmt = bulk.dest_format
        biggest = max((m.nbytes for m in schedule if m.copies is not None and m.relay is None
                       and any(fmt.converts(bulk, c) for c in m.copies)), default=0)
        ring_bytes = max(self.bucket_bytes, biggest) + (8 if self.checksum else 0)
        ring = ctx.state.get("ring")
        if ring is None or len(ring) != self.staging or ring[0].numel() != ring_bytes or ring[0].device != device:
            # Staging lives across refits: fresh pages cost more than the copy itself.
            ctx.state["ring"] = [torch.empty(ring_bytes, dtype=torch.uint8, device=device) for _ in range(self.staging)]
        ctx.state["connected_hash"] = plan.hash

    def _route(self, ctx: TransportContext, plan: ReshardPlan) -> ReshardPlan:
        """The plan the bulk runs: ``plan``, or its first hop when relays pay (:mod:`.relay`)."""
        from policyworker.transports.nccl_reshard.relay import gather_nodes, node_name, relay_setup

        ctx.state.pop("bulk_plan", None)
        ctx.state.pop("fanouts", None)
        ctx.state.pop("bulk_caps", None)
        update_group = ctx.state.get("update_group")
        if self.relay != "auto" or self.delta is not None or update_group is None:
            return plan
        train_nodes, gen_nodes = gather_nodes(update_group, plan.body.train_world_size, node_name(),
                                              self._deadline(ctx))
        routed = relay_setup(plan, train_nodes, gen_nodes, self.bucket_bytes)
        if routed is None:
            return plan
        ctx.state["bulk_plan"], ctx.state["fanouts"], ctx.state["bulk_caps"] = routed
        return routed[0]

    # -- refit -----------------------------------------------------------------------
    async def send(self, ctx: TransportContext, version: int) -> RefitReport:
        """Send refit ``version``; ``ctx.options["kv_scales"]`` (name → float) rides along."""
        self._check(ctx)
        if self.delta is None and ctx.option("delta"):
            raise ConfigError("delta=True needs the setup's delta=True on every rank of the attachment",
                              rank=ctx.rank, transport=self.name)
        if self.delta is not None:
            return await ctx.blocking(nccl_delta.refit, self, ctx, version)
        return await ctx.blocking(self._refit, ctx, version)

    async def receive(self, ctx: TransportContext, version: int | None = None) -> RefitReport:
        """Receive the next refit (its version comes from the trainers' headers).

        Commits nothing itself: on success the worker commits ``report.version``;
        ``ctx.touched`` says whether live bytes were overwritten (for a torn mark on
        failure); the report's ``kv_scales`` are the scales received.
        """
        self._check(ctx)
        if self.delta is not None:
            if ctx.landing is not None:
                raise ConfigError("a delta refit applies changes to the bytes its destinations hold; destinations "
                                  "made on demand (ctx.landing) hold none: nothing received",
                                  rank=ctx.rank, transport=self.name)
            return await ctx.blocking(nccl_delta.refit, self, ctx, version)
        return await ctx.blocking(self._refit, ctx, version)

    def _check(self, ctx: TransportContext) -> None:
        if self._closed:
            raise TransportError("transport is closed", transport=self.name)
        if ctx.state.get("connected_hash") != getattr(ctx.plan, "hash", None):
            raise TransportError("connect() must run (again) before a refit with this plan", transport=self.name)

    def _deadline(self, ctx: TransportContext) -> float:
        if ctx.deadline is not None:
            return ctx.deadline.at
        return time.monotonic() + max(g.timeout_s for g in self._groups(ctx))

    def _groups(self, ctx: TransportContext) -> list:
        return [ctx.state["group"]] if ctx.role == "send" else list(ctx.state["groups"].values())

    def _attempt_groups(self, ctx: TransportContext) -> list:
        update_group = ctx.state.get("update_group")
        return [*self._groups(ctx), *([update_group] if update_group is not None else [])]

    # Stale attempts: see attempts.py.
    def _spoiled(self, ctx: TransportContext, groups: list) -> None:
        spoil(groups, ctx.rank)

    def _check_fresh(self, ctx: TransportContext) -> None:
        check_fresh(self._attempt_groups(ctx), ctx.rank, self._deadline(ctx))

    def _refit(self, ctx: TransportContext, version: int | None) -> RefitReport:
        """One refit on the transport's own CUDA stream (CPU: no stream).

        The stream first waits for the device's default stream (where training writes
        the weights and generation reads them, unless told otherwise): GPU-side, no host
        wait. Every pack, unpack and NCCL op of the refit is ordered on it; at the end
        an event recorded on it goes to the consumer as ``ctx.ready`` — the bytes are
        in place once it completes, and the rollout makes the stream that reads its
        weights wait on it. No ``torch.cuda.synchronize`` anywhere.
        """
        stream = self._stream(ctx)
        if stream is None:
            return self._refit_body(ctx, version)
        stream.wait_stream(torch.cuda.default_stream(stream.device))
        with torch.cuda.stream(stream):
            report = self._refit_body(ctx, version)
            ready = torch.cuda.Event()
            ready.record(stream)
        ctx.ready = ready
        return report

    def _stream(self, ctx: TransportContext):
        device = self._groups(ctx)[0].device
        if device.type != "cuda":
            return None
        stream = ctx.state.get("stream")
        if stream is None or stream.device != device:
            stream = ctx.state["stream"] = torch.cuda.Stream(device)
        return stream

    def _refit_body(self, ctx: TransportContext, version: int | None) -> RefitReport:
        t0 = time.perf_counter()
        ctx.touched = False
        update_group = ctx.state.get("update_group")
        scales = None
        self._check_fresh(ctx)
        self._active = self._attempt_groups(ctx)
        live = [g for g in self._active if not g.aborted]
        try:
            if ctx.role == "send":
                nbytes, nbuckets, failure = self._send_bulk(ctx, version)
            else:
                nbytes, nbuckets, version, failure = self._recv_bulk(ctx)
            if update_group is not None:
                scales, version, failures, lost = exchange_leftovers(
                    update_group,
                    is_source=ctx.role == "send" and update_group.rank == 0,
                    kv_scales=ctx.option("kv_scales"),
                    deadline=self._deadline(ctx),
                    version=version if version is not None else -1,
                    ok=failure is None,
                    lost=isinstance(failure, PeerLost),
                )
            else:
                failures, lost = int(failure is not None), int(isinstance(failure, PeerLost))
        except BaseException as exc:  # cut short: messages of this attempt may still be posted
            self._spoiled(ctx, live)
            if isinstance(exc, RefitAborted) and ctx.deadline is not None:
                ctx.deadline.check()  # a fired deadline is a RefitTimeout
            raise
        finally:
            self._active = []
        if failure is not None:
            raise failure
        if lost:
            # A process of this refit is gone: every rank must rebuild its groups.
            raise PeerLost(f"refit {version}: {lost} rank(s) lost a peer; rebuild the groups",
                           rank=ctx.rank, transport=self.name)
        if failures:
            raise TransportError(
                f"refit {version}: {failures} rank(s) failed to receive it; no rollout committed it",
                rank=ctx.rank, transport=self.name,
            )
        return RefitReport(
            transport=self.name, role=ctx.role, version=int(version), bytes=nbytes,
            seconds=time.perf_counter() - t0, buckets=nbuckets,
            peak_extra_bytes=sum(b.numel() for b in ctx.state["ring"]), kv_scales=scales,
        )

    def _post(self, batch: list, kind: str, pending: deque) -> None:
        """Post ``batch`` ((msg, tensor, slot) in key order) at once: one
        ``batch_isend_irecv`` per group; the works join ``pending`` in key order.

        A batch holds messages of one kind (headers or buckets), so on NCCL — where a
        batch's ops finish together — a header never waits for a bucket.
        """
        by_group: dict[int, list] = {}
        for entry in batch:
            by_group.setdefault(id(entry[0].group), []).append(entry)
        works: dict[int, Any] = {}
        for entries in by_group.values():
            group = entries[0][0].group
            posted = group.batch_isend_irecv([(kind, t, m.peer, m.tag) for m, t, _ in entries])
            works.update((id(e), w) for e, w in zip(entries, posted))
        pending.extend((works[id(e)], *e) for e in batch)
        batch.clear()

    def _make_room(self, batch: list, pending: deque, bucket: bool, kind: str, complete) -> None:
        """Before the next message joins ``batch``: post the batch when that message is of
        the other kind (header / bucket) or the window is full, then ``complete`` the
        oldest pending messages until the window has room (``in_flight`` at most)."""
        if batch and (bucket != (batch[0][0].copies is not None) or len(pending) + len(batch) >= self.in_flight):
            self._post(batch, kind, pending)
        while pending and len(pending) + len(batch) >= self.in_flight:
            complete()

    def _send_bulk(self, ctx: TransportContext, version: int):
        """Send every scheduled message; returns (bytes, buckets, failure).

        A peer that is gone (``PeerLost``) does not stop the loop: its remaining
        messages are skipped and the others still get theirs, so every live rank
        reaches the verdict round promptly and learns of the loss there.
        """
        plan, params, ring = ctx.state.get("bulk_plan") or ctx.plan, ctx.params, ctx.state["ring"]
        deadline = self._deadline(ctx)
        schedule = ctx.state["schedule"]
        headers = _header_rows(ctx, version, self.checksum, schedule)
        spans = ctx.state.setdefault("direct_spans", _DirectSpans()).check(plan, params, ring)
        pending: deque = deque()  # (work, msg, tensor, slot or None), key order
        batch: list = []  # messages collected but not posted yet
        free = list(range(len(ring)))
        total = buckets = 0
        lost: set[int] = set()
        failure: PeerLost | None = None

        def settle() -> None:
            nonlocal failure
            work, m, _t, slot = pending.popleft()
            try:
                m.group.wait(work, deadline=deadline, what="reshard send")
            except PeerLost as exc:
                lost.add(m.key[2])
                failure = failure or exc
            if slot is not None:
                free.append(slot)

        for i, m in enumerate(schedule):
            if m.key[2] in lost:
                continue
            kind = m.copies is not None
            self._make_room(batch, pending, kind, "send", settle)
            if not kind:
                batch.append((m, headers[i], None))
                continue
            direct = None if self.checksum else spans.get(plan, i, m.copies, params, "src")
            if direct is not None:
                batch.append((m, direct, None))
            else:
                if not free:
                    self._post(batch, "send", pending)  # what is packed already goes out first
                    while not free:
                        settle()
                slot = free.pop()
                buf = self._buffer(ctx, slot, m.nbytes + (8 if self.checksum else 0))
                if spans.moves(plan, m.key, slot, m.copies, params, buf, "src"):
                    end = m.nbytes
                else:
                    end = pack(plan, m.copies, params, buf)
                if self.checksum:
                    buf.narrow(0, end, 8).view(torch.int64).fill_(bucket_crc(buf.narrow(0, 0, end)))
                    end += 8
                batch.append((m, buf.narrow(0, 0, end), slot))
            total += m.nbytes
            buckets += 1
        if batch:
            self._post(batch, "send", pending)
        while pending:
            settle()
        return total, buckets, failure

    def _buffer(self, ctx: TransportContext, slot: int, size: int) -> torch.Tensor:
        # bucket_copies cuts any box down to bucket_bytes (inside rows too; elements are
        # at most 8 bytes and buckets at least 1 KiB) and the ring fits the largest
        # message, so every message fits a slot.
        return ctx.state["ring"][slot].narrow(0, 0, size)

    def _recv_bulk(self, ctx: TransportContext):
        return recv_bulk(self, ctx)

    async def aclose(self) -> None:
        self._closed = True
