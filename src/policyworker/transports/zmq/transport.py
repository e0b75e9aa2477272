"""zmq: a colocated trainer and rollout (same GPU, or same host on CPU) — one copy per byte.

The rollout *pulls*: it maps the trainer's parameter storages (CUDA IPC on a GPU,
file_system shared memory on CPU) and copies exactly its plan's byte ranges out of
them into its own tensors. Only small typed messages (:mod:`.zmq_wire`) cross the
ZMQ socket; handles are exported once per storage, opened once per peer, and
re-exported only when a storage moved (its ``(data_ptr, bytes, device)`` — plus
the shm file on CPU — changed), which the report's notes say.

Plan: the trainer holds full tensors (``build_plan(config, "tp=1", gen, 1, G)``);
rollout rank g pulls ``plan.receives(g)`` from its own colocated trainer.

Order (see :mod:`.zmq_wire` for the messages): connect = Hello → Welcome (plan hash
check, ``PlanMismatch`` on both sides); each refit = Ready → Offer → [BucketReady ⇄
BucketDone]* → Done → Commit | Abort. The trainer must not write its parameters
between Offer and Commit (the rollout is reading them); the rollout commits only on
Commit, after every expected byte landed.

Copies whose regions are contiguous on both sides *and* adjacent to the previous
one on both sides are merged: with ``flatten=True`` (trainer parameters re-pointed
into one buffer) and the rollout's default flat allocation, a tp=1 refit is a single
copy. Sources that cannot be mapped (on another device, e.g. offloaded, or
``staged=True``) travel through a ring of ``staging`` buffers of ``bucket_bytes``
that lives across refits, with up to ``staging`` buckets in flight.

Copies the plan's destination format converts (:mod:`..layout.formats`; block
quantization, say) are converted on the way — for a mapped source, by the rollout's
pull itself (the format's one launch, which reads the trainer's storage once, writes
the converted bytes in place, and may also make the refit's small plain copies after
torch's copies of the big ones); for a staged source, by the trainer while packing the
ring bucket. ``state["timing"]`` holds the last pull's phase stamps
(``time.perf_counter``) for benchmarks.

This module is the protocol: the trainer's side of the sources (flatten, export,
fingerprint, ring) is :mod:`.zmq_export`, the rollout's copy program (views, coalesced
copies, the format's launch, the GPU wait) is :mod:`.zmq_program`.

Threads: every socket operation and copy runs on the worker's refit executor
(``ctx.blocking``); :meth:`ZmqIpcTransport.abort` may be called from any thread.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from policyworker.config import positive_int, positive_seconds
from policyworker.errors import ConfigError, PlanMismatch, ProtocolError, PolicyWorkerError, TransportError
from policyworker.layout.apply import copy_nbytes, pack, unpack
from policyworker.layout.local import validate_kv_scales
from policyworker.layout.plan import ReshardPlan
from policyworker.transports.zmq import export as zx
from policyworker.transports.zmq import wire as w
from policyworker.transports.base import RefitReport, Transport, TransportContext
from policyworker.transports.ipc_handles import open_handle
from policyworker.transports.zmq.channel import RECONNECT_GRACE_S, Channel, StartedOver, open_socket
from policyworker.transports.zmq.program import CopyProgram, _sync, coalesce, compile_program, signature, staged_buckets

__all__ = ["ZmqIpcTransport", "coalesce"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ZmqSetup:
    """Attach-time setup (see :class:`ZmqIpcTransport` for the meaning of each)."""

    bucket_bytes: int = 64 << 20
    staging: int = 2
    staged: bool = False
    flatten: bool = False
    endpoint: str | None = None
    bind: bool | None = None
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        positive_int(self.bucket_bytes, "bucket_bytes", minimum=1024)
        positive_int(self.staging, "staging")
        positive_seconds(self.timeout_s, "timeout_s", optional=False)
        if self.endpoint is not None and not self.endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ConfigError(f"endpoint must be a zmq address (ipc://, tcp://, inproc://), got {self.endpoint!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ZmqOptions:
    """Per-refit options: ``kv_scales`` (name → float) ride in the Offer."""

    kv_scales: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_scales", validate_kv_scales(self.kv_scales))


class ZmqIpcTransport(Transport):
    """See the module docstring.

    ``bucket_bytes``/``staging``: the ring for sources that cannot be mapped.
    ``staged``: force every source through the ring (tests; or the NeMo-RL-like path).
    ``flatten``: at connect, re-point the trainer's parameters into one buffer (one
    extra copy, once) so refits coalesce into few copies. The socket: the worker's
    (``ctx.state["socket"]``, from ``maybe_init_zmq``) when there is one, else an own
    socket on ``endpoint`` (default: the worker's ``get_zmq_address()``), bound by the
    sender unless ``bind`` says otherwise. ``timeout_s`` bounds each wait when the
    refit has no deadline.
    """

    name = "zmq"
    Setup = ZmqSetup
    Options = ZmqOptions
    needs_plan = True

    @classmethod
    def from_setup(cls, setup: ZmqSetup) -> ZmqIpcTransport:
        return cls(bucket_bytes=setup.bucket_bytes, staging=setup.staging, staged=setup.staged,
                   flatten=setup.flatten, endpoint=setup.endpoint, bind=setup.bind, timeout_s=setup.timeout_s)

    def __init__(self, *, bucket_bytes: int = 64 << 20, staging: int = 2, staged: bool = False,
                 flatten: bool = False, endpoint: str | None = None, bind: bool | None = None,
                 timeout_s: float = 30.0, poll_s: float = 0.05) -> None:
        for value, what, low in ((bucket_bytes, "bucket_bytes", 1024), (staging, "staging", 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{what} must be an int >= {low}, got {value!r}", transport=self.name)
        positive_seconds(timeout_s, "timeout_s", optional=False)
        self.bucket_bytes, self.staging = bucket_bytes, staging
        self.staged, self.flatten = bool(staged), bool(flatten)
        self.endpoint, self.bind = endpoint, bind
        self.timeout_s, self.poll_s = float(timeout_s), poll_s
        self._own: tuple[Any, Any] | None = None  # (zmq context, socket) we created
        self._chan: Channel | None = None
        self._executor: Any = None
        self._state: dict[str, Any] | None = None
        self._closed = False
        # The abort event of the refit (or connect) called last: made on the event loop
        # when it is called, installed on the channel when it reaches the executor.
        self._abort_ev = threading.Event()

    # -- plumbing ------------------------------------------------------------------
    def abort(self) -> None:
        """Cut the current wait short (RefitAborted / RefitTimeout); any thread.

        Aborts the refit called last, also when it has not reached the executor yet;
        the next refit gets a fresh token (:meth:`_arm`), so nothing is ever cleared."""
        self._abort_ev.set()

    def _arm(self) -> None:
        """A refit/connect was called: a fresh abort token for it (runs on the event loop)."""
        self._abort_ev = threading.Event()

    def _channel(self, ctx: TransportContext) -> Channel:
        self._state = ctx.state
        sock = ctx.state.get("socket")
        if sock is None:
            if self._own is None:
                endpoint = self.endpoint
                if endpoint is None and hasattr(ctx.worker, "get_zmq_address"):
                    endpoint = ctx.worker.get_zmq_address()
                if endpoint is None:
                    raise ConfigError("zmq needs ctx.state['socket'] or an endpoint", transport=self.name)
                bind = (ctx.role == "send") if self.bind is None else self.bind
                self._own = open_socket(endpoint, bind=bind, timeout_s=self.timeout_s)
            sock = self._own[1]
        if self._chan is None or self._chan.sock is not sock:
            if self._chan is not None:
                self._chan.close()
            self._chan = Channel(sock, rank=ctx.rank, poll_s=self.poll_s)
        return self._chan

    def _begin(self, ctx: TransportContext) -> tuple[Channel, float]:
        if self._closed:
            raise TransportError("transport is closed", transport=self.name)
        if not isinstance(ctx.plan, ReshardPlan):
            raise ConfigError("zmq needs ctx.plan (a ReshardPlan with one full source)", transport=self.name)
        if ctx.plan.body.train_world_size != 1:
            raise ConfigError("zmq plans have one full source: build_plan(config, 'tp=1', gen, 1, G)",
                              transport=self.name)
        chan = self._channel(ctx)
        self._executor = ctx.executor
        # The rollout draws a fresh attempt per refit (its Ready opens it on the trainer).
        chan.begin(self._abort_ev, ctx.deadline, secrets.token_hex(6) if ctx.role == "receive" else None,
                   self.timeout_s)
        deadline = ctx.deadline.at if ctx.deadline is not None else time.monotonic() + self.timeout_s
        return chan, deadline

    def _check_connected(self, ctx: TransportContext) -> None:
        if self._closed:
            raise TransportError("transport is closed", transport=self.name)
        if ctx.state.get("connected_hash") != getattr(ctx.plan, "hash", None):
            raise TransportError("connect() must run (again) before a refit with this plan", transport=self.name)

    # -- connect -------------------------------------------------------------------
    async def connect(self, ctx: TransportContext) -> None:
        """Trainer: prepare sources, wait for Hello. Rollout: Hello, wait for Welcome."""
        if self._closed:
            raise TransportError("transport is closed", transport=self.name)
        self._arm()
        await ctx.blocking(self._connect_send if ctx.role == "send" else self._connect_receive, ctx)

    def _connect_send(self, ctx: TransportContext) -> None:
        chan, deadline = self._begin(ctx)
        ctx.state.pop("connected_hash", None)
        zx.prepare_sources(ctx, staged=self.staged, flatten=self.flatten)
        hello = chan.expect(deadline, "waiting for the rollout's Hello", w.Hello, reconnect_grace_s=RECONNECT_GRACE_S)
        self._welcome(ctx, chan, hello)

    def _welcome(self, ctx: TransportContext, chan: Channel, hello: w.Hello) -> None:
        plan = ctx.plan
        ok = hello.plan_hash == plan.hash and 0 <= hello.rank < plan.body.gen_world_size
        reason = "" if ok else f"trainer plan {plan.hash[:12]}, rollout rank {hello.rank} plan {hello.plan_hash[:12]}"
        chan.send(w.Welcome(plan_hash=plan.hash, session=hello.session, ok=ok, reason=reason), "Welcome")
        if not ok:
            raise PlanMismatch(f"colocated rollout disagrees on the plan: {reason}", rank=ctx.rank, transport=self.name)
        # A new session has opened nothing yet: every handle goes out again.
        ctx.state.update(peer_rank=hello.rank, peer_session=hello.session, sent_handles=set(),
                         sent_epoch=None, connected_hash=plan.hash)

    def _connect_receive(self, ctx: TransportContext) -> None:
        chan, deadline = self._begin(ctx)
        ctx.state.pop("connected_hash", None)
        session = secrets.token_hex(8)
        hello = w.Hello(rank=ctx.rank, plan_hash=ctx.plan.hash, session=session,
                        device_id=getattr(ctx.device, "device_id", ""), pid=os.getpid())
        chan.send(hello, "Hello")
        while True:
            # A Hello sent down a connection that closed (the trainer's previous socket on a
            # re-attach) is lost with it: send it again on the connection zmq makes next.
            msg = chan.expect(deadline, "waiting for the trainer's Welcome", w.Welcome,
                              reconnect_grace_s=RECONNECT_GRACE_S, on_reconnect=lambda: chan.send(hello, "Hello"))
            if msg.session == session:
                break  # an older session's Welcome can still be queued: skip it
        if not msg.ok:
            raise PlanMismatch(f"colocated trainer disagrees on the plan: {msg.reason}", rank=ctx.rank,
                               transport=self.name)
        for storage in ctx.state.get("opened", {}).values():
            del storage
        ctx.state.update(session=session, opened={}, program=None, sources=(None, []),
                         connected_hash=ctx.plan.hash)

    # -- trainer side ----------------------------------------------------------------
    async def send(self, ctx: TransportContext, version: int) -> RefitReport:
        """Offer refit ``version`` to the colocated rollout and wait for its Commit-able Done."""
        self._check_connected(ctx)
        self._arm()
        return await ctx.blocking(self._send, ctx, version)

    def _send(self, ctx: TransportContext, version: int) -> RefitReport:
        t0 = time.perf_counter()
        chan, deadline = self._begin(ctx)
        plan, st, dev = ctx.plan, ctx.state, ctx.device.torch_device
        names = ctx.plan.local_tensors("src", 0)
        cache, notes = st.get("cache"), []
        # Fast path: a refit whose sources did not move reuses the exported table (a
        # loop of Python over hundreds of params would hold the GIL off the event loop).
        fp = zx.fingerprint(ctx.params, names)
        # The table and the ring depend on this instance's setup too: a re-attach with
        # another setup (the state dict outlives instances) builds them again.
        setup = (self.staged, self.flatten, self.bucket_bytes, self.staging)
        if cache is None or fp is None or cache["fp"] != fp or cache["setup"] != setup:
            cache = st["cache"] = None  # the old table's storages are not held past this point
            notes = zx.prepare_sources(ctx, staged=self.staged, flatten=self.flatten)
            refs, more = zx.export(ctx)
            notes += more
            st["epoch"] = st.get("epoch", 0) + 1
            cache = st["cache"] = {"fp": zx.fingerprint(ctx.params, names), "refs": refs, "rank": None,
                                   "holds": zx.holds(ctx, names), "setup": setup}
        _sync(dev, chan, deadline)  # the trainer's last writes must be visible before the rollout reads
        while True:
            try:
                return self._attempt(ctx, chan, deadline, version, cache, notes, t0)
            except StartedOver:
                # The rollout re-attached or retried mid-attempt (after a failure of its own):
                # this attempt is abandoned on both sides (its messages carry its token); follow
                # the rollout's new Hello / Ready, within the same deadline.
                continue

    def _attempt(self, ctx: TransportContext, chan: Channel, deadline: float, version: int, cache: dict,
                 notes: list, t0: float) -> RefitReport:
        plan, st, dev = ctx.plan, ctx.state, ctx.device.torch_device
        refs = cache["refs"]
        notes = list(notes)
        msg = chan.expect(deadline, "waiting for the rollout's Ready", w.Ready, w.Hello)
        while isinstance(msg, w.Hello):  # the rollout reconnected (new session): welcome it again
            self._welcome(ctx, chan, msg)
            msg = chan.expect(deadline, "waiting for the rollout's Ready", w.Ready, w.Hello)
        rank = st["peer_rank"]
        if cache["rank"] != rank:
            staged_names = {r.name for r in refs if r.handle < 0}
            buckets = staged_buckets(plan, rank, staged_names, self.bucket_bytes)
            ring = []
            if buckets:
                ring = zx.ring(ctx, self.staging, max(sum(copy_nbytes(plan, c) for c in b) for b in buckets))
            cache.update(rank=rank, buckets=buckets, ring=ring)
            st["epoch"] = st.get("epoch", 0) + 1
        buckets, ring, epoch = cache["buckets"], cache["ring"], st["epoch"]
        handles = [*st["exports"].values(), *(h for _, h in ring)]
        sent: set[int] = st["sent_handles"]
        new = [h for h in handles if h.id not in sent]
        release = [i for i in st.pop("release", []) if i in sent]
        send_table = st.get("sent_epoch") != epoch
        chan.send(w.Offer(version=version, plan_hash=plan.hash, handles=new, release=release,
                          sources=refs if send_table else [], staged_buckets=len(buckets),
                          ring=[h.id for _, h in ring], bucket_bytes=self.bucket_bytes,
                          kv_scales=ctx.option("kv_scales"), epoch=epoch), "Offer")
        st["sent_epoch"] = epoch
        sent.update(h.id for h in new)
        sent.difference_update(release)
        free, out = list(range(len(ring))), {}
        done = None
        for seq, bucket in enumerate(buckets):
            while not free:
                done = self._on_reply(chan.expect(deadline, "waiting for a BucketDone", w.BucketDone, w.Done),
                                      version, free, out)
                if done is not None:
                    break
            if done is not None:
                break
            slot = free.pop(0)
            pack(plan, bucket, ctx.params, ring[slot][0])
            _sync(dev, chan, deadline)
            out[seq] = slot
            chan.send(w.BucketReady(version=version, seq=seq, slot=slot), "BucketReady")
        while done is None:
            done = self._on_reply(chan.expect(deadline, "waiting for Done", w.BucketDone, w.Done), version, free, out)
        want = plan.recv_bytes_per_dst_rank()[rank]
        if not done.ok or done.nbytes != want:
            reason = done.error or f"rollout received {done.nbytes} of {want} bytes"
            chan.send(w.Abort(version=version, reason=reason), "Abort")
            raise TransportError(f"refit {version} failed on rollout rank {rank}: {reason}", rank=ctx.rank,
                                 transport=self.name)
        chan.send(w.Commit(version=version), "Commit")
        notes.append(f"handles sent {len(new)}, released {len(release)}, exported {len(st['exports'])}")
        return RefitReport(transport=self.name, role="send", version=version, bytes=want,
                           seconds=time.perf_counter() - t0, buckets=len(buckets) or 1,
                           peak_extra_bytes=sum(b.numel() for b, _ in ring), notes=tuple(notes))

    @staticmethod
    def _on_reply(msg: w.ZmqMessage, version: int, free: list[int], out: dict[int, int]) -> w.Done | None:
        if msg.version != version:
            raise ProtocolError(f"reply for refit {msg.version} during refit {version}", transport="zmq")
        if isinstance(msg, w.Done):
            return msg
        if msg.seq not in out:
            raise ProtocolError(f"BucketDone for bucket {msg.seq}, which is not outstanding", transport="zmq")
        free.append(out.pop(msg.seq))
        return None

    # -- rollout side ----------------------------------------------------------------
    async def receive(self, ctx: TransportContext, version: int | None = None) -> RefitReport:
        """Pull the next refit into ``ctx.params``; its version comes from the Offer.

        Commits nothing itself (the caller does, on success). ``ctx.touched``
        says whether live bytes were overwritten; the report's ``kv_scales`` are the
        scales that rode along.
        """
        self._check_connected(ctx)
        self._arm()
        return await ctx.blocking(self._receive, ctx, version)

    def _receive(self, ctx: TransportContext, expect_version: int | None) -> RefitReport:
        t0 = time.perf_counter()
        chan, deadline = self._begin(ctx)
        st = ctx.state
        ctx.touched = False
        # perf_counter stamps of this pull's phases (benchmarks read them; nothing else does)
        times = st["timing"] = {"begin": t0}
        chan.send(w.Ready(session=st["session"], committed=int(st.get("committed", 0))), "Ready")
        offer = chan.expect(deadline, "waiting for the trainer's Offer", w.Offer)
        times["offer"] = time.perf_counter()
        try:
            nbytes, ncopies, notes = self._pull(ctx, chan, offer, deadline)
        except PolicyWorkerError as exc:
            self._report_failure(chan, offer.version, exc)
            raise
        except RuntimeError as exc:  # a torch copy/view failed: tell the trainer, then translate
            err = TransportError(f"refit {offer.version}: {exc}", rank=ctx.rank, transport=self.name)
            self._report_failure(chan, offer.version, err)
            raise err from exc
        chan.send(w.Done(version=offer.version, nbytes=nbytes, ok=True), "Done")
        verdict = chan.expect(deadline, "waiting for Commit", w.Commit, w.Abort)
        times["commit"] = time.perf_counter()
        if isinstance(verdict, w.Abort) or verdict.version != offer.version:
            raise TransportError(f"trainer aborted refit {offer.version}: {getattr(verdict, 'reason', '')}",
                                 rank=ctx.rank, transport=self.name)
        if expect_version is not None and offer.version != expect_version:
            notes.append(f"trainer sent version {offer.version} (asked for {expect_version})")
        st["committed"] = offer.version
        return RefitReport(transport=self.name, role="receive", version=offer.version, bytes=nbytes,
                           seconds=time.perf_counter() - t0, buckets=offer.staged_buckets or 1,
                           notes=tuple(notes + [f"copies {ncopies}"]), kv_scales=offer.kv_scales)

    def _report_failure(self, chan: Channel, version: int, exc: BaseException) -> None:
        try:
            chan.send(w.Done(version=version, nbytes=0, ok=False, error=f"{type(exc).__name__}: {exc}"), "Done")
        except PolicyWorkerError:
            pass  # the trainer is gone or stuck: it times out on its own; the first error wins

    def _pull(self, ctx: TransportContext, chan: Channel, offer: w.Offer, deadline: float):
        st, dev, plan = ctx.state, ctx.device.torch_device, ctx.plan
        times = st["timing"]
        if offer.plan_hash != plan.hash:
            raise PlanMismatch("the trainer's Offer is for another plan", rank=ctx.rank, transport=self.name)
        opened: dict[int, torch.UntypedStorage] = st["opened"]
        for h in offer.handles:
            opened[h.id] = open_handle(h, dev)
        for hid in offer.release:
            opened.pop(hid, None)
        if offer.sources:
            st["sources"] = (offer.epoch, offer.sources)
        elif st.get("sources", (None,))[0] != offer.epoch:
            raise ProtocolError(f"Offer without sources for unknown epoch {offer.epoch}", rank=ctx.rank,
                                transport=self.name)
        program: CopyProgram | None = st.get("program")
        dst_key = tuple(t.data_ptr() for t in ctx.params.values())
        if program is not None and program.dst_key != dst_key:  # the other set of a double buffer
            program, st["program_alt"] = st.get("program_alt"), program
        notes = [f"opened {len(offer.handles)} handles"] if offer.handles else []
        if offer.handles or offer.release:
            st["program_alt"] = None  # compiled against handles that change now
        if (program is None or program.dst_key != dst_key or program.signature != signature(offer) or offer.handles
                or offer.release):
            program = compile_program(plan, ctx.rank, dev, ctx.params, offer, st["sources"][1], opened)
            program.dst_key = dst_key
            notes.append("copy program rebuilt")
            note = program.launch.note(len(program.runs))
            if note is not None:
                notes.append(note)
        st["program"] = program
        buckets, ring = program.buckets, program.ring
        times["program"] = time.perf_counter()
        if len(buckets) != offer.staged_buckets:
            raise ProtocolError(f"trainer stages {offer.staged_buckets} buckets, the plan says {len(buckets)}",
                                rank=ctx.rank, transport=self.name)
        ctx.touched = True  # bytes land in the live tensors from here on
        nbytes = program.issue(times)
        for seq, bucket in enumerate(buckets):
            msg = chan.expect(deadline, "waiting for a BucketReady", w.BucketReady)
            if msg.version != offer.version or msg.seq != seq or not 0 <= msg.slot < len(ring):
                raise ProtocolError(f"unexpected BucketReady {msg}", rank=ctx.rank, transport=self.name)
            nbytes += unpack(plan, bucket, ring[msg.slot], ctx.params)
            _sync(dev, chan, deadline)  # the slot is reused once acked: finish reading it first
            chan.send(w.BucketDone(version=offer.version, seq=seq), "BucketDone")
        program.join()  # the launch's side stream (if it ran there) joins ours: the wait covers it
        times["buckets_done"] = time.perf_counter()
        _sync(dev, chan, deadline)
        times["device_done"] = time.perf_counter()
        want = plan.recv_bytes_per_dst_rank()[ctx.rank]
        if nbytes != want:
            raise ProtocolError(f"refit {offer.version}: pulled {nbytes} of {want} bytes", rank=ctx.rank,
                                transport=self.name)
        return nbytes, program.ncopies, notes

    # -- close -----------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop waits, drop mapped storages, close an own socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.abort()
        own, self._own = self._own, None
        chan, self._chan = self._chan, None
        # The worker's socket (maybe_init_zmq) was handed to this transport: close it too.
        shared = None
        if self._state is not None and self._state.get("socket") is not None:
            shared = (self._state.pop("zmq_context", None), self._state.pop("socket"))
        if own is None and shared is None:
            if chan is not None:
                chan.close()
            return

        def close() -> None:
            if chan is not None:
                chan.close()  # the monitor first: a context with an open socket never terminates
            for pair in (own, shared):
                if pair is None:
                    continue
                zctx, sock = pair
                sock.close(0)
                if zctx is not None:
                    zctx.term()

        # The socket belongs to the refit executor's thread: close it there, after the
        # aborted refit (if any) returned. No executor (in-process tests): nothing runs.
        if self._executor is not None:
            from policyworker.runtime._aio import run_in_executor

            try:
                await run_in_executor(self._executor, close)
                return
            except RuntimeError:  # the executor was shut down already: nothing runs on it
                pass
        close()
