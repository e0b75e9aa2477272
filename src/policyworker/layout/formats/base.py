"""The destination-format contract: how a copy's bytes land in a generation tensor.

A `ReshardPlan` carries one `DestFormat` (``plan.dest_format``). The generic code —
the planner, `pack` / `unpack`, bucketing, the transports — asks it about each copy
and never knows which format it holds:

* ``converts(plan, copy)`` is False for a copy whose wire bytes are its source box's
  bytes, unchanged (the plain case: the generic code packs, unpacks, bucket-cuts and
  moves those itself, straight from or into the tensors where it can);
* for a copy it converts, the format says how many wire bytes the box takes
  (``box_nbytes``), where a bucket may cut it (``split_copy``), how the sender writes
  it (``pack_copy``) and how the receiver lands it (``unpack_copy``), and how a
  colocated pull does both at once (``pull_job`` / ``pull_launch``);
* a format may give a generation rank tensors besides the plan's (``extra_tensors``,
  e.g. block scales) and counts their bytes in the plan's minimum (``extra_bytes``).

Formats are frozen msgspec Structs tagged by name, so the plan's wire form carries
the format as ``{"name": ..., <parameters>}`` and its hash covers it. Methods that
need per-plan indices cache them per plan (weakly); none keeps other state.

A `FormatTarget` is the planning input that picks a format: which destination
tensors it takes (it retypes them in the generation layout and checks both layouts
can carry it) and the `DestFormat` the plan then carries.

:mod:`policyworker.layout.formats` is the registry (the tagged union the plan decodes,
the generation-layout options such as ``fp8=block128``); ``docs/formats.md`` says how
to add a format.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from policyworker.layout.boxes import Layout

__all__ = ["DestFormat", "FormatTarget", "PullLaunch"]


class DestFormat(Protocol):
    """One destination format (see the module docstring). ``plan`` is a `ReshardPlan`
    that carries this format, ``copy`` one of its `Copy`s; the methods below the
    first three are only called for copies the format ``converts``."""

    #: Every copy's wire bytes are its source box's bytes: bytes may be forwarded or
    #: diffed as they are (relays, delta refits).
    passthrough: ClassVar[bool]
    #: The planner may write families of alike copies as `CopyRun`s.
    compressible: ClassVar[bool]

    # -- planning (layouts, before there is a plan) --------------------------------
    def converted_tensors(self, layout: Layout) -> frozenset[tuple[int, str]]:
        """``{(rank, tensor)}`` of the generation layout's tensors this format fills."""

    def box_nbytes(self, start: Sequence[int], stop: Sequence[int], param_dtype: str) -> int:
        """Wire bytes of a converted copy of box ``[start, stop)``."""

    def dest_dtype(self, local_dtype: str, param_dtype: str) -> str:
        """The dtype a destination local tensor must have to hold a parameter of
        ``param_dtype`` (``param_dtype`` for an unconverted one)."""

    # -- a plan's copies -------------------------------------------------------------
    def converts(self, plan: Any, copy: Any) -> bool:
        """Does ``copy`` land converted (False: its bytes travel as they are)?"""

    def split_copy(self, plan: Any, copy: Any, max_bytes: int) -> list[Any]:
        """``copy`` cut into parts of at most ``max_bytes`` wire bytes where the format
        allows (its indivisible unit may be bigger); parts in message order."""

    def pack_copy(self, plan: Any, copy: Any, local_tensors: Mapping[str, torch.Tensor], out: torch.Tensor,
                  offset: int) -> int:
        """Sender: write ``copy``'s wire bytes into flat uint8 ``out`` at ``offset``;
        returns the offset after its last byte."""

    def unpack_copy(self, plan: Any, copy: Any, buf: torch.Tensor,
                    local_tensors: MutableMapping[str, torch.Tensor], offset: int) -> int:
        """Receiver: land ``copy``'s wire bytes from ``buf`` at ``offset`` in the
        receiver's tensors (the extra ones included); returns the offset after them."""

    # -- a rank's tensors ------------------------------------------------------------
    def extra_tensors(self, plan: Any, rank: int, device: Any) -> dict[str, torch.Tensor]:
        """Zeroed tensors generation rank ``rank`` holds besides the plan's (by name)."""

    def extra_bytes(self, plan: Any) -> int:
        """Bytes of every generation rank's extra tensors."""

    def converts_tensor(self, plan: Any, local: Any) -> bool:
        """Does the plan's `LocalTensor` ``local`` hold converted contents?"""

    def reference_local(self, plan: Any, rank: int, name: str, high: torch.Tensor) -> dict[str, torch.Tensor]:
        """The oracle: what converted tensor ``name`` of generation rank ``rank`` (and
        its extra tensors) must hold, from its unconverted contents ``high``."""

    # -- a colocated pull (read the source, write the destination, in one step) ------
    def pull_job(self, plan: Any, copy: Any, src_local: torch.Tensor, dst_tensors: Mapping[str, torch.Tensor]) -> Any:
        """What `pull_launch` needs for ``copy``: its source view in ``src_local`` and its
        destination views in ``dst_tensors``."""

    def pull_launch(self, plan: Any, jobs: Sequence[Any], copies: Sequence[tuple[torch.Tensor, torch.Tensor]]
                    ) -> PullLaunch:
        """One launch running ``jobs``; it may take some of the plain ``(src, dst)``
        ``copies`` too (`PullLaunch.copies_left` is what the caller still copies)."""


class FormatTarget(Protocol):
    """The planning input that picks a destination format and the tensors it takes."""

    @property
    def dest_format(self) -> DestFormat:
        """The format the plan carries."""

    def shape_layouts(self, specs: Mapping[str, tuple[tuple[int, ...], Any]], src: Layout, dst: Layout, *,
                      train_tp: int, gen_tp: int) -> tuple[Layout, Layout]:
        """Both layouts checked for the format (a `PlanError` naming the parameter if one
        cannot carry it) and the generation one retyped where the format lands."""

    def layout_option(self) -> tuple[str, str]:
        """``(key, value)`` of this target in a generation layout string (``"fp8"``,
        ``"block128"`` for ``"tp=2,fp8=block128"``)."""


class PullLaunch:
    """A format's launch in a colocated pull (quantizing, say, while it copies).

    This base launches nothing and leaves every plain copy to torch; a format with
    work to do subclasses it. Protocol, per refit: `fence` (order a side-stream
    launch after the current stream's work so far), then `run` (side stream, not
    joined) or, once `replays`, `run_inline` (the current stream); `join` orders the
    current stream after a side-stream run.
    """

    copy_bytes = 0  # bytes of plain copies the launch makes itself

    def __init__(self, copies: Sequence[tuple[Any, Any]] = ()) -> None:
        self.copies_left = list(copies)

    def __len__(self) -> int:
        return 0

    @property
    def replays(self) -> bool:
        return False

    def fence(self) -> None:
        """Nothing to order."""

    def run(self, *, join: bool = True, fenced: bool = False) -> int:
        """Bytes written: none."""
        return 0

    def run_inline(self) -> int:
        return 0

    def join(self, device: Any) -> None:
        """Nothing ran on a side stream."""

    def note(self, torch_copies: int) -> str | None:
        """A line for the refit report's notes, or None."""
        return None
