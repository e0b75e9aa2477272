"""nccl_reshard's delta mode: the wire carries only the elements that changed since the
version every receiver holds; anything unsure is a full refit.

Turned on at attach (``delta=True`` on every rank, checked at connect); per refit the
trainers may ask for a full one (``refit(..., delta=False)``). One refit, both sides:

1. **Handshake** over the update group (one short round to rank 0 and back,
   :mod:`.delta_handshake`): a trainer says the version it sends, the version of its
   *shadow* (the bytes it last sent, per transfer) and whether it wants a delta
   (option, ``delta_full_every``, the changed fraction estimated on a sample of a few
   thousand units per transfer against ``delta_max_fraction``: no pass over the
   bytes); a receiver says its *base*: the version its last good refit landed when
   its ledger committed and holds it untorn, else -1 (new, torn, after any failed
   refit). Every rank decides the same: a delta only when every trainer wants one,
   all shadows are of one version S and every receiver's base is S. Otherwise the
   refit is the plain full one (``NcclReshardTransport._refit``), after which the
   trainers copy their shards into their shadows.
2. **Delta bulk**, per (stage, trainer, receiver) transfer in the plan: a header row
   (magic, version, encoding, changed units, payload bytes, plan hash, stream bytes,
   copies) then one payload: a checksum per copy (each copy is one tensor's box) of
   the bytes the receiver must end with, then the encoded changed units
   (:mod:`policyworker.layout.delta`). The trainer encodes each distinct stream in
   one cache-sized pass that also refreshes its shadow, and updates the checksums
   from the changed words (:mod:`policyworker.layout.delta_inc`): its checksums are
   those of the bytes it sent. Both sides post every header at once, wait, then
   every payload at once (sizes are known from the headers; no cycles).
3. **Apply**, receiver: nothing live is written until every payload arrived. Then per
   transfer the changed units go into the live bytes (or a staging copy when the
   transfer's destination is not one contiguous span, unpacked after the check) and
   every copy's checksum is computed and verified; a mismatch fails the refit, marks
   the receiver torn (its bytes are proven not to be the trainers') and its base
   becomes -1, so the next refit is full. A failure before the apply leaves the live
   bytes intact. How the checksums are computed is ``delta_verify``:

   * ``"full"`` (the default): a pass over every byte the receiver holds after the
     apply. It proves those bytes equal what the trainer sent, whatever happened to
     them before (a stale staging set, a byte written outside any refit).
   * ``"incremental"``: the receiver keeps the checksums it verified at its last
     commit and adds the weighted differences of the changed units (their old values
     read just before they are overwritten, their new ones from the payload): no
     pass over its bytes. This proves the result equal to the trainer's **if and
     only if the receiver's bytes outside the changed units are still the ones it
     verified at that commit**; a byte written since, where the delta does not
     touch, goes unseen (and one where it does fails the check). So it is not as
     strong as ``"full"``, only cheaper: it trusts the memory between refits. The
     first delta after a full refit, a fallback, a failed or torn refit, a reconnect,
     or tensors that moved (another storage, e.g. a vLLM staging set) is checked in
     full, and that check is what later deltas build on.
4. **Verdict** over the update group (:func:`exchange_leftovers`), as for a full
   refit: a receiver commits only when every rank succeeded. A trainer's shadow
   counts as version S only after a successful verdict; any failure makes it
   unknown, so the next refit is full.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from policyworker.errors import ConfigError, PeerLost, PolicyWorkerError, ProtocolError, RefitAborted, TransportError
from policyworker.layout import delta as _delta
from policyworker.layout.delta_inc import apply_update, encode_update
from policyworker.layout.apply import _as_bytes, _region, pack, unpack
from policyworker.layout.plan import Copy, ReshardPlan
from policyworker.transports.base import RefitReport, TransportContext
from policyworker.transports.nccl_reshard.delta_handshake import (
    _EVERY,
    _HS_MAGIC,
    _NO_SHADOW,
    _OFF,
    _RECEIVER,
    _TOO_MANY,
    _TRAINER,
    _WANT_DELTA,
    handshake,
)
from policyworker.transports.nccl_reshard.delta_state import (
    DeltaSettings,
    _make_stream,
    _State,
    _Stream,
    check_verify,
)
from policyworker.transports.nccl_reshard.schedule import plan_hash63, stage_members
from policyworker.transports.nccl_reshard.verdict import exchange_leftovers

__all__ = ["refit"]

_HDR_MAGIC = 0x5057444C54414831  # "PWDLTAH1"
_HDR_LEN = 8  # magic, version, kind, changed units, payload bytes, plan hash, stream bytes, copies
_TAG_HDR, _TAG_PAYLOAD = (1 << 21), (1 << 21) + 1
# Below this estimated changed fraction (ppm) a trainer encodes in one cache-sized pass
# with incremental checksums (:func:`encode_update`); above it the dense path is cheaper.
_SPARSE_PPM = 60_000
_M64 = (1 << 64) - 1


def _held_at(ctx: TransportContext) -> tuple:
    return tuple(t.data_ptr() for t in ctx.params.values())


def _state(ctx: TransportContext) -> _State:
    st = ctx.state.get("delta")
    if st is None or st.plan_hash != ctx.plan.hash:
        st = ctx.state["delta"] = _State(ctx.plan.hash)
    return st


def _src_key(copies: list[Copy]) -> tuple:
    return tuple((c.param, c.start, c.stop, c.src_tensor, c.src_at) for c in copies)


def _my_transfers(ctx: TransportContext):
    plan = ctx.plan
    if ctx.role == "send":
        return [t for t in plan.sends(ctx.rank) if t.stage == ctx.state["stage"]]
    return plan.receives(ctx.rank)


def _units(s: _Stream, ctx: TransportContext, side: str) -> tuple[torch.Tensor, bool]:
    """The stream's bytes as units: a view of the tensors (True) or a packed copy (False)."""
    span = _state(ctx).spans.get(ctx.plan, s.index, s.copies, ctx.params, side)
    if span is not None and span.numel() == s.nbytes and span.data_ptr() % s.unit == 0:
        return span.view(_delta.unit_dtype(s.unit)), True
    if s.scratch is None or s.scratch.device != _device(ctx):
        s.scratch = torch.empty(s.nbytes, dtype=torch.uint8, device=_device(ctx))
    if side == "src":
        pack(ctx.plan, s.copies, ctx.params, s.scratch)
    else:
        _gather(ctx.plan, s.copies, ctx.params, s.scratch)
    return s.scratch.view(_delta.unit_dtype(s.unit)), False


