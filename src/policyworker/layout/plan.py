"""`ReshardPlan`: which bytes each training rank sends to each generation rank.

The plan is data: msgspec Structs with a canonical msgpack encoding whose sha256 is
the plan's hash. Every rank computes the plan itself and compares hashes at connect
time (a mismatch is `PlanMismatch` at init, never a wrong refit).

Contracts (what :mod:`.planner` guarantees; :meth:`ReshardPlan.validate` re-checks
them from the plan alone):

* every byte of every destination local tensor is written by exactly one copy;
* a copy's source box lies inside one source piece and its destination box inside
  one destination piece, so ``local.narrow(d, at[d], stop[d] - start[d])`` per dim
  is the copy's view on either side;
* a transfer's message is its copies' bytes, in order, back to back, no padding:
  ``bytes_for(stage, src, dst)`` of them.

The plan carries its destination format (``dest_format``, :mod:`.formats`): how a
copy's bytes land. The plain format moves them as they are; another one converts the
copies into the tensors it fills and says how many bytes each takes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from functools import cached_property
from math import prod
from typing import Any

import msgspec

from policyworker.errors import PlanError
from policyworker.layout.boxes import Layout, LocalSpec, Piece
from policyworker.layout.formats import PLAIN, AnyFormat
from policyworker.layout.parallelism import Parallelism

__all__ = ["Copy", "CopyRun", "LocalTensor", "ParamInfo", "PlanBody", "ReshardPlan", "Transfer",
           "WirePiece", "dtype_size"]

PLAN_FORMAT = 3  # 2: Transfer.runs; 3: PlanBody.dest_format

_DTYPE_SIZES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8,
                "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
                "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_size(dtype: str) -> int:
    try:
        return _DTYPE_SIZES[dtype]
    except KeyError:
        raise PlanError(f"unsupported dtype {dtype!r}") from None


class ParamInfo(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A global (unsharded) parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class WirePiece(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """``params[param][start:stop]`` sits at ``at`` in its local tensor."""

    param: int
    start: tuple[int, ...]
    stop: tuple[int, ...]
    at: tuple[int, ...]


class LocalTensor(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One local tensor of one rank (an ordinary shard, or a fused tensor)."""

    rank: int
    name: int                    # index into PlanBody.tensor_names
    shape: tuple[int, ...]
    dtype: str
    pieces: list[WirePiece]


