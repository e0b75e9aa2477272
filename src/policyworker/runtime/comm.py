"""Independent, abortable process groups among arbitrary processes.

A :class:`CommGroup` is a ``TCPStore`` + ``PrefixStore`` + ``ProcessGroupGloo`` (CPU)
or ``ProcessGroupNCCL`` (CUDA), built without ``init_process_group``: the trainer's
own default group (if any) is never touched, and several groups can coexist (the
update group, one group per pipeline stage, one per SGLang engine).

Every operation is bounded. Collectives are issued asynchronously and completed by
:meth:`CommGroup.wait`, which waits for the work against a deadline and against the
group's abort flag (gloo works are waited on by a per-group waiter thread, NCCL works
are polled). So a watchdog on another thread can abort a refit that is
blocked in a collective: ``abort()`` sets the flag (and aborts the backend where it
can), the waiting thread sees it within a millisecond and raises ``RefitAborted``.
An aborted group is dead: build a new one (``init_collective`` again) to recover.

Ranks: rank 0 of a group hosts its store at ``(host, port)``; every other rank
connects to it. All ranks must call collectives in the same order (the usual
deadlock hazard of collectives): a rank that skips one makes its peers wait until
their deadline.

This module is the import path; the parts live in
:mod:`~policyworker.runtime.comm_group` (the group: bounded operations, abort, close),
:mod:`~policyworker.runtime.comm_waiter` (the gloo waiter thread),
:mod:`~policyworker.runtime.comm_create` (building groups) and
:mod:`~policyworker.runtime.comm_setup` (the NCCL device, the rendezvous, quiet c10d errors).
"""

from __future__ import annotations

from policyworker.runtime.comm_create import DEFAULT_TIMEOUT_S, backend_for, group_on_store, new_group, share_token
from policyworker.runtime.comm_group import CommGroup
from policyworker.runtime.comm_setup import nccl_device

__all__ = ["DEFAULT_TIMEOUT_S", "CommGroup", "backend_for", "group_on_store", "nccl_device", "new_group", "share_token"]
