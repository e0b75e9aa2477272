"""The verdict round of ``nccl_reshard``: after the bulk, every rank learns every rank's outcome.

Over the update group (``model_update_group``), as point-to-point messages in a
star: every rank sends its verdict to rank 0, which answers each with (failures,
version, kv-scales length, lost peers) with the kv-scales inline (msgpack bytes,
never pickle; a fixed-size answer, so one receive gets both). Each hop's messages are posted at once (one ``batch_isend_irecv``), so the
round costs two hops' latency, not one per rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import torch

from policyworker.errors import PeerLost

__all__ = ["KvScales", "exchange_leftovers"]


class KvScales(msgspec.Struct, frozen=True):
    """FP8 KV-cache scales sent after the bulk: name → float."""

    scales: dict[str, float]


_KV_DECODER = msgspec.msgpack.Decoder(KvScales)


_TAG_VERDICT, _TAG_OUTCOME, _TAG_SCALES = 1 << 20, (1 << 20) + 1, (1 << 20) + 2
# The answer is a fixed-size message: the 4-int64 outcome, then kv scales of up to this
# many bytes inline — so a receiver posts one receive and learns the outcome and the
# scales in the same hop (larger scales follow as their own message, one more hop).
_INLINE_BYTES = 4096
_ANSWER_BYTES = 32 + _INLINE_BYTES


def exchange_leftovers(group, *, is_source: bool, kv_scales: Mapping[str, float] | None, deadline: float,
                       version: int, ok: bool, lost: bool = False) -> tuple[dict[str, float] | None, int, int, int]:
    """Gather every rank's verdict on rank 0; rank 0 answers (failures, version, scales, lost).

    Every rank of the update group calls it; rank 0 (a trainer, ``is_source``)
    contributes the version and the kv scales. A star of point-to-point messages:
    two hops, about half the latency of an all-reduce among 4–8 processes (measured
    on gloo). Rank 0 counts a peer it cannot reach as a failed and lost one and still
    answers the others, so a dead process is known to every live rank at once; a rank
    that cannot reach rank 0 raises ``PeerLost``. Returns (kv_scales, version,
    failures, lost).
    """
    dev = group.device
    mine = torch.tensor([0 if ok else 1, version if is_source else 0, 0, int(lost)], dtype=torch.int64)
    payload = b""
    if group.rank == 0:
        if is_source and kv_scales is not None:
            payload = msgspec.msgpack.encode(KvScales(dict(kv_scales)))
            mine[2] = len(payload) + 1  # +1 so that {} still arrives as {}
        outcome = mine.clone()
        reachable = []
        peers = list(range(1, group.world_size))
        # Every verdict's receive is posted at once, every answer's send too: one hop's
        # latency each, not one per peer.
        inboxes = torch.zeros((max(1, len(peers)), 4), dtype=torch.int64, device=dev)
        works = group.batch_isend_irecv([("recv", inboxes[i], p, _TAG_VERDICT) for i, p in enumerate(peers)])
        got = []
        for i, (peer, work) in enumerate(zip(peers, works)):
            try:
                group.wait(work, deadline=deadline, what="verdict gather")
            except PeerLost:
                outcome[0] += 1
                outcome[3] += 1
                continue
            got.append(i)
            reachable.append(peer)
        if got:
            rows = group.read(inboxes, deadline=deadline, what="verdict gather")
            for i in got:
                outcome[0] += rows[i][0]
                outcome[3] += rows[i][3]
        inline = len(payload) <= _INLINE_BYTES
        row = bytearray(_ANSWER_BYTES)
        row[:32] = outcome.numpy().tobytes()
        if inline:
            row[32:32 + len(payload)] = payload
        answer = torch.frombuffer(row, dtype=torch.uint8).to(dev)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev) if payload and not inline else None
        ops = [("send", answer, p, _TAG_OUTCOME) for p in reachable]
        ops += [("send", buf, p, _TAG_SCALES) for p in reachable] if buf is not None else []
        owners = reachable + (reachable if buf is not None else [])
        gone = set()
        for peer, work in zip(owners, group.batch_isend_irecv(ops)):
            try:
                group.wait(work, deadline=deadline, what="verdict answer")
            except PeerLost:
                gone.add(peer)  # gone since it answered: its own error tells it
        outcome[3] += len(gone)
    else:
        answer = torch.zeros(_ANSWER_BYTES, dtype=torch.uint8, device=dev)
        sent, received = group.batch_isend_irecv([("send", mine.to(dev), 0, _TAG_VERDICT),
                                                  ("recv", answer, 0, _TAG_OUTCOME)])
        group.wait(received, deadline=deadline, what="verdict answer")
        group.wait(sent, deadline=deadline, what="verdict gather")
        row = group.read(answer, deadline=deadline, what="verdict answer")
        outcome = row[:32].view(torch.int64)
    failures, version, length, lost_count = (int(x) for x in outcome.tolist())
    scales = None
    if length:
        if group.rank == 0:
            scales = dict(kv_scales) if kv_scales is not None else {}
        elif length - 1 <= _INLINE_BYTES:
            scales = _KV_DECODER.decode(bytes(row[32:32 + length - 1].numpy())).scales
        else:
            buf = torch.empty(length - 1, dtype=torch.uint8, device=dev)
            group.wait(group.irecv(buf, 0, _TAG_SCALES), deadline=deadline, what="kv scales")
            host = group.read(buf, deadline=deadline, what="kv scales")
            scales = _KV_DECODER.decode(bytes(host.numpy())).scales
    return scales, version, failures, lost_count