def _gather(plan: ReshardPlan, copies: list[Copy], params, out: torch.Tensor) -> None:
    """The receiver's current bytes of ``copies``, packed (the base a delta applies to)."""
    names, at = plan.body.tensor_names, 0
    for c in copies:
        raw = _as_bytes(_region(params[names[c.dst_tensor]], c.dst_at, c.start, c.stop))
        n = raw.numel()
        out.narrow(0, at, n).view(raw.shape).copy_(raw)
        at += n


def _device(ctx: TransportContext) -> torch.device:
    groups = [ctx.state["group"]] if ctx.role == "send" else list(ctx.state["groups"].values())
    return groups[0].device


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


# -- the refit -------------------------------------------------------------------------------
def refit(transport: Any, ctx: TransportContext, version: int | None) -> RefitReport:
    """One refit in delta mode (either side): handshake, then delta or the plain full refit."""
    t0 = time.perf_counter()
    settings: DeltaSettings = transport.delta
    update_group = ctx.state.get("update_group")
    if update_group is None:
        raise ConfigError("delta refits need the update group (init_collective)", rank=ctx.rank,
                          transport=transport.name)
    st = _state(ctx)
    st.spans.check(ctx.plan, ctx.params)
    deadline = transport._deadline(ctx)
    streams = _trainer_streams(ctx, st) if ctx.role == "send" else None
    if ctx.role == "send":
        want, ppm = _trainer_wants(ctx, st, settings, streams, int(version))
        row = [_HS_MAGIC, _TRAINER, int(version), -1 if st.shadow_version is None else st.shadow_version, want, ppm]
    else:
        ctx.touched = False  # nothing live is written before the apply (a failed handshake leaves v-1 intact)
        # The base is what this transport last received, if the worker's ledger (when
        # there is one) committed it and holds it untorn.
        ledger = getattr(ctx.worker, "ledger", None)
        held = ledger is None or (ledger.version == st.received and not ledger.torn)
        base = st.received if st.received is not None and held and st.base_valid else -1
        st.received = None  # until this refit succeeds
        at = _held_at(ctx)
        trusted = base != -1 and st.verified_at == at
        st.verified_at = None  # until this refit succeeds
        row = [_HS_MAGIC, _RECEIVER, base, 0, 0, 0]
    early = None
    if ctx.role == "send":
        st.shadow_version = None  # unknown until this refit's verdict
        if row[4] != _WANT_DELTA:
            # This trainer refuses a delta, so the refit is full whatever the others say:
            # its shadow is no base any more and takes the bytes about to be sent now, on
            # another thread, while the handshake and the bulk run (copies release the GIL).
            early = _EarlyRefresh(ctx, streams)
    try:
        transport._active = [update_group]
        try:
            use_delta, reason, announced = handshake(update_group, row, deadline)
        finally:
            transport._active = []
        if not use_delta:
            report = transport._refit(ctx, version)
            if ctx.role == "send":
                shadow = early.result() if early is not None else _refresh(ctx, streams)
                st.shadow_version = int(version)
            else:
                shadow = 0
                st.base_valid, st.received = True, report.version
            return _report(report, notes=(f"full: {reason}",), wire=report.bytes, shadow=shadow,
                           seconds=time.perf_counter() - t0)
    finally:
        if early is not None:
            early.join()  # nothing writes a shadow once this refit returns
    if early is not None:  # a refusing trainer and a delta: the handshake is broken
        raise ProtocolError("delta handshake decided a delta over a trainer's refusal", rank=ctx.rank,
                            transport=transport.name)
    groups = [ctx.state["group"]] if ctx.role == "send" else list(ctx.state["groups"].values())
    transport._active = [*groups, update_group]
    try:
        if ctx.role == "send":
            wire, nbytes, failure = _send(ctx, st, streams, int(version), deadline, sparse=row[5] <= _SPARSE_PPM)
        else:
            ctx.touched = False
            verify = check_verify(ctx.option("delta_verify") or settings.verify)
            wire, nbytes, failure, checked = _receive(ctx, st, announced, deadline,
                                                      trusted and verify == "incremental")
            reason = f"{reason}; checked {checked}"
        scales, got_version, failures, lost = exchange_leftovers(
            update_group, is_source=ctx.role == "send" and update_group.rank == 0,
            kv_scales=ctx.option("kv_scales"), deadline=deadline, version=announced,
            ok=failure is None, lost=isinstance(failure, PeerLost))
    except RefitAborted:
        if ctx.deadline is not None:
            ctx.deadline.check()
        raise
    finally:
        transport._active = []
    if failure is not None:
        raise failure
    if lost:
        raise PeerLost(f"delta refit {announced}: {lost} rank(s) lost a peer; rebuild the groups",
                       rank=ctx.rank, transport=transport.name)
    if failures:
        raise TransportError(f"delta refit {announced}: {failures} rank(s) failed it; no rollout committed it",
                             rank=ctx.rank, transport=transport.name)
    if ctx.role == "send":
        st.shadow_version = int(version)
    else:
        st.received = int(got_version)
        st.verified_at = at  # the streams' checksums are of what this commit holds
    shadow = sum(s.nbytes for s in streams.values()) if streams else 0
    return RefitReport(transport=transport.name, role=ctx.role, version=int(got_version), bytes=nbytes,
                       seconds=time.perf_counter() - t0, wire_bytes=wire, shadow_bytes=shadow,
                       notes=(reason,), kv_scales=scales)


