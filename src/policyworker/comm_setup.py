"""Group setup helpers of :mod:`.comm`: the NCCL device, the rendezvous, quiet c10d errors.

* :func:`nccl_device` — the worker's own CUDA device for an NCCL group (never another
  thread's current device).
* :func:`_rendezvous` — every rank checks in on the store before the backend forms,
  so a timeout names the ranks that never came.
* :func:`_quiet_cpp_stderr` / :func:`_first_line` — c10d logs C++ stack frames on a
  failed connect; the typed error we raise says what matters instead.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import sys
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .errors import ConfigError, RefitTimeout

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


@contextlib.contextmanager
def _quiet_cpp_stderr() -> Iterator[None]:
    """Hold back c10d's own stderr log (C++ frames) during a store call; other lines pass.

    c10d logs a failed connect with a full C++ stack before it raises; the typed error
    we raise says what matters (address, missing rank). Lines from other code written
    meanwhile are re-emitted afterwards.
    """
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (captured): nothing to hold back
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines()
                    if line.strip() and not any(m in line for m in _CPP_NOISE)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")


def _rendezvous(store: dist.Store, *, rank: int, world_size: int, name: str, timeout_s: float,
                transport: str | None) -> None:
    """Every rank checks in on the store; on timeout, name the ranks that never did."""
    keys = [f"joined/{r}" for r in range(world_size)]
    try:
        with _quiet_cpp_stderr():
            store.set(keys[rank], "1")
            store.wait(keys, _dt.timedelta(seconds=timeout_s))
    except Exception as exc:  # DistStoreError / RuntimeError: a timeout, or the store went away
        try:
            with _quiet_cpp_stderr():
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
        except Exception:  # noqa: BLE001 - the store itself is gone: the host (rank 0) is missing
            missing = [0]
        raise RefitTimeout(f"group {name!r}: rank(s) {missing} of {world_size} did not join within "
                           f"{timeout_s:g} s ({_first_line(exc)})", rank=rank, transport=transport) from None
