"""The reference colocated refit protocol, as NeMo RL publishes it (our own code).

Per refit the trainer allocates two ping-pong buffers, packs parameters into them
bucket by bucket (copy 1), exports each buffer's IPC handle (CUDA IPC / a fresh
shared-memory file on CPU) and sends it with the bucket's tensor list over a REQ
socket; the rollout opens the handle, copies each tensor out into its weights
(copy 2), synchronizes and answers on REP. REQ/REP allows one bucket in flight:
the trainer packs bucket i+1 into the other buffer while the rollout unpacks
bucket i, then waits for the ack. Nothing persists across refits: buffers and
handles are new every time (that is the cost being compared).

Messages are msgspec structs here (NeMo RL sends pickled Python objects); the
difference is microseconds per bucket and it keeps pickle off our sockets.
``policyworker.cli.zmq_bench`` runs this in the same process pair as the zmq transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import msgspec
import torch
import zmq

from policyworker.config import torch_dtype
from policyworker.transports.ipc_handles import export_storage, open_handle, share_cpu
from policyworker.transports.zmq.wire import StorageHandle

__all__ = ["baseline_rollout", "baseline_trainer", "buckets_of"]


class Entry(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


class Bucket(msgspec.Struct, frozen=True, tag=True):
    seq: int
    last: bool
    handle: StorageHandle
    entries: list[Entry]


class Ack(msgspec.Struct, frozen=True, tag=True):
    seq: int


_enc = msgspec.msgpack.Encoder()
_bucket_dec = msgspec.msgpack.Decoder(Bucket)
_ack_dec = msgspec.msgpack.Decoder(Ack)


def _socket(kind: int, endpoint: str, bind: bool, timeout_s: float) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(kind)
    for opt, val in ((zmq.LINGER, 0), (zmq.SNDTIMEO, int(timeout_s * 1000)), (zmq.RCVTIMEO, int(timeout_s * 1000))):
        s.setsockopt(opt, val)
    (s.bind if bind else s.connect)(endpoint)
    return ctx, s


def buckets_of(params: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out, cur, used = [], [], 0
    for name, t in params:
        n = t.numel() * t.element_size()
        if cur and used + n > bucket_bytes:
            out.append(cur)
            cur, used = [], 0
        cur.append((name, t))
        used += n
    if cur:
        out.append(cur)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """REQ side. ``refit()`` moves every parameter once; blocking (run it off the loop)."""

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]], endpoint: str, *, bucket_bytes: int,
                 timeout_s: float = 60.0) -> None:
        largest = max(t.numel() * t.element_size() for _, t in params)
        self.bucket_bytes = max(bucket_bytes, largest)
        self.params = list(params)
        self.device = self.params[0][1].device
        self.ctx, self.sock = _socket(zmq.REQ, endpoint, True, timeout_s)

    def refit(self) -> int:
        dev = self.device
        # Allocated (and on CPU moved to a fresh shm file) every refit, as the reference does.
        bufs = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
        if dev.type == "cpu":
            for b in bufs:
                share_cpu(b)
        handles = [export_storage(b, i) for i, b in enumerate(bufs)]
        buckets = buckets_of(self.params, self.bucket_bytes)
        moved = 0
        for seq, bucket in enumerate(buckets):
            buf, off, entries = bufs[seq % 2], 0, []
            for name, t in bucket:
                n = t.numel() * t.element_size()
                buf.narrow(0, off, n).copy_(t.detach().reshape(-1).view(torch.uint8))
                entries.append(Entry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off))
                off += n
            moved += off
            _sync(dev)
            if seq > 0:
                _ack_dec.decode(self.sock.recv())  # REQ: the previous bucket's ack first
            self.sock.send(_enc.encode(Bucket(seq=seq, last=seq == len(buckets) - 1, handle=handles[seq % 2],
                                              entries=entries)))
        _ack_dec.decode(self.sock.recv())
        return moved

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class Rollout:
    """REP side: ``write(name, flat_bytes)`` lands one tensor's bytes in the rollout's weights."""

    def __init__(self, write: Callable[[str, torch.Tensor], None], endpoint: str, *, device: torch.device,
                 timeout_s: float = 60.0) -> None:
        self.write, self.device = write, device
        self.ctx, self.sock = _socket(zmq.REP, endpoint, False, timeout_s)

    def refit(self) -> int:
        moved, opened = 0, {}
        while True:
            msg = _bucket_dec.decode(self.sock.recv())
            storage = opened.get(msg.handle.id)
            if storage is None:  # each buffer opened once per refit (new buffers every refit)
                storage = opened[msg.handle.id] = open_handle(msg.handle, self.device)
            for e in msg.entries:
                n = torch.Size(e.shape).numel() * torch.empty((), dtype=torch_dtype(e.dtype)).element_size()
                src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, e.offset, (n,))
                self.write(e.name, src)
                moved += n
            _sync(self.device)
            self.sock.send(_enc.encode(Ack(seq=msg.seq)))
            if msg.last:
                return moved

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def baseline_trainer(params, endpoint, *, bucket_bytes, timeout_s=60.0) -> Trainer:
    return Trainer(params, endpoint, bucket_bytes=bucket_bytes, timeout_s=timeout_s)


def baseline_rollout(write, endpoint, *, device, timeout_s=60.0) -> Rollout:
    return Rollout(write, endpoint, device=device, timeout_s=timeout_s)


def plan_writer(plan, rank: int, params: Mapping[str, torch.Tensor]) -> Callable[[str, torch.Tensor], None]:
    """``write`` for a rollout in the generation layout: each full source tensor's bytes
    go to its plan copies (fused targets included), like an engine's ``load_weights``."""
    from policyworker.layout.apply import _region

    names = plan.body.tensor_names
    src_specs = plan.local_tensors("src", 0)
    by_src: dict[str, list] = {}
    for t in plan.receives(rank):
        for c in t.copies:
            by_src.setdefault(names[c.src_tensor], []).append(c)

    def write(name: str, flat: torch.Tensor) -> None:
        spec = src_specs[name]
        full = flat.view(torch_dtype(spec.dtype)).view(spec.shape)
        for c in by_src.get(name, ()):
            _region(params[names[c.dst_tensor]], c.dst_at, c.start, c.stop).copy_(
                _region(full, c.src_at, c.start, c.stop), non_blocking=True)

    return write


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n