def _report(r: RefitReport, *, notes, wire: int, shadow: int, seconds: float) -> RefitReport:
    return RefitReport(transport=r.transport, role=r.role, version=r.version, bytes=r.bytes, seconds=seconds,
                       buckets=r.buckets, peak_extra_bytes=r.peak_extra_bytes, notes=(*r.notes, *notes),
                       wire_bytes=wire, shadow_bytes=shadow, kv_scales=r.kv_scales)


def _trainer_streams(ctx: TransportContext, st: _State) -> dict[tuple, _Stream]:
    """The trainer's distinct streams (receivers of one source region share one)."""
    for t in _my_transfers(ctx):
        copies = t.all_copies()
        key = _src_key(copies)
        if key not in st.streams:
            st.streams[key] = _make_stream(ctx.plan, copies, len(st.streams))
    return st.streams


def _trainer_wants(ctx, st: _State, settings: DeltaSettings, streams, version: int) -> tuple[int, int]:
    if ctx.option("delta") is False:
        return _OFF, 0
    if st.shadow_version is None or any(s.shadow is None for s in streams.values()):
        return _NO_SHADOW, 0
    if settings.full_every is not None and version % settings.full_every == 0:
        return _EVERY, 0
    changed = seen = 0
    for s in streams.values():
        units, _ = _units(s, ctx, "src")
        c, n = _delta.changed_fraction(units, s.shadow.view(units.dtype), s.stride)
        changed, seen = changed + c, seen + n
    ppm = int(1e6 * changed / max(seen, 1))
    return (_TOO_MANY if ppm > settings.max_fraction * 1e6 else _WANT_DELTA), ppm


