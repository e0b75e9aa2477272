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

FP8 targets (issue 16): a copy into an fp8 tensor is quantized on the way — for a
mapped source, by the rollout's pull itself (one fused read of the trainer's bf16
storage, fp8 + scales written in place; one Triton launch on a GPU, which also
makes the refit's small plain copies, after torch's copies of the big ones; a CUDA
graph replayed on the pull's stream from the second refit on); for a staged source, by
the trainer while packing the ring bucket. ``state["timing"]`` holds the last pull's
phase stamps (``time.perf_counter``) for benchmarks.

Threads: every socket operation and copy runs on the worker's refit executor
(``ctx.blocking``); :meth:`ZmqIpcTransport.abort` may be called from any thread.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import positive_int, positive_seconds
from ..errors import ConfigError, PlanMismatch, ProtocolError, PolicyWorkerError, TransportError
from ..layout import fp8 as _fp8
from ..layout import fp8_pack as _fp8_pack
from ..layout.apply import _region, bucket_copies, copy_nbytes, pack, unpack
from ..layout.local import validate_kv_scales
from ..layout.plan import ReshardPlan
from . import zmq_wire as w
from .base import RefitReport, Transport, TransportContext
from .ipc_handles import export_storage, flatten_into, open_handle, share_cpu, source_view, storage_key
from .zmq_channel import Channel, open_socket

__all__ = ["ZmqIpcTransport", "coalesce"]


#: For how long :func:`_sync` polls the GPU every ``_FAST_SLEEP_S`` before it falls back
#: to every ``_SLEEP_S``. A refit's copies take milliseconds; polling every 0.2 ms (~0.27
#: with the kernel's 50 us timer slack) found their end ~0.14 ms late on average, on
#: every refit; every 10 us (~60 us with the slack) finds it ~30 us late. Sleeps, not a
#: spin: the GIL stays free between polls (the loop and the watchdog never wait for
#: it), and a long wait (a hung or very long kernel) costs few wake-ups.
_FAST_POLL_S = 0.02
_FAST_SLEEP_S = 0.00001
_SLEEP_S = 0.0002


def _sync(device: torch.device, chan: Channel | None = None, deadline: float | None = None) -> None:
    """Wait for this thread's work on ``device``: an event on the current (the transport's)
    stream, polled so that an abort or the deadline cuts it short. Never a device-wide
    synchronize, which would also wait on other streams' (possibly hung) kernels.

    Polls every ``_FAST_SLEEP_S`` for the first ``_FAST_POLL_S``, then every ``_SLEEP_S``;
    each poll checks the abort and the deadline."""
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    fast_until = time.monotonic() + _FAST_POLL_S
    while not event.query():
        if chan is not None:
            chan._check_abort("waiting for the GPU")
        now = time.monotonic()
        if deadline is not None and now > deadline:
            from ..errors import RefitTimeout

            raise RefitTimeout("the GPU did not finish the refit's copies before the deadline", transport="zmq")
        time.sleep(_FAST_SLEEP_S if now < fast_until else _SLEEP_S)


_data_ptr = torch.Tensor.data_ptr


def _u8(storage: torch.UntypedStorage, begin: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, begin, (n,))


