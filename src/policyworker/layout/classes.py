"""Copy classes of a plan: each distinct ``(param, box)`` its copies move, with the
training ranks that send it (holders) and the generation ranks that receive it (needers).

The relay routes (:mod:`.topology`) visit every class once per node map, biggest
first, and the fabric model asks for those routes once per fabric. A MoE plan holds
a million copies, most of them inside runs, over a few hundred thousand classes that
share a few hundred ``(holders, needers)`` pairs: so the classes are found once per
plan with array operations over the expanded copies (never one Python object per
copy), and each class carries the index of its ``(holders, needers)`` pair, so that
a caller works out what a pair means on its nodes once per pair, not once per class.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import Any, TypeVar

import numpy as np

from policyworker.layout.plan import ReshardPlan, dtype_size

__all__ = ["CopyClasses", "copy_classes", "per_plan"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True, eq=False)
class CopyClasses:
    """A plan's classes as columns, biggest first (ties in ``(param, start, stop)`` order).

    Class ``i`` is box ``boxes[box[i]]`` of parameter ``param[i]``: ``nbytes[i]`` bytes,
    sent by the training ranks ``sets[set_of[i]][0]`` and received by the generation
    ranks ``sets[set_of[i]][1]`` (each sorted). ``nbytes_array`` and ``set_of_array``
    are ``nbytes`` and ``set_of`` as int64 arrays.
    """

    param: list[int]
    box: list[int]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
    nbytes: list[int]
    nbytes_array: np.ndarray
    set_of: list[int]
    set_of_array: np.ndarray
    sets: list[tuple[tuple[int, ...], tuple[int, ...]]]

    def __len__(self) -> int:
        return len(self.nbytes)

    def key(self, i: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """``(param, start, stop)`` of class ``i``."""
        start, stop = self.boxes[self.box[i]]
        return self.param[i], start, stop


_KEEP = 2


def per_plan(fn: Callable[[ReshardPlan], T]) -> Callable[[ReshardPlan], T]:
    """``fn(plan)`` cached for the last few plan objects (by identity: a plan's hash
    would cost an encoding of the whole plan). One plan is asked the same question
    once per fabric or node map; the answer is read-only to every caller."""
    cache: list[tuple[weakref.ref, T]] = []

    @functools.wraps(fn)
    def cached(plan: ReshardPlan) -> T:
        for ref, got in cache:
            if ref() is plan:
                return got
        got = fn(plan)
        cache.append((weakref.ref(plan), got))
        del cache[:-_KEEP]
        return got

    return cached


@per_plan
def copy_classes(plan: ReshardPlan) -> CopyClasses:
    """The classes of ``plan`` (cached for the last few plans; read-only to callers)."""
    return _find(plan)


def _find(plan: ReshardPlan) -> CopyClasses:
    body = plan.body
    box_ids: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    # One row per plain copy or per run block copy: (first param, param step, count,
    # box); the transfer's ranks per row via per-transfer row counts.
    first: list[int] = []
    step: list[int] = []
    count: list[int] = []
    box: list[int] = []
    rows_per_transfer: list[int] = []
    srcs: list[int] = []
    dsts: list[int] = []
    def add(copies: Any) -> None:
        for c in copies:
            b = (c.start, c.stop)
            bid = box_ids.get(b)
            if bid is None:
                bid = box_ids[b] = len(box_ids)
            first.append(c.param)
            box.append(bid)

    for t in body.transfers:
        before = len(first)
        add(t.copies)
        plain = len(first) - before
        step.extend([0] * plain)
        count.extend([1] * plain)
        for run in t.runs:
            add(run.block)
            step.extend([run.param_step] * len(run.block))
            count.extend([run.count] * len(run.block))
        rows_per_transfer.append(len(first) - before)
        srcs.append(t.src)
        dsts.append(t.dst)
    boxes = [(tuple(a), tuple(b)) for a, b in box_ids]
    if not first:
        return CopyClasses([], [], boxes, [], np.zeros(0, np.int64), [], np.zeros(0, np.int64), [])

    # Expand the runs: repetition r of a row is param first + r * step, same box.
    counts = np.asarray(count, np.int64)
    per_transfer = np.asarray(rows_per_transfer, np.int64)
    row_src = np.repeat(np.asarray(srcs, np.int64), per_transfer)
    row_dst = np.repeat(np.asarray(dsts, np.int64), per_transfer)
    offsets = np.cumsum(counts) - counts
    rep = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(offsets, counts)
    params = np.repeat(np.asarray(first, np.int64), counts) + np.repeat(np.asarray(step, np.int64), counts) * rep
    nbox = len(boxes)
    keys, cls = np.unique(params * nbox + np.repeat(np.asarray(box, np.int64), counts), return_inverse=True)
    cls_param, cls_box = keys // nbox, keys % nbox

    # Holders and needers of each class as bit masks; equal masks are one set.
    masks = np.concatenate([_mask(cls, len(keys), np.repeat(row_src, counts), body.train_world_size),
                            _mask(cls, len(keys), np.repeat(row_dst, counts), body.gen_world_size)], axis=1)
    uniq_masks, set_of = _distinct_rows(masks)
    words = -(-body.train_world_size // 64)
    sets = [(_ranks(m[:words]), _ranks(m[words:])) for m in uniq_masks]

    volumes = np.asarray([prod(b - a for a, b in zip(start, stop)) for start, stop in boxes], np.int64)
    sizes = np.zeros(len(body.params), np.int64)
    for p in np.unique(cls_param).tolist():
        sizes[p] = dtype_size(body.params[p].dtype)
    nbytes = volumes[cls_box] * sizes[cls_param]
    # Biggest first, then (param, start, stop): a box's rank in Python's tuple order
    # stands for (start, stop) (boxes of one param have one length, so this is the
    # order of the keys).
    box_rank = np.empty(nbox, np.int64)
    box_rank[sorted(range(nbox), key=boxes.__getitem__)] = np.arange(nbox, dtype=np.int64)
    order = np.lexsort((box_rank[cls_box], cls_param, -nbytes))
    nbytes, set_of = nbytes[order], set_of[order]
    return CopyClasses(param=cls_param[order].tolist(), box=cls_box[order].tolist(), boxes=boxes,
                       nbytes=nbytes.tolist(), nbytes_array=nbytes,
                       set_of=set_of.tolist(), set_of_array=set_of, sets=sets)


def _mask(cls: np.ndarray, n: int, ranks: np.ndarray, world: int) -> np.ndarray:
    out = np.zeros((n, -(-world // 64)), np.uint64)
    np.bitwise_or.at(out, (cls, ranks >> 6), np.left_shift(np.uint64(1), (ranks & 63).astype(np.uint64)))
    return out


def _distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of ``rows`` and each row's index among them (as np.unique's
    ``axis=0``, without sorting the rows as opaque bytes: a sort per column is faster)."""
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    new = np.ones(len(rows), bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    index = np.empty(len(rows), np.int64)
    index[order] = np.cumsum(new) - 1
    return ordered[new], index


def _ranks(words: np.ndarray) -> tuple[int, ...]:
    bits = int.from_bytes(words.astype("<u8").tobytes(), "little")
    return tuple(i for i in range(bits.bit_length()) if bits >> i & 1)