def _refresh(ctx: TransportContext, streams: dict[tuple, _Stream]) -> int:
    """After a full refit: every shadow becomes the bytes just sent. Returns their bytes.

    The shadow's checksums are left unknown: the next delta computes them (one pass) only
    if there is one, so a full refit (the fallback) costs one copy of the shard."""
    for s in streams.values():
        s.sums = None
        units, _ = _units(s, ctx, "src")
        if s.shadow is None or s.shadow.numel() != s.nbytes or s.shadow.device != units.device:
            s.shadow = torch.empty(s.nbytes, dtype=torch.uint8, device=units.device)
        s.shadow.copy_(units.view(torch.uint8))
    return sum(s.nbytes for s in streams.values())


class _EarlyRefresh:
    """:func:`_refresh` on a thread of its own; :meth:`result` waits for it and returns its
    bytes or raises its error, :meth:`join` only waits."""

    def __init__(self, ctx: TransportContext, streams: dict[tuple, _Stream]) -> None:
        self._out: list = []
        self._thread = threading.Thread(target=self._run, args=(ctx, streams), name="pw-delta-shadow", daemon=True)
        self._thread.start()

    def _run(self, ctx: TransportContext, streams: dict[tuple, _Stream]) -> None:
        try:
            self._out.append(_refresh(ctx, streams))
        except BaseException as exc:  # handed to result()
            self._out.append(exc)

    def join(self) -> None:
        self._thread.join()  # a copy of this rank's shard: bounded by the memory bus

    def result(self) -> int:
        self.join()
        out = self._out[0]
        if isinstance(out, BaseException):
            raise out
        return out


def _post_all(entries: list[tuple[Any, str, torch.Tensor, int, int]], deadline: float, what: str):
    """Post (group, kind, tensor, peer, tag) at once (one batch per group), wait for each.

    Returns the failure (``PeerLost``) of the first op that failed, or None; other
    errors (aborts, timeouts) raise.
    """
    by_group: dict[int, list] = {}
    for e in entries:
        by_group.setdefault(id(e[0]), []).append(e)
    posted = []
    for es in by_group.values():
        works = es[0][0].batch_isend_irecv([(k, t, peer, tag) for _g, k, t, peer, tag in es])
        posted += [(e[0], w) for e, w in zip(es, works)]
    failure = None
    for group, work in posted:
        try:
            group.wait(work, deadline=deadline, what=what)
        except PeerLost as exc:
            failure = failure or exc
    return failure


def _send(ctx: TransportContext, st: _State, streams, version: int, deadline: float, *, sparse: bool):
    """Encode each distinct stream once, send each transfer its header and payload.

    The shadow becomes the bytes sent as they are encoded, and the checksums follow it
    (incrementally when ``sparse``: few changes were estimated)."""
    plan = ctx.plan
    hash63 = plan_hash63(plan)
    encoded: dict[tuple, tuple[_delta.Encoded, torch.Tensor]] = {}
    dev = _device(ctx)
    for key, s in streams.items():
        units, _ = _units(s, ctx, "src")
        known, s.sums = s.sums, None  # the shadow changes now: its checksums are known again below
        enc, s.sums = encode_update(units, s.shadow.view(units.dtype), s.segments, known, sparse=sparse)
        sums = s.sums
        sums_t = torch.tensor([_signed(c) for c in sums], dtype=torch.int64).view(torch.uint8)
        payload = torch.cat([sums_t.to(dev), enc.blob.to(dev)])
        encoded[key] = (enc, payload)
    members = stage_members(plan)
    n_train = len(members[ctx.state["stage"]])
    group = ctx.state["group"]
    headers, payloads = [], []
    wire = 0
    for t in _my_transfers(ctx):
        copies = t.all_copies()
        s = streams[_src_key(copies)]
        enc, payload = encoded[_src_key(copies)]
        row = torch.tensor([_HDR_MAGIC, version, enc.kind, enc.count, payload.numel(), hash63, s.nbytes,
                            len(copies)], dtype=torch.int64, device=dev)
        peer = n_train + t.dst
        headers.append((group, "send", row, peer, _TAG_HDR))
        payloads.append((group, "send", payload, peer, _TAG_PAYLOAD))
        wire += 8 * _HDR_LEN + payload.numel()
    failure = _post_all(headers, deadline, "delta header send")
    failure = _post_all(payloads, deadline, "delta payload send") or failure
    return wire, sum(t.nbytes for t in _my_transfers(ctx)), failure


