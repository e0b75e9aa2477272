"""The delta handshake: every rank of the update group learns, in one short round,
whether this refit is a delta and over which version.

A rank says a *row*: ``[magic, role, version or base, shadow version, want, changed ppm]``
— a trainer the version it sends, the version its shadow holds, whether it wants a
delta (else why not) and its estimated changed fraction; a receiver its base (the
version it holds untorn, else -1). The decision needs only extremes of those fields
(do all trainers want a delta, do they agree on one version and one shadow, does every
receiver hold that shadow), so each rank turns its row into a vector of maxima and
negated minima (:func:`contribution`), the vectors' element-wise maximum is the
summary, and every rank decides the same from it (:func:`decide_reduced`).

The maximum is taken in a star over the update group: every rank sends its vector to
rank 0, which reduces them and answers each rank with the summary (two hops, each
posted at once). Not an all-reduce: on gloo among 8 processes that walks a ring of
messages, and each rank's gloo thread spent ~2 ms of CPU per handshake on it (measured
on a 2-core host); the star costs a non-zero rank two messages.
"""

from __future__ import annotations

import torch

from policyworker.errors import PeerLost, ProtocolError

__all__ = ["contribution", "decide", "decide_reduced", "handshake"]

_HS_MAGIC = 0x5057444C54413031  # "PWDLTA01"
_TRAINER, _RECEIVER = 0, 1
# Why a trainer wants a full refit (the row's "want" field).
_WANT_DELTA, _OFF, _NO_SHADOW, _EVERY, _TOO_MANY = 1, 0, 2, 3, 4
_REASONS = {_OFF: "a trainer asked for a full refit", _NO_SHADOW: "a trainer has no shadow of the last version",
            _EVERY: "a full refit is due (delta_full_every)", _TOO_MANY: "too many elements changed"}
_NONE = -(1 << 62)  # a field a rank of the other role does not fill
# Vector fields: magic, -magic, any trainer, max/-min trainer version, max/-min shadow,
# refusal (0: wants a delta, else 1 + the want code), max ppm, max/-min receiver base.
_LEN = 11
# Point-to-point tags of the star (the delta bulk uses (1 << 21) and (1 << 21) + 1).
_TAG_ROW, _TAG_SUMMARY = (1 << 21) + 2, (1 << 21) + 3


def contribution(row: list[int]) -> list[int]:
    """A rank's row as the vector that a ``MAX`` all-reduce combines."""
    magic, role, version, shadow, want, ppm = row
    if magic != _HS_MAGIC or role not in (_TRAINER, _RECEIVER):
        raise ProtocolError("malformed delta handshake row")
    vec = [magic, -magic] + [_NONE] * (_LEN - 2)
    if role == _TRAINER:
        vec[2:9] = [1, version, -version, shadow, -shadow, 0 if want == _WANT_DELTA else 1 + want, ppm]
    else:
        vec[9:11] = [version, -version]
    return vec


def decide_reduced(vec: list[int]) -> tuple[bool, str, int]:
    """(delta?, why, the trainers' version) from the reduced vector; the same on every rank."""
    if vec[0] != _HS_MAGIC or -vec[1] != _HS_MAGIC:
        raise ProtocolError("malformed delta handshake: ranks speak different protocols")
    if vec[2] != 1:
        raise ProtocolError("delta handshake: no trainer in the update group")
    v_max, v_min, s_max, s_min, refusal = vec[3], -vec[4], vec[5], -vec[6], vec[7]
    if refusal:
        return False, _REASONS.get(refusal - 1, "a trainer wants a full refit"), v_max
    if v_max != v_min or s_max != s_min:
        return False, "the trainers' shadows or versions differ", v_max
    if v_max <= s_max:
        return False, f"version {v_max} does not advance the shadow's {s_max}", v_max
    b_max, b_min = vec[9], -vec[10]
    if b_max != _NONE:  # some receiver said its base
        for b in (b_min, b_max):
            if b != s_max:
                return False, f"a receiver holds version {b}, not the trainers' base {s_max}", v_max
    return True, f"delta over version {s_max}", v_max


def decide(rows: list[list[int]]) -> tuple[bool, str]:
    """(delta?, why) from every rank's row (what the all-reduce computes, in one process)."""
    vecs = [contribution(r) for r in rows]
    return decide_reduced([max(col) for col in zip(*vecs)])[:2]


def handshake(group, row: list[int], deadline: float) -> tuple[bool, str, int]:
    """Run the handshake on ``group`` (every rank calls it): (delta?, why, the trainers' version).

    ``PeerLost`` on every live rank when one rank cannot be reached (rank 0 still
    answers the others, saying so); deadlines and aborts as for any group wait.
    """
    dev = group.device
    mine = torch.tensor(contribution(row), dtype=torch.int64)
    peers = list(range(1, group.world_size))
    if group.rank == 0:
        inbox = torch.zeros((max(1, len(peers)), _LEN), dtype=torch.int64, device=dev)
        works = group.batch_isend_irecv([("recv", inbox[i], p, _TAG_ROW) for i, p in enumerate(peers)])
        reached = []
        for i, work in enumerate(works):
            try:
                group.wait(work, deadline=deadline, what="delta handshake gather")
            except PeerLost:
                continue
            reached.append(i)
        vec = mine
        if reached:
            rows = group.read(inbox, deadline=deadline, what="delta handshake gather")
            vec = torch.maximum(mine, rows[reached].amax(0).cpu())
        lost = len(peers) - len(reached)
        answer = torch.cat([torch.tensor([lost], dtype=torch.int64), vec]).to(dev)
        sent = group.batch_isend_irecv([("send", answer, peers[i], _TAG_SUMMARY) for i in reached])
        for work in sent:
            try:
                group.wait(work, deadline=deadline, what="delta handshake answer")
            except PeerLost:
                pass  # gone since it sent its row: its own error tells it
        summary = [lost, *vec.tolist()]
    else:
        answer = torch.zeros(_LEN + 1, dtype=torch.int64, device=dev)
        sent, received = group.batch_isend_irecv([("send", mine.to(dev), 0, _TAG_ROW),
                                                  ("recv", answer, 0, _TAG_SUMMARY)])
        group.wait(received, deadline=deadline, what="delta handshake answer")
        group.wait(sent, deadline=deadline, what="delta handshake gather")
        summary = group.read(answer, deadline=deadline, what="delta handshake answer").tolist()
    if summary[0]:
        raise PeerLost(f"delta handshake: {summary[0]} rank(s) of group {group.name!r} could not be reached",
                       rank=group.rank)
    return decide_reduced(summary[1:])