def coalesce(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(src, dst) copies → fewer copies: runs contiguous and adjacent on *both* sides merge.

    Contiguous copies are ordered by source address, then merged while the next one
    starts where the previous ended in the same storage on both sides (byte views).
    Strided copies stay as they are (one strided ``copy_`` each).
    """
    flat, strided = [], []
    for src, dst in pairs:
        if src.is_contiguous() and dst.is_contiguous():
            ss, ds = src.untyped_storage(), dst.untyped_storage()
            n = src.numel() * src.element_size()
            flat.append((ss.data_ptr(), src.storage_offset() * src.element_size(), ss,
                         ds.data_ptr(), dst.storage_offset() * dst.element_size(), ds, n, src.device, dst.device))
        else:
            strided.append((src, dst))
    flat.sort(key=lambda r: (r[0], r[1]))
    runs: list[list[Any]] = []
    for sp, sb, ss, dp, db, ds, n, sdev, ddev in flat:
        last = runs[-1] if runs else None
        if last is not None and last[0] == sp and last[1] + last[6] == sb and last[3] == dp and last[4] + last[6] == db:
            last[6] += n
        else:
            runs.append([sp, sb, ss, dp, db, ds, n, sdev, ddev])
    out = [(_u8(ss, sb, n, sdev), _u8(ds, db, n, ddev)) for sp, sb, ss, dp, db, ds, n, sdev, ddev in runs]
    return out + strided


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
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 < timeout_s < float("inf"):
            raise ConfigError(f"timeout_s must be a finite number > 0, got {timeout_s!r}", transport=self.name)
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
        chan.begin(self._abort_ev, ctx.deadline, secrets.token_hex(6) if ctx.role == "receive" else None)
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
        self._prepare_sources(ctx)
        hello = chan.expect(deadline, "waiting for the rollout's Hello", w.Hello)
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
        chan.send(w.Hello(rank=ctx.rank, plan_hash=ctx.plan.hash, session=session,
                          device_id=getattr(ctx.device, "device_id", ""), pid=os.getpid()), "Hello")
        while True:
            msg = chan.expect(deadline, "waiting for the trainer's Welcome", w.Welcome)
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
    def _prepare_sources(self, ctx: TransportContext) -> list[str]:
        """Put mappable sources where they can be exported; return notes on moves."""
        notes = []
        dev = ctx.device.torch_device
        names = list(ctx.plan.local_tensors("src", 0))
        missing = [n for n in names if n not in ctx.params]
        if missing:
            raise ConfigError(f"trainer lacks source tensor {missing[0]!r}", rank=ctx.rank, param=missing[0])
        direct = [] if self.staged else [n for n in names if ctx.params[n].device == dev]
        flat = ctx.state.get("flat")
        if self.flatten and direct:
            flat_ptr = None if flat is None else flat.untyped_storage().data_ptr()
            if any(ctx.params[n].untyped_storage().data_ptr() != flat_ptr for n in direct):
                ctx.state["flat"] = flatten_into([ctx.params[n] for n in direct], device=dev,
                                                 shared_cpu=dev.type == "cpu")
                notes.append(f"flattened {len(direct)} sources into one buffer")
        elif dev.type == "cpu":
            moved = sum(share_cpu(ctx.params[n]) for n in direct)
            if moved:
                notes.append(f"moved {moved} storages into shared memory")
        ctx.state["direct_names"] = set(direct)
        return notes

    @staticmethod
    def _fingerprint(params: Mapping[str, torch.Tensor], names) -> tuple | None:
        """Cheap per-refit check that no source moved: the sources' data pointers in plan
        order (None when one is missing or not a tensor: the slow path says which).

        It runs on every refit before the Offer, so it is one C-level pass over the
        parameters. On CPU a freed shm file's address can come back as another file:
        the cache holds the storages it was built from (:meth:`_holds`), so none of
        them is freed while its address is the fingerprint's.
        """
        try:
            return tuple(map(_data_ptr, map(params.__getitem__, names)))
        except (KeyError, TypeError):
            return None

    @staticmethod
    def _holds(ctx: TransportContext, names) -> list[torch.UntypedStorage]:
        if ctx.device.torch_device.type != "cpu":
            return []  # CUDA: data pointers alone, as the export key (an address names its block)
        return [ctx.params[n].untyped_storage() for n in names]

    def _key(self, t: torch.Tensor) -> tuple:
        key = storage_key(t)
        if t.device.type == "cpu":  # a freed shm file's address can come back as another file
            key += (t.untyped_storage()._share_filename_cpu_()[1],)
        return key

    def _export(self, ctx: TransportContext) -> tuple[list[w.SourceRef], list[str]]:
        st = ctx.state
        exports: dict[tuple, w.StorageHandle] = st.setdefault("exports", {})
        keys: dict[str, tuple] = st.setdefault("src_keys", {})
        refs, moved, used = [], 0, set()
        for name in ctx.plan.local_tensors("src", 0):
            t = ctx.params[name]
            if name not in st["direct_names"]:
                refs.append(w.SourceRef(name=name, handle=-1, offset=0, dtype=str(t.dtype).removeprefix("torch."),
                                        shape=tuple(t.shape), stride=tuple(t.stride())))
                continue
            key = self._key(t)
            if name in keys and keys[name] != key:
                moved += 1
            keys[name] = key
            h = exports.get(key)
            if h is None:
                st["next_id"] = st.get("next_id", 0) + 1
                h = exports[key] = export_storage(t, st["next_id"])
            used.add(key)
            refs.append(w.SourceRef(name=name, handle=h.id, offset=t.storage_offset(),
                                    dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                                    stride=tuple(t.stride())))
        st["release"] = [exports.pop(k).id for k in list(exports) if k not in used]
        notes = []
        if moved:
            st["reexports"] = st.get("reexports", 0) + moved
            notes.append(f"re-exported {moved} moved storages")
        return refs, notes

    def _staged_buckets(self, ctx: TransportContext, rank: int, staged_names: set[str], bucket_bytes: int):
        plan = ctx.plan
        names = plan.body.tensor_names
        copies = [c for t in plan.receives(rank) for c in t.all_copies() if names[c.src_tensor] in staged_names]
        return bucket_copies(plan, copies, bucket_bytes) if copies else []

    def _ring(self, ctx: TransportContext, slot_bytes: int) -> list[tuple[torch.Tensor, w.StorageHandle]]:
        st, dev = ctx.state, ctx.device.torch_device
        ring = st.get("ring")
        if ring is None or len(ring) != self.staging or ring[0][0].numel() < slot_bytes:
            ring = []
            for _ in range(self.staging):
                buf = torch.empty(slot_bytes, dtype=torch.uint8, device=dev)
                if dev.type == "cpu":
                    share_cpu(buf)
                buf.fill_(0)  # touch the pages once: fresh pages cost more than the copy
                st["next_id"] = st.get("next_id", 0) + 1
                ring.append((buf, export_storage(buf, st["next_id"])))
            st["ring"] = ring
        return ring

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
        fp = self._fingerprint(ctx.params, names)
        if cache is None or fp is None or cache["fp"] != fp:
            cache = st["cache"] = None  # the old table's storages are not held past this point
            notes = self._prepare_sources(ctx)
            refs, more = self._export(ctx)
            notes += more
            st["epoch"] = st.get("epoch", 0) + 1
            cache = st["cache"] = {"fp": self._fingerprint(ctx.params, names), "refs": refs, "rank": None,
                                   "holds": self._holds(ctx, names)}
        refs = cache["refs"]
        _sync(dev, chan, deadline)  # the trainer's last writes must be visible before the rollout reads
        msg = chan.expect(deadline, "waiting for the rollout's Ready", w.Ready, w.Hello)
        while isinstance(msg, w.Hello):  # the rollout reconnected (new session): welcome it again
            self._welcome(ctx, chan, msg)
            msg = chan.expect(deadline, "waiting for the rollout's Ready", w.Ready, w.Hello)
        rank = st["peer_rank"]
        if cache["rank"] != rank:
            staged_names = {r.name for r in refs if r.handle < 0}
            buckets = self._staged_buckets(ctx, rank, staged_names, self.bucket_bytes)
            ring = self._ring(ctx, max(sum(copy_nbytes(plan, c) for c in b) for b in buckets)) if buckets else []
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

        Commits nothing itself (the caller does, on success). ``ctx.state["touched"]``
        says whether live bytes were overwritten; ``ctx.state["kv_scales"]`` holds the
        scales that rode along.
        """
        self._check_connected(ctx)
        self._arm()
        return await ctx.blocking(self._receive, ctx, version)

    def _receive(self, ctx: TransportContext, expect_version: int | None) -> RefitReport:
        t0 = time.perf_counter()
        chan, deadline = self._begin(ctx)
        st = ctx.state
        st["touched"] = ctx.touched = False
        st["kv_scales"] = None
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
        st["kv_scales"] = offer.kv_scales
        return RefitReport(transport=self.name, role="receive", version=offer.version, bytes=nbytes,
                           seconds=time.perf_counter() - t0, buckets=offer.staged_buckets or 1,
                           notes=tuple(notes + [f"copies {ncopies}"]))

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
        signature = (offer.epoch, tuple(offer.ring), offer.bucket_bytes)
        program = st.get("program")
        notes = [f"opened {len(offer.handles)} handles"] if offer.handles else []
        if program is None or program[0] != signature or offer.handles or offer.release:
            program = st["program"] = (signature, *self._compile(ctx, offer, st["sources"][1], opened))
            notes.append("copy program rebuilt")
            if len(program[4]):
                notes.append(f"fp8 launch copies {program[4].copy_bytes} bytes, torch copies {len(program[1])}")
        _, runs, buckets, ring, quant = program
        times["program"] = time.perf_counter()
        if len(buckets) != offer.staged_buckets:
            raise ProtocolError(f"trainer stages {offer.staged_buckets} buckets, the plan says {len(buckets)}",
                                rank=ctx.rank, transport=self.name)
        st["touched"] = ctx.touched = True  # bytes land in the live tensors from here on
        nbytes = 0
        # fp8 hook (issue 16): one fused read of each quantized source, on its own stream
        # on a GPU, the plain copies it takes as its copy tiles (`runs`: what is left, for
        # torch); joined into our stream before the wait. Torch's copies are issued
        # first (the launch is ordered after our stream's earlier work only, by the
        # fence): a kernel that keeps every SM busy to its end would otherwise leave
        # them queued behind it, unoverlapped. Once the launch is a captured graph (its
        # second refit on) it is replayed on our own stream right after torch's copies
        # (the big ones: the launch keeps every SM busy, so nothing overlapped anyway):
        # no fence, no stream switch, no join (~0.1 ms of host per refit).
        inline = quant.replays
        if inline:
            for src, dst in runs:
                dst.copy_(src, non_blocking=True)
                nbytes += dst.numel() * dst.element_size()
            times["copies_issued"] = time.perf_counter()
            nbytes += quant.run_inline()
        else:
            quant.fence()
            for src, dst in runs:
                dst.copy_(src, non_blocking=True)
                nbytes += dst.numel() * dst.element_size()
            times["copies_issued"] = time.perf_counter()
            nbytes += quant.run(join=False, fenced=True)
        times["launch_issued"] = time.perf_counter()
        for seq, bucket in enumerate(buckets):
            msg = chan.expect(deadline, "waiting for a BucketReady", w.BucketReady)
            if msg.version != offer.version or msg.seq != seq or not 0 <= msg.slot < len(ring):
                raise ProtocolError(f"unexpected BucketReady {msg}", rank=ctx.rank, transport=self.name)
            nbytes += unpack(plan, bucket, ring[msg.slot], ctx.params)
            _sync(dev, chan, deadline)  # the slot is reused once acked: finish reading it first
            chan.send(w.BucketDone(version=offer.version, seq=seq), "BucketDone")
        if len(quant) and dev.type == "cuda" and not inline:
            from ..ops.fp8_triton import _side_stream

            # The fp8 side stream joins ours (an event, no device-wide sync): the wait
            # below then covers the quantization too.
            torch.cuda.current_stream(dev).wait_stream(_side_stream(dev))
        times["buckets_done"] = time.perf_counter()
        _sync(dev, chan, deadline)
        times["device_done"] = time.perf_counter()
        want = plan.recv_bytes_per_dst_rank()[ctx.rank]
        if nbytes != want:
            raise ProtocolError(f"refit {offer.version}: pulled {nbytes} of {want} bytes", rank=ctx.rank,
                                transport=self.name)
        return nbytes, len(runs) + len(buckets) + len(quant), notes

    def _compile(self, ctx: TransportContext, offer: w.Offer, sources: list[w.SourceRef],
                 opened: Mapping[int, torch.UntypedStorage]):
        plan, dev = ctx.plan, ctx.device.torch_device
        names = plan.body.tensor_names
        want = plan.local_tensors("src", 0)
        refs = {r.name: r for r in sources}
        if set(refs) != set(want):
            raise ProtocolError("the Offer's sources are not the plan's source tensors", rank=ctx.rank,
                                transport=self.name)
        views, staged = {}, set()
        for name, ref in refs.items():
            if tuple(ref.shape) != tuple(want[name].shape) or ref.dtype != want[name].dtype:
                raise ProtocolError(f"source {name!r} is {ref.dtype}{list(ref.shape)}, the plan says "
                                    f"{want[name].dtype}{list(want[name].shape)}", rank=ctx.rank, param=name)
            if ref.handle < 0:
                staged.add(name)
            elif ref.handle not in opened:
                raise ProtocolError(f"source {name!r} names handle {ref.handle}, never sent", rank=ctx.rank,
                                    transport=self.name)
            else:
                views[name] = source_view(opened[ref.handle], ref, dev)
        pairs, quant = [], []
        for t in plan.receives(ctx.rank):
            for c in t.all_copies():
                src_name = names[c.src_tensor]
                if src_name in staged:
                    continue
                if _fp8.is_fp8_copy(plan, c):  # fp8 hook (issue 16): quantized as it is pulled
                    quant.append(_fp8_pack.quant_job(plan, c, views[src_name], ctx.params))
                    continue
                dst = _region(ctx.params[names[c.dst_tensor]], c.dst_at, c.start, c.stop)
                pairs.append((_region(views[src_name], c.src_at, c.start, c.stop), dst))
        buckets = self._staged_buckets(ctx, ctx.rank, staged, offer.bucket_bytes)
        ring = []
        for hid in offer.ring:
            if hid not in opened:
                raise ProtocolError(f"ring handle {hid} was never sent", rank=ctx.rank, transport=self.name)
            s = opened[hid]
            ring.append(_u8(s, 0, s.nbytes(), dev))
        runs, block = coalesce(pairs), max(1, plan.body.gen_fp8_block)
        if not quant:
            return runs, buckets, ring, _fp8_pack.QuantJobs(quant, block)
        # fp8 hook (issue 16): the plain copies ride in the quantizing launch (copy tiles
        # of one persistent kernel, no launch per copy); torch copies what it cannot take.
        jobs = _fp8_pack.QuantJobs(quant, block, copies=runs)
        return jobs.copies_left, buckets, ring, jobs

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
            from .._aio import run_in_executor

            try:
                await run_in_executor(self._executor, close)
                return
            except RuntimeError:  # the executor was shut down already: nothing runs on it
                pass
        close()
