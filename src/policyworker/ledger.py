"""The commit ledger: which version a set of weights holds, and whether it may be served.

One :class:`WeightLedger` per receiver — a ``RolloutWorker`` or an engine adapter (the
vLLM backend) — and one commit path for every transport, :meth:`WeightLedger.transaction`::

    with ledger.transaction(version) as tx:   # begin: weights are not servable meanwhile
        ... land bytes; tx.touched = True before the first live byte is written ...
        tx.commit(version, received_bytes=..., expected_bytes=...)   # all arrived
    # leaving without a commit (an error, a cancel, a plain return): fail(tx.touched) —
    # the version stays, torn if live bytes were (or may have been) touched

A receive spread over several calls (a bucket per call) keeps the transaction open
between them (``tx = ledger.transaction(v).open()``) and ends it with ``tx.commit`` or
``tx.close()``; the rules are the same.

A *staged* ledger (``WeightLedger(staged=True)``) is for a receiver that lands each
refit in a second set of tensors and commits by swapping sets: the live set is never
written by a refit, so it stays servable while one is in flight and a failure never
tears it. ``on_commit`` runs under the lock at commit time (the swap), so no reader
ever sees the new version with the old tensors or the reverse.

States: *committed* (``version`` v, servable) → *in flight* (``begin``) → committed v' > v
(``commit``) or back to v (``fail``: *torn* when live bytes were touched; torn
weights are refused until a later refit commits). The version never goes back and
never advances on a failure. ``check_servable()`` is what ``weights()`` calls.

Thread-safe (one lock); ``check_servable`` never blocks on a refit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from policyworker.errors import ProtocolError, RefitInProgress, TornWeights

__all__ = ["Transaction", "WeightLedger"]

_T = TypeVar("_T")


class WeightLedger:
    """Version, torn mark and in-flight mark of one set of weights (see module docstring)."""

    def __init__(self, *, rank: int | None = None, what: str = "rollout", staged: bool = False,
                 on_commit: Callable[[int], None] | None = None) -> None:
        self._lock = threading.Lock()
        self.staged = staged
        self._on_commit = on_commit
        self._version = 0
        self._torn = False
        self._in_flight: int | None = None
        self.rank = rank
        self.what = what

    @property
    def version(self) -> int:
        return self._version

    @property
    def torn(self) -> bool:
        return self._torn

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def mark_torn(self) -> None:
        """Live bytes changed outside a refit that can commit (e.g. a cancelled copy)."""
        with self._lock:
            self._torn = True

    def begin(self, expected: int) -> None:
        """A refit expecting ``expected`` starts. Refits are serial: a second is refused."""
        with self._lock:
            if self._in_flight is not None:
                raise RefitInProgress(f"{self.what} rank {self.rank}: refit {self._in_flight} is still in flight",
                                      rank=self.rank)
            self._in_flight = expected

    def commit(self, version: int, *, received_bytes: int | None = None, expected_bytes: int | None = None) -> None:
        """Every byte of ``version`` landed: make it the servable version.

        Refuses (``ProtocolError``, and the refit counts as failed and touched) a
        version that does not advance or a byte count short of the manifest's.
        """
        with self._lock:
            try:
                if isinstance(version, bool) or not isinstance(version, int) or version <= self._version:
                    raise ProtocolError(f"{self.what} rank {self.rank}: refit reported version {version!r}, "
                                        f"not past the committed {self._version}", rank=self.rank)
                if expected_bytes is not None and received_bytes is not None and received_bytes < expected_bytes:
                    raise ProtocolError(f"{self.what} rank {self.rank}: refit {version} landed {received_bytes} of "
                                        f"the {expected_bytes} bytes this rank expects", rank=self.rank)
            except ProtocolError:
                self._torn = self._torn or not self.staged
                self._in_flight = None
                raise
            if self._on_commit is not None:
                self._on_commit(version)
            self._version = version
            self._torn = False
            self._in_flight = None

    def fail(self, touched: bool | None) -> None:
        """The refit failed; ``touched`` not False (True or unknown) marks the weights torn."""
        with self._lock:
            if touched is not False and not self.staged:
                self._torn = True
            self._in_flight = None

    def transaction(self, version: int, *, touched: bool | None = False) -> Transaction:
        """One refit of ``version`` as a transaction (see the module docstring).

        ``touched``: what a failure before the receiver says otherwise assumes
        (False: nothing written yet; None: unknown, treated as touched).
        """
        return Transaction(self, version, touched)

    def serve(self, read: Callable[[], _T]) -> tuple[int, _T]:
        """``(version, read())`` atomically with commits, after ``check_servable``'s checks."""
        with self._lock:
            self._check_servable()
            return self._version, read()

    def check_servable(self) -> None:
        """Raise ``RefitInProgress`` during a refit (unless staged), ``TornWeights`` while torn."""
        with self._lock:
            self._check_servable()

    def _check_servable(self) -> None:
        if self._in_flight is not None and not self.staged:
            raise RefitInProgress(f"{self.what} rank {self.rank}: refit {self._in_flight} is in flight; "
                                  f"the last committed version is {self._version}", rank=self.rank)
        if self._torn:
            raise TornWeights(f"{self.what} rank {self.rank}: a failed refit left the weights partly "
                              f"overwritten (last committed version {self._version}); a full refit must "
                              f"commit first", rank=self.rank)


class Transaction:
    """One refit on a :class:`WeightLedger`: begun once, then committed or failed exactly once.

    ``touched``: live bytes were (True), were not (False) or may have been (None)
    overwritten; the receiver keeps it true to the bytes. As a context manager it
    begins on entry and, unless :meth:`commit` ran, fails on exit with ``touched``
    (an exception leaving the block still propagates). ``done``: ended either way.
    """

    __slots__ = ("ledger", "version", "touched", "done", "_open")

    def __init__(self, ledger: WeightLedger, version: int, touched: bool | None = False) -> None:
        self.ledger, self.version, self.touched = ledger, version, touched
        self.done = False
        self._open = False

    def open(self) -> Transaction:
        """Begin (``RefitInProgress`` when another refit is in flight)."""
        self.ledger.begin(self.version)
        self._open = True
        return self

    def commit(self, version: int | None = None, *, received_bytes: int | None = None,
               expected_bytes: int | None = None) -> None:
        """Commit ``version`` (default: the transaction's); a refused commit ends it too."""
        self.done = True
        self.ledger.commit(self.version if version is None else version, received_bytes=received_bytes,
                           expected_bytes=expected_bytes)

    def close(self) -> None:
        """End without a commit (a no-op once ended): fail with ``self.touched``."""
        if self.done or not self._open:
            return
        self.done = True
        if self.ledger.in_flight:
            self.ledger.fail(self.touched)

    def __enter__(self) -> Transaction:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
