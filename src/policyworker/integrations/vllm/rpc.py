"""One outcome per weight-transfer call, whatever the engine's tp size.

vLLM runs each weight-transfer call (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) as a collective
RPC on every worker of the engine. Its multiprocess executor (tp >= 2) reads the
workers' replies in rank order and raises at the first failed one, leaving the other
ranks' replies queued: every later call would then read the previous call's reply.
Two pieces make every call answer for itself:

* **The ranks agree before they reply** (:class:`Agreement`). Each rank runs its part,
  then publishes its outcome (ok, or its error as a marker of
  :mod:`.vllm_errors`) on the store of vLLM's own process group and waits, bounded, for
  every tp rank's. If any rank failed, every rank raises the same error: the one of
  the lowest failed rank (its class, message and attributes). So every rank's state —
  vLLM's update session included — moves the same way.
* **One rank replies** (:func:`install_single_reply`). For these calls, and only on an
  engine whose backend is ``"policyworker"``, the multiprocess executor asks for the
  reply of the last rank alone (vLLM's ``unique_reply_rank``: the other ranks run the
  call but queue no reply). Since all ranks agreed, that reply is the engine's; nothing
  is left queued.

The uni-process executor (tp=1) and Ray's executor keep no reply queue: they need only
the first piece, which is a no-op at tp=1.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from policyworker.errors import PolicyWorkerError, RefitTimeout
from policyworker.integrations.vllm.errors import encode, error_from_text

__all__ = ["WEIGHT_RPCS", "Agreement", "install_single_reply"]

logger = logging.getLogger(__name__)

#: The worker methods vLLM's weight-transfer API calls as collective RPCs.
WEIGHT_RPCS = frozenset({"init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
                         "start_draft_weight_update", "update_weights", "finish_weight_update"})


class Agreement:
    """The tp ranks of one engine agree on each call's outcome (see the module docstring).

    ``store``: a store every tp rank of this engine shares (vLLM's default process
    group's); ``prefix`` tells this engine (data-parallel rank) apart. Calls are
    numbered in the order every rank receives them (vLLM broadcasts each call to all of
    its workers, in one order).
    """

    def __init__(self, store: Any, *, tp_rank: int, tp_size: int, prefix: str) -> None:
        self.store = store
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.prefix = prefix
        self.seq = 0

    @classmethod
    def for_vllm(cls, tp_rank: int, tp_size: int, dp_rank: int) -> "Agreement":
        store = None
        if tp_size > 1:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d

            # vLLM's workers share torch.distributed's default group; its store is the one
            # rendezvous every rank of the engine already has (no port of ours).
            store = dist.PrefixStore("policyworker/agree", distributed_c10d._get_default_store())
        return cls(store, tp_rank=tp_rank, tp_size=tp_size, prefix=f"dp{dp_rank}")

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}/{seq}/{rank}"

    def outcome(self, what: str, error: BaseException | None, timeout_s: float) -> PolicyWorkerError | None:
        """Publish this rank's outcome, wait for every rank's; the error all ranks raise.

        ``error``: this rank's failure (None: it succeeded). Returns None when every rank
        succeeded; else the error of the lowest rank that failed with one of ours (the
        lowest failed rank if none did). Waits at most ``timeout_s`` for the other ranks (raises
        ``RefitTimeout`` past it: the engine's ranks are then out of step).
        """
        if self.tp_size == 1:
            if error is None or isinstance(error, PolicyWorkerError):
                return error
            return _foreign(error, self.tp_rank)
        self.seq += 1
        seq = self.seq
        record: dict[str, Any] = {"ok": error is None, "ours": isinstance(error, PolicyWorkerError)}
        if error is not None:
            err = error if isinstance(error, PolicyWorkerError) else _foreign(error, self.tp_rank)
            record["error"] = encode(err, _plain_message(err))
        self.store.set(self._key(seq, self.tp_rank), json.dumps(record))
        keys = [self._key(seq, r) for r in range(self.tp_size)]
        try:
            self.store.wait(keys, _dt.timedelta(seconds=timeout_s))
            records = [json.loads(bytes(self.store.get(k))) for k in keys]
        except Exception as exc:  # the store raises DistStoreError / RuntimeError on timeouts
            raise RefitTimeout(f"vLLM rank {self.tp_rank}: the engine's tp ranks did not all finish "
                               f"{what} within {timeout_s:g} s ({type(exc).__name__}: {exc})",
                               rank=self.tp_rank) from exc
        if seq > 2:
            # Every rank read call seq-2's records before it wrote seq-1's (which this
            # rank has now read): this rank's old record is no longer needed.
            try:
                self.store.delete_key(self._key(seq - 2, self.tp_rank))
            except Exception as exc:  # bookkeeping only: a leftover key harms nothing
                logger.debug("policyworker: could not delete an old agreement key: %s", exc)
        failed = [(rank, rec) for rank, rec in enumerate(records) if not rec.get("ok")]
        if not failed:
            return None
        # The lowest rank with one of our errors speaks for the engine (a foreign error —
        # a bug — is logged where it happened; a typed one tells the controller more).
        rank, rec = min(failed, key=lambda item: (not item[1].get("ours"), item[0]))
        if rank == self.tp_rank and isinstance(error, PolicyWorkerError):
            return error
        agreed = error_from_text(str(rec.get("error", "")))
        if agreed is None:  # a record we did not write ourselves
            agreed = PolicyWorkerError(f"vLLM rank {rank} failed in {what}", rank=rank)
        return agreed


def _plain_message(err: PolicyWorkerError) -> str:
    """The message without a marker :func:`.vllm_errors.mark` may have added."""
    again = error_from_text(str(err))
    return str(again) if again is not None else str(err)


def _foreign(error: BaseException, rank: int) -> PolicyWorkerError:
    """A failure that is not ours (a bug, vLLM's own): typed as the root, the cause kept."""
    err = PolicyWorkerError(f"vLLM rank {rank}: {type(error).__name__}: {error}", rank=rank)
    err.__cause__ = error
    return err


def install_single_reply() -> None:
    """Make vLLM's multiprocess executor read one reply (the last rank's) for weight-transfer
    calls of a ``"policyworker"`` engine; see the module docstring. Idempotent; does
    nothing where vLLM has no multiprocess executor."""
    try:
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    except ImportError:
        return
    original = MultiprocExecutor.collective_rpc
    if getattr(original, "_policyworker_single_reply", False):
        return
    MultiprocExecutor.collective_rpc = _single_reply(original)


def _ours(executor: Any) -> bool:
    config = getattr(getattr(executor, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None) == "policyworker"


def _single_reply(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None, non_block: bool = False, unique_reply_rank: int | None = None,
                       **rest: Any) -> Any:
        if (isinstance(method, str) and method in WEIGHT_RPCS and unique_reply_rank is None and not non_block
                and not rest and _ours(self)):
            n = self.world_size
            reply = original(self, method, timeout, args, kwargs, unique_reply_rank=n - 1)
            return [reply] * n  # every rank agreed: the last rank's reply is each rank's
        return original(self, method, timeout, args, kwargs, non_block=non_block,
                        unique_reply_rank=unique_reply_rank, **rest)

    collective_rpc._policyworker_single_reply = True  # type: ignore[attr-defined]
    return collective_rpc