class Copy(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Box ``[start, stop)`` of ``params[param]``, from ``src_tensor`` at ``src_at`` to
    ``dst_tensor`` at ``dst_at`` (tensor indices into PlanBody.tensor_names)."""

    param: int
    start: tuple[int, ...]
    stop: tuple[int, ...]
    src_tensor: int
    src_at: tuple[int, ...]
    dst_tensor: int
    dst_at: tuple[int, ...]


class CopyRun(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """``count`` repetitions of ``block`` over an indexed family of parameters (experts).

    Repetition ``r`` of block copy ``j`` is that copy with ``param + r * param_step``,
    ``src_tensor + r * src_steps[j]`` and ``dst_tensor + r * dst_steps[j]``; boxes and
    offsets are unchanged. Expanded order: repetition 0's block, then repetition 1's, ...
    """

    block: list[Copy]
    count: int
    param_step: int
    src_steps: list[int]
    dst_steps: list[int]

    def expand(self) -> list[Copy]:
        out = []
        ps = self.param_step
        steps = list(zip(self.block, self.src_steps, self.dst_steps))
        for r in range(self.count):
            for c, s, d in steps:
                out.append(Copy(c.param + r * ps, c.start, c.stop, c.src_tensor + r * s,
                                c.src_at, c.dst_tensor + r * d, c.dst_at))
        return out

    @property
    def num_copies(self) -> int:
        return self.count * len(self.block)


class Transfer(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """All copies from training rank ``src`` to generation rank ``dst`` in one stage.

    The message is ``copies`` followed by each of ``runs`` expanded (`all_copies`): the
    planner writes a family of identically placed parameters (a layer's experts) as
    one `CopyRun` per pair instead of one `Copy` per parameter, so a plan grows with
    (src, dst) pairs and layers rather than with experts.
    """

    stage: int
    src: int
    dst: int
    nbytes: int
    copies: list[Copy]
    runs: list[CopyRun] = msgspec.field(default_factory=list)

    def all_copies(self) -> list[Copy]:
        """Every copy of the message, in message order."""
        if not self.runs:
            return self.copies
        out = list(self.copies)
        for run in self.runs:
            out.extend(run.expand())
        return out

    @property
    def num_copies(self) -> int:
        return len(self.copies) + sum(r.num_copies for r in self.runs)


class PlanBody(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the hash covers. Source ranks are training ranks, destination ranks
    generation ranks; layouts are ``None`` when a side was not described by rules."""

    format: int = PLAN_FORMAT
    train: dict[str, int] | None
    gen: dict[str, int] | None
    train_world_size: int
    gen_world_size: int
    gen_fused: bool
    params: list[ParamInfo]
    tensor_names: list[str]
    sources: list[LocalTensor]
    dests: list[LocalTensor]
    transfers: list[Transfer]
    #: How copies land in the destination tensors (tagged by name, with its parameters).
    dest_format: AnyFormat = PLAIN


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(PlanBody)


class ReshardPlan:
    """A computed plan plus indices over it. Build with :func:`.planner.build_plan`."""

    def __init__(self, body: PlanBody) -> None:
        self.body = body

    # -- identity and wire ---------------------------------------------------------
    def to_wire(self) -> bytes:
        """Canonical msgpack bytes; ``from_wire(to_wire())`` is an exact round trip."""
        return self._wire

    @cached_property
    def _wire(self) -> bytes:
        return _ENCODER.encode(self.body)

    @classmethod
    def from_wire(cls, data: bytes) -> ReshardPlan:
        try:
            body = _DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise PlanError(f"not a reshard plan: {exc}") from exc
        if body.format != PLAN_FORMAT:
            raise PlanError(f"plan format {body.format} is not {PLAN_FORMAT}")
        return cls(body)

    @cached_property
    def hash(self) -> str:
        """sha256 (hex) of the canonical encoding."""
        return hashlib.sha256(self._wire).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """Plain wire-safe builtins (structs as lists, see the Struct field orders)."""
        return msgspec.to_builtins(self.body)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReshardPlan:
        try:
            return cls(msgspec.convert(data, PlanBody))
        except msgspec.ValidationError as exc:
            raise PlanError(f"not a reshard plan: {exc}") from exc

    def refit_info(self) -> dict[str, Any]:
        """What ``prepare_nccl_reshard_refit_info`` returns: `to_dict` plus ``hash``.

        Identical on every rank that built the plan from the same inputs.
        """
        info = self.to_dict()
        info["hash"] = self.hash
        return info

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReshardPlan) and self.hash == other.hash

    def __hash__(self) -> int:
        return hash(self.hash)

    def __repr__(self) -> str:
        b = self.body
        return (f"ReshardPlan(train={b.train}, gen={b.gen}, params={len(b.params)}, "
                f"transfers={len(b.transfers)}, total_bytes={self.total_bytes}, "
                f"hash={self.hash[:12]})")

    # -- lookups -------------------------------------------------------------------
    @property
    def dest_format(self) -> AnyFormat:
        """The destination format (:mod:`.formats`): the generic code asks it about each copy."""
        return self.body.dest_format

    @property
    def params(self) -> list[ParamInfo]:
        return self.body.params

    @property
    def transfers(self) -> list[Transfer]:
        return self.body.transfers

    @property
    def stages(self) -> list[int]:
        return sorted({t.stage for t in self.body.transfers})

    def tensor_name(self, index: int) -> str:
        return self.body.tensor_names[index]

    @cached_property
    def _by_pair(self) -> dict[tuple[int, int, int], Transfer]:
        return {(t.stage, t.src, t.dst): t for t in self.body.transfers}

    def transfer(self, stage: int, src: int, dst: int) -> Transfer | None:
        return self._by_pair.get((stage, src, dst))

    def sends(self, src: int) -> list[Transfer]:
        """Transfers out of training rank ``src``, in plan order."""
        return [t for t in self.body.transfers if t.src == src]

    def receives(self, dst: int) -> list[Transfer]:
        """Transfers into generation rank ``dst``, in plan order."""
        return [t for t in self.body.transfers if t.dst == dst]

    def copies(self, stage: int, src: int, dst: int) -> list[Copy]:
        t = self.transfer(stage, src, dst)
        return [] if t is None else t.all_copies()

    def bytes_for(self, stage: int, src: int, dst: int) -> int:
        t = self.transfer(stage, src, dst)
        return 0 if t is None else t.nbytes

    def local_tensors(self, side: str, rank: int) -> dict[str, LocalTensor]:
        """``{local_name: LocalTensor}`` of ``rank`` on ``side`` ("src" or "dst")."""
        return self._locals(side).get(rank, {})

    def _locals(self, side: str) -> dict[int, dict[str, LocalTensor]]:
        if side not in ("src", "dst"):
            raise PlanError(f"side must be 'src' or 'dst', got {side!r}")
        return self._src_locals if side == "src" else self._dst_locals

    @cached_property
    def _src_locals(self) -> dict[int, dict[str, LocalTensor]]:
        return self._index(self.body.sources)

    @cached_property
    def _dst_locals(self) -> dict[int, dict[str, LocalTensor]]:
        return self._index(self.body.dests)

    def _index(self, tensors: list[LocalTensor]) -> dict[int, dict[str, LocalTensor]]:
        out: dict[int, dict[str, LocalTensor]] = {}
        names = self.body.tensor_names
        for t in tensors:
            out.setdefault(t.rank, {})[names[t.name]] = t
        return out

    def layout(self, side: str) -> Layout:
        """The side's `Layout` rebuilt from the plan (pieces and local shapes)."""
        names, params = self.body.tensor_names, self.body.params
        world = self.body.train_world_size if side == "src" else self.body.gen_world_size
        stages: tuple[int, ...] = (0,) * world
        if side == "src" and self.body.train is not None:
            par = Parallelism(**self.body.train)
            stages = tuple(par.coords(r).pp_stage for r in range(world))
        pieces: dict[str, list[Piece]] = {}
        tensors: dict[int, dict[str, LocalSpec]] = {r: {} for r in range(world)}
        for t in (self.body.sources if side == "src" else self.body.dests):
            tensors[t.rank][names[t.name]] = LocalSpec(t.shape, t.dtype)
            for p in t.pieces:
                pieces.setdefault(params[p.param].name, []).append(
                    Piece(t.rank, names[t.name], p.start, p.stop, p.at))
        return Layout(world_size=world, stage_of_rank=stages, pieces=pieces, tensors=tensors)

    def validate(self) -> None:
        """Check the plan's internal contracts; PlanError naming the first violation.

        Checks that each copy's boxes lie inside its parameter, its source piece's
        tensor and its destination tensor (on the transfer's ranks), that the
        transfers' byte counts add up, that each destination tensor receives exactly
        its size in elements, and that each transfer's stage is its source's stage.
        Together with the planner's disjoint-tiling check this means every
        destination byte is written exactly once. Linear in copies (runs expanded).
        """
        params = self.body.params
        stage_of = None
        if self.body.train is not None:
            par = Parallelism(**self.body.train)
            stage_of = [par.coords(r).pp_stage for r in range(par.world_size)]
        src_locals, dst_locals = self._src_locals, self._dst_locals
        names = self.body.tensor_names
        fmt = self.body.dest_format
        received: dict[tuple[int, int], int] = {}
        for t in self.body.transfers:
            if stage_of is not None and stage_of[t.src] != t.stage:
                raise PlanError(f"transfer {t.src}->{t.dst} is in stage {t.stage}, its "
                                f"source in stage {stage_of[t.src]}", rank=t.src)
            total = 0
            for c in t.all_copies():
                p = params[c.param]
                ext = [b - a for a, b in zip(c.start, c.stop)]
                if len(ext) != len(p.shape) or any(e <= 0 for e in ext) or any(
                        a < 0 or b > s for a, b, s in zip(c.start, c.stop, p.shape)):
                    raise PlanError(f"copy box {c.start}..{c.stop} outside {p.name!r} "
                                    f"{p.shape}", param=p.name)
                for side, rank, tensor, at, local in (
                        ("source", t.src, c.src_tensor, c.src_at, src_locals),
                        ("destination", t.dst, c.dst_tensor, c.dst_at, dst_locals)):
                    lt = local.get(rank, {}).get(names[tensor])
                    want = p.dtype if side == "source" or lt is None else fmt.dest_dtype(lt.dtype, p.dtype)
                    if lt is None or lt.dtype != want or any(
                            a < 0 or a + e > s for a, e, s in zip(at, ext, lt.shape)):
                        raise PlanError(f"copy of {p.name!r} does not fit {side} tensor "
                                        f"{names[tensor]!r} of rank {rank}", rank=rank,
                                        param=p.name)
                vol = prod(ext)
                if fmt.converts(self, c):
                    total += fmt.box_nbytes(c.start, c.stop, p.dtype)
                else:
                    total += vol * dtype_size(p.dtype)
                key = (t.dst, c.dst_tensor)
                received[key] = received.get(key, 0) + vol
            if total != t.nbytes:
                raise PlanError(f"transfer {t.src}->{t.dst} declares {t.nbytes} bytes, its "
                                f"copies hold {total}", rank=t.src)
        for lt in self.body.dests:
            got = received.get((lt.rank, lt.name), 0)
            if got != prod(lt.shape):
                raise PlanError(f"destination tensor {names[lt.name]!r} of rank {lt.rank} "
                                f"receives {got} of {prod(lt.shape)} elements", rank=lt.rank,
                                param=names[lt.name])

    # -- byte accounting -----------------------------------------------------------
    @cached_property
    def total_bytes(self) -> int:
        """Bytes the plan moves (all transfers)."""
        return sum(t.nbytes for t in self.body.transfers)

    @cached_property
    def min_bytes(self) -> int:
        """Bytes of all destination local tensors (the format's extra tensors, such as
        block scales, included): the least any plan can move."""
        return (sum(prod(t.shape) * dtype_size(t.dtype) for t in self.body.dests)
                + self.body.dest_format.extra_bytes(self))

    @property
    def messages(self) -> int:
        """Number of (stage, src, dst) transfers with at least one copy."""
        return len(self.body.transfers)

    @cached_property
    def num_copies(self) -> int:
        return sum(t.num_copies for t in self.body.transfers)

    def recv_bytes_per_dst_rank(self) -> dict[int, int]:
        out = dict.fromkeys(range(self.body.gen_world_size), 0)
        for t in self.body.transfers:
            out[t.dst] += t.nbytes
        return out

    def send_bytes_per_src_rank(self) -> dict[int, int]:
        out = dict.fromkeys(range(self.body.train_world_size), 0)
        for t in self.body.transfers:
            out[t.src] += t.nbytes
        return out

    def iter_copies(self) -> Iterator[tuple[Transfer, Copy]]:
        for t in self.body.transfers:
            for c in t.all_copies():
                yield t, c
