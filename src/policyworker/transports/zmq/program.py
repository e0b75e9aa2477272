"""The rollout's copy program of a zmq refit, and the GPU wait both sides use.

A program is built once per epoch (the trainer's exported sources, the staging ring,
the bucket size) and run on every refit of it: views of the trainer's mapped storages,
the plan's copies out of them coalesced into few runs, the destination format's launch
for the copies it converts (:mod:`..layout.formats`: a `PullLaunch`), the staged
buckets' copies, and the ring's views. :meth:`CopyProgram.issue` issues its copies and
its launch on the current stream (or the launch on its side stream, until it is a
captured graph); the transport (:mod:`.zmq_ipc`) does the messages around it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policyworker.errors import ProtocolError
from policyworker.layout.apply import _region, bucket_copies
from policyworker.layout.plan import ReshardPlan
from policyworker.transports.zmq import wire as w
from policyworker.transports.ipc_handles import source_view
from policyworker.transports.zmq.channel import Channel

__all__ = ["CopyProgram", "coalesce", "compile_program", "signature", "staged_buckets"]


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
            from policyworker.errors import RefitTimeout

            raise RefitTimeout("the GPU did not finish the refit's copies before the deadline", transport="zmq")
        time.sleep(_FAST_SLEEP_S if now < fast_until else _SLEEP_S)


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


def signature(offer: w.Offer) -> tuple:
    """What a copy program depends on besides the handles: the sources' epoch and the ring."""
    return (offer.epoch, tuple(offer.ring), offer.bucket_bytes)


def staged_buckets(plan: ReshardPlan, rank: int, staged_names: set[str], bucket_bytes: int) -> list:
    """The plan's copies to rollout ``rank`` from sources that travel staged, in buckets."""
    names = plan.body.tensor_names
    copies = [c for t in plan.receives(rank) for c in t.all_copies() if names[c.src_tensor] in staged_names]
    return bucket_copies(plan, copies, bucket_bytes) if copies else []


Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class CopyProgram:
    """One epoch's copies on the rollout (see the module docstring); ``runs``: what torch
    copies (the coalesced plain copies the format's launch does not take)."""

    signature: tuple
    runs: list[Pair]
    buckets: list
    ring: list[torch.Tensor]
    launch: Any  # layout.formats.PullLaunch
    device: torch.device
    _side: bool = False  # the last issue launched on the format's side stream
    dst_key: tuple = ()  # which destination tensors it writes (a double-buffered rollout alternates two)

    @property
    def ncopies(self) -> int:
        return len(self.runs) + len(self.buckets) + len(self.launch)

    def issue(self, times: dict[str, float]) -> int:
        """Issue torch's copies and the format's launch; the bytes they write (the buckets'
        come later, with their messages). ``times`` gets the ``copies_issued`` and
        ``launch_issued`` stamps."""
        nbytes = 0
        launch = self.launch
        # The launch (block quantization's: one fused read of each quantized source) takes
        # the plain copies it can as its copy tiles (`runs`: what is left, for torch). Until it
        # is a captured graph it runs on its own side stream, fenced after our stream's
        # earlier work, with torch's copies issued first (a kernel that keeps every SM
        # busy to its end would otherwise leave them queued behind it). From its second
        # refit on the graph is replayed on our own stream right after torch's copies
        # (the big ones: the launch keeps every SM busy, so nothing overlapped anyway):
        # no fence, no stream switch, no join (~0.1 ms of host per refit).
        self._side = not launch.replays
        if self._side:
            launch.fence()
        for src, dst in self.runs:
            dst.copy_(src, non_blocking=True)
            nbytes += dst.numel() * dst.element_size()
        times["copies_issued"] = time.perf_counter()
        nbytes += launch.run(join=False, fenced=True) if self._side else launch.run_inline()
        times["launch_issued"] = time.perf_counter()
        return nbytes

    def join(self) -> None:
        """Order our stream after the launch's side stream, if the last issue used it (an
        event, no device-wide sync: a wait on our stream then covers the launch)."""
        if self._side:
            self.launch.join(self.device)


def compile_program(plan: ReshardPlan, rank: int, device: torch.device, params: Mapping[str, torch.Tensor],
                    offer: w.Offer, sources: list[w.SourceRef],
                    opened: Mapping[int, torch.UntypedStorage]) -> CopyProgram:
    """The copy program of ``offer``'s epoch for rollout ``rank`` into ``params``;
    ``ProtocolError`` when the Offer's sources or ring disagree with the plan."""
    names = plan.body.tensor_names
    want = plan.local_tensors("src", 0)
    refs = {r.name: r for r in sources}
    if set(refs) != set(want):
        raise ProtocolError("the Offer's sources are not the plan's source tensors", rank=rank, transport="zmq")
    views, staged = {}, set()
    for name, ref in refs.items():
        if tuple(ref.shape) != tuple(want[name].shape) or ref.dtype != want[name].dtype:
            raise ProtocolError(f"source {name!r} is {ref.dtype}{list(ref.shape)}, the plan says "
                                f"{want[name].dtype}{list(want[name].shape)}", rank=rank, param=name)
        if ref.handle < 0:
            staged.add(name)
        elif ref.handle not in opened:
            raise ProtocolError(f"source {name!r} names handle {ref.handle}, never sent", rank=rank,
                                transport="zmq")
        else:
            views[name] = source_view(opened[ref.handle], ref, device)
    fmt = plan.dest_format
    pairs, jobs = [], []
    for t in plan.receives(rank):
        for c in t.all_copies():
            src_name = names[c.src_tensor]
            if src_name in staged:
                continue
            if fmt.converts(plan, c):  # converted as it is pulled, by the format's launch
                jobs.append(fmt.pull_job(plan, c, views[src_name], params))
                continue
            dst = _region(params[names[c.dst_tensor]], c.dst_at, c.start, c.stop)
            pairs.append((_region(views[src_name], c.src_at, c.start, c.stop), dst))
    buckets = staged_buckets(plan, rank, staged, offer.bucket_bytes)
    ring = []
    for hid in offer.ring:
        if hid not in opened:
            raise ProtocolError(f"ring handle {hid} was never sent", rank=rank, transport="zmq")
        s = opened[hid]
        ring.append(_u8(s, 0, s.nbytes(), device))
    # The plain copies may ride in the format's launch (block quantization on CUDA: copy tiles of
    # one persistent kernel, no launch per copy); torch copies what it leaves (all of
    # them when nothing is converted, or on CPU).
    launch = fmt.pull_launch(plan, jobs, coalesce(pairs))
    return CopyProgram(signature(offer), launch.copies_left, buckets, ring, launch, device)