def _receive(ctx: TransportContext, st: _State, version: int, deadline: float, incremental: bool):
    """Receive every transfer's header and payload, then apply and verify them.

    ``incremental``: each stream's checksums follow from its ``verified`` ones and the
    changed units (else a pass over its bytes). Returns (wire bytes, bytes landed,
    failure or None, how the bytes were checked: "in full", "incrementally" or both)."""
    plan = ctx.plan
    hash63 = plan_hash63(plan)
    members = stage_members(plan)
    groups = ctx.state["groups"]
    dev = _device(ctx)
    transfers = plan.receives(ctx.rank)
    for t in transfers:  # kept across refits: their staging (non-contiguous destinations) too
        if ("dst", t.stage, t.src) not in st.streams:
            st.streams[("dst", t.stage, t.src)] = _make_stream(plan, t.all_copies(), len(st.streams))
    streams = [st.streams[("dst", t.stage, t.src)] for t in transfers]
    rows = torch.zeros((max(1, len(transfers)), _HDR_LEN), dtype=torch.int64, device=dev)
    peers = [(groups[t.stage], members[t.stage].index(t.src)) for t in transfers]
    failure: PolicyWorkerError | None = _post_all(
        [(g, "recv", rows[i], p, _TAG_HDR) for i, (g, p) in enumerate(peers)], deadline, "delta header receive")
    heads = rows.cpu().tolist()
    payloads, entries = [], []
    for i, (t, s) in enumerate(zip(transfers, streams)):
        magic, v, kind, count, nbytes, h, stream_bytes, ncopies = heads[i]
        want = 8 * len(s.copies) + _delta.blob_bytes(kind, s.nbytes // s.unit, count, s.unit) \
            if kind in (_delta.NONE, _delta.SPARSE, _delta.BITMAP, _delta.RAW) else -1
        if failure is None and (magic != _HDR_MAGIC or h != hash63 or v != version or stream_bytes != s.nbytes
                                or ncopies != len(s.copies) or nbytes != want):
            failure = ProtocolError(f"bad delta header from train rank {t.src} (version {v}, {nbytes} B)",
                                    rank=ctx.rank, transport="nccl_reshard")
        size = nbytes if 0 <= nbytes <= 8 * len(s.copies) + 2 * s.nbytes + 64 else 0
        payloads.append(torch.empty(size, dtype=torch.uint8, device=dev))
        entries.append((*peers[i][:1], "recv", payloads[-1], peers[i][1], _TAG_PAYLOAD))
    failure = _post_all(entries, deadline, "delta payload receive") or failure
    wire = sum(p.numel() for p in payloads) + 8 * _HDR_LEN * len(transfers)
    if failure is not None:
        return wire, 0, failure, ""
    if ctx.deadline is not None and ctx.deadline.fired:
        raise RefitAborted("delta refit aborted before it was applied", rank=ctx.rank, transport="nccl_reshard")
    ways = set()
    try:
        for i, (t, s) in enumerate(zip(transfers, streams)):
            ways.add(_apply_one(ctx, t, s, heads[i], payloads[i], incremental))
    except ProtocolError as exc:
        st.base_valid = False  # these bytes are not the trainers': the next refit is full
        return wire, 0, exc, ""
    checked = " and ".join(w for w in ("incrementally", "in full") if w in ways) or "(nothing)"
    return wire, sum(t.nbytes for t in transfers), None, checked


def _apply_one(ctx: TransportContext, t, s: _Stream, head: list[int], payload: torch.Tensor,
               incremental: bool) -> str:
    """Apply one transfer's delta and verify its copies' checksums; returns how they were computed."""
    kind, count = head[2], head[3]
    ncopies = len(s.copies)
    want = payload.narrow(0, 0, 8 * ncopies).view(torch.int64).cpu().tolist()
    blob = payload.narrow(0, 8 * ncopies, payload.numel() - 8 * ncopies)
    units, live = _units(s, ctx, "dst")
    if live:
        ctx.touched = True  # the live bytes change from here on
    known, s.verified = (s.verified if incremental else None), None  # trusted again only once verified
    got, updated = apply_update(units, kind, count, blob, s.segments, known)
    got = [_signed(c) for c in got]
    names = ctx.plan.body.tensor_names
    for c, a, b in zip(s.copies, got, want):
        if a != b:
            # The base these bytes grew from is not the trainers' (or the delta was
            # damaged): whatever this rank holds is suspect, so it must not be served
            # (torn) until a full refit commits.
            ctx.touched = True
            raise ProtocolError(f"delta checksum mismatch in {names[c.dst_tensor]!r} from train rank {t.src}: "
                                f"the bytes after the delta are not the trainer's", rank=ctx.rank,
                                transport="nccl_reshard", param=names[c.dst_tensor])
    s.verified = [c & _M64 for c in got]
    if not live:
        ctx.touched = True
        unpack(ctx.plan, s.copies, units.view(torch.uint8), ctx.params)
    return "incrementally" if updated else "in full"
