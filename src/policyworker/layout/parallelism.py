"""`Parallelism`: the one rank map used everywhere in policyworker.

Rank order (outermost first): pipeline stage, data-parallel rank, tensor-parallel
rank::

    rank = ((pp_stage * dp) + dp_rank) * tp + tp_rank

so the ``dp * tp`` ranks of a stage are contiguous, and the ``tp`` ranks of one
data-parallel replica are contiguous inside it.

Expert parallelism does not add ranks; it regroups the ``dp * tp`` ranks of each
stage. Number them ``i = dp_rank * tp + tp_rank`` and split ``i`` (outermost first)
into ``(edp_rank, ep_rank, etp_rank)``::

    i = (edp_rank * ep + ep_rank) * etp + etp_rank

* ``etp`` (expert tensor parallel, how many ranks split one expert's matrices) is
  ``tp`` when ``ep`` divides ``dp`` — experts are carved out of the data-parallel
  axis and keep the dense layers' tensor sharding (Megatron's default), so
  ``ep_rank = dp_rank % ep`` and ``etp_rank = tp_rank``; otherwise it is
  ``dp * tp // ep`` and nothing replicates the experts (``edp == 1``); with
  ``ep == dp * tp`` every rank holds whole experts (vLLM's expert parallel).
* ``edp = dp * tp // (ep * etp)`` copies of each expert exist per stage.
* ep rank ``r`` holds experts ``[r * E / ep, (r + 1) * E / ep)`` (contiguous blocks;
  the model check that ``ep`` divides ``E`` lives in :mod:`.rules`).
"""

from __future__ import annotations

from dataclasses import dataclass

from policyworker.errors import ConfigError

__all__ = ["AXES", "Parallelism", "RankCoords"]

AXES: tuple[str, ...] = ("tp", "pp", "dp", "ep")


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCoords:
    """Where one rank sits: its coordinate on every axis (see the module docstring)."""

    rank: int
    pp_stage: int
    dp_rank: int
    tp_rank: int
    ep_rank: int
    etp_rank: int
    edp_rank: int


@dataclass(frozen=True, slots=True)
class Parallelism:
    """Sizes of the tensor / pipeline / data / expert parallel axes.

    ``Parallelism(tp=2, pp=2)`` or ``Parallelism.parse("tp=2,pp=2,dp=1")``.
    Model-independent checks happen here (positive ints, ``ep`` divides ``dp * tp``);
    checks against a model (heads, experts, layers) live in :mod:`.rules`.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(f"{axis} must be a positive int, got {size!r}")
        if (self.dp * self.tp) % self.ep:
            raise ConfigError(
                f"ep={self.ep} must divide dp*tp={self.dp * self.tp}: expert-parallel "
                "groups are formed over the dp x tp ranks of each pipeline stage"
            )

    # -- sizes ---------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: ``dp * tp``."""
        return self.dp * self.tp

    @property
    def etp(self) -> int:
        """Ranks that split one expert's matrices (see the module docstring)."""
        return self.tp if self.dp % self.ep == 0 else self.stage_size // self.ep

    @property
    def edp(self) -> int:
        """Copies of each expert per stage."""
        return self.stage_size // (self.ep * self.etp)

    # -- rank map ------------------------------------------------------------------
    def rank_of(self, *, pp_stage: int = 0, dp_rank: int = 0, tp_rank: int = 0) -> int:
        for axis, value, size in (("pp_stage", pp_stage, self.pp),
                                  ("dp_rank", dp_rank, self.dp),
                                  ("tp_rank", tp_rank, self.tp)):
            if not 0 <= value < size:
                raise ConfigError(f"{axis}={value} out of range [0, {size}) for {self}")
        return (pp_stage * self.dp + dp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} out of range [0, {self.world_size}) for {self}",
                              rank=rank)
        pp_stage, i = divmod(rank, self.stage_size)
        dp_rank, tp_rank = divmod(i, self.tp)
        outer, etp_rank = divmod(i, self.etp)
        edp_rank, ep_rank = divmod(outer, self.ep)
        return RankCoords(rank=rank, pp_stage=pp_stage, dp_rank=dp_rank, tp_rank=tp_rank,
                          ep_rank=ep_rank, etp_rank=etp_rank, edp_rank=edp_rank)

    def stage_ranks(self, pp_stage: int) -> range:
        """The ``dp * tp`` global ranks of one pipeline stage, in rank order."""
        if not 0 <= pp_stage < self.pp:
            raise ConfigError(f"pp_stage={pp_stage} out of range [0, {self.pp}) for {self}")
        return range(pp_stage * self.stage_size, (pp_stage + 1) * self.stage_size)

    def check_world_size(self, world_size: int, *, side: str = "") -> None:
        """ConfigError unless ``world_size`` equals ``tp * pp * dp``."""
        if world_size != self.world_size:
            who = f"{side} " if side else ""
            raise ConfigError(
                f"{who}world size {world_size} does not match {self} "
                f"(tp*pp*dp = {self.world_size})"
            )

    # -- text ----------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> Parallelism:
        """``"tp=2,pp=2,dp=1"`` (any order, omitted axes are 1) -> Parallelism."""
        sizes: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in AXES:
                raise ConfigError(
                    f"cannot parse {item!r} in {text!r}: expected axis=size with axis "
                    f"in {AXES}"
                )
            if key in sizes:
                raise ConfigError(f"axis {key!r} given twice in {text!r}")
            try:
                sizes[key] = int(value.strip())
            except ValueError:
                raise ConfigError(f"size of {key!r} in {text!r} is not an int: {value!r}") \
                    from None
        return cls(**sizes)

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp},ep={self.ep}"

    def to_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep}
