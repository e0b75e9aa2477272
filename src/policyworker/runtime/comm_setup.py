"""Group setup helpers: the NCCL device, the rendezvous, quiet c10d errors.

* :func:`nccl_device` — the worker's own CUDA device for an NCCL group (never another
  thread's current device).
* :func:`_rendezvous` — every rank checks in on the store before the backend forms,
  so a timeout names the ranks that never came.
* :func:`_quiet_cpp_stderr` / :func:`_first_line` — c10d logs C++ stack frames on a
  failed connect; the typed error we raise says what matters instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from policyworker.errors import ConfigError, RefitTimeout

__all__ = ["nccl_device"]


def nccl_device(device: torch.device | int | str | None) -> torch.device:
    """The CUDA device an NCCL group of this worker uses: ``device`` (an index, ``"cuda:1"``,
    a torch device), else the calling thread's current device. ``ConfigError`` otherwise."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
            else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"not a CUDA device: {device!r}") from exc
    if dev.type != "cuda":
        raise ConfigError(f"an NCCL group needs a CUDA device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if not 0 <= dev.index < torch.cuda.device_count():
        raise ConfigError(f"{dev} is not visible here ({torch.cuda.device_count()} visible CUDA devices)")
    return dev


def _first_line(exc: BaseException) -> str:
    """The message of a c10d error without its C++ frames."""
    text = str(exc).strip()
    return text.split("\nException raised from", 1)[0].splitlines()[0] if text else type(exc).__name__


_CPP_NOISE = ("frame #", "Exception raised from", "<omitting python frames>", "[c10d]")


_QUIET_LOCK = threading.Lock()
_quiet_depth = 0  # threads inside _quiet_cpp_stderr now (one redirect serves them all)
_quiet_saved: int | None = None
_quiet_tmp = None


@contextlib.contextmanager
def _quiet_cpp_stderr() -> Iterator[None]:
    """Hold back c10d's own stderr log (C++ frames) during a store call; other lines pass.

    c10d logs a failed connect with a full C++ stack before it raises; the typed error
    we raise says what matters (address, missing rank). Lines from other code written
    meanwhile are re-emitted afterwards.

    fd 2 is process-wide, so the redirect is too: threads that enter while it is on
    share it (a count), and the last one out restores the real stderr. Two threads
    each saving and restoring "their" stderr would restore in the wrong order and
    leave fd 2 on a deleted file — every later line of the process, a hang's stack
    dump included, lost. Keep it around short calls only.
    """
    global _quiet_depth, _quiet_saved, _quiet_tmp
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (captured): nothing to hold back
        yield
        return
    with _QUIET_LOCK:
        if _quiet_depth == 0:
            sys.stderr.flush()
            _quiet_tmp = tempfile.TemporaryFile()
            _quiet_saved = os.dup(fd)
            os.dup2(_quiet_tmp.fileno(), fd)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                os.dup2(_quiet_saved, fd)
                os.close(_quiet_saved)
                tmp, _quiet_tmp, _quiet_saved = _quiet_tmp, None, None
                tmp.seek(0)
                kept = [line for line in tmp.read().decode(errors="replace").splitlines()
                        if line.strip() and not any(m in line for m in _CPP_NOISE)]
                tmp.close()
                if kept:
                    sys.stderr.write("\n".join(kept) + "\n")


# Check-in polling: fast at first (ranks usually arrive together), then at most 50 ms.
_POLL_MIN_S, _POLL_MAX_S = 1e-3, 0.05


def _rendezvous(store: dist.Store, *, rank: int, world_size: int, name: str, timeout_s: float,
                transport: str | None) -> None:
    """Every rank checks in on the store; on timeout, name the ranks that never did.

    Polled with ``store.check`` (answers at once, logs nothing) rather than one
    ``store.wait`` for the whole timeout: no C++ call blocks for up to ``timeout_s``,
    and no stderr redirect is held meanwhile (it would swallow every other thread's
    output — a stack dump of a hang elsewhere in the process included).
    """
    keys = [f"joined/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    pause = _POLL_MIN_S
    try:
        store.set(keys[rank], "1")
        while not store.check(keys):
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise RefitTimeout(f"group {name!r}: rank(s) {missing} of {world_size} did not join within "
                                   f"{timeout_s:g} s", rank=rank, transport=transport)
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
    except RefitTimeout:
        raise
    except Exception as exc:  # DistStoreError / RuntimeError: the store (rank 0, its host) went away
        raise RefitTimeout(f"group {name!r}: the store went away while rank {rank} waited for the others to "
                           f"join (rank 0 is missing: {_first_line(exc)})", rank=rank, transport=transport) from None
