"""Process bodies of the plugin's multi-process tests (spawned by ``policyworker.runtime.procs``).

``refit_pair``: rank 0 is a ``TorchPolicyWorker`` over the tiny model, rank 1 a
``RolloutWorker``; they share only ``directory``. Each refit the trainer takes new
weights (seed = version) and writes them; the rollout lands them and checks every
tensor bit for bit against weights it computes itself. A barrier keeps them in step,
so each version is received before the next one is written.

``crash_mid_write``: a trainer that dies (``os._exit``, no cleanup of any kind) after
writing ``files_before_death`` safetensors files of its first version.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import torch

from files_helpers import exact, make_rollout, make_trainer, set_weights, weights

CRASH_EXIT_CODE = 17


def _digest(params) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def refit_pair(rank: int, directory: str, refits: int, barrier: Any, timeout_s: float, setup: dict) -> dict:
    torch.set_num_threads(1)

    async def in_step() -> None:
        await asyncio.to_thread(barrier.wait, timeout_s)

    async def trainer() -> dict:
        w = make_trainer()
        out: dict[str, Any] = {"reports": [], "digests": []}
        try:
            await w.attach_transport("files", directory=directory, **setup)
            out["resumed_from"] = w.transport_version("files")
            for _ in range(refits):
                version = w.transport_version("files") + 1
                set_weights(w.model, version)
                rep = await w.refit("files")
                out["reports"].append({"version": rep.version, "bytes": rep.bytes, "files": rep.buckets})
                out["digests"].append(_digest(dict(w.model.named_parameters())))
                await in_step()
        finally:
            await w.shutdown()
        return out

    async def rollout() -> dict:
        w = make_rollout()
        out: dict[str, Any] = {"reports": [], "exact": [], "digests": []}
        try:
            await w.attach_transport("files", directory=directory, timeout_s=timeout_s)
            for _ in range(refits):
                rep = await w.refit("files", refit_timeout_s=timeout_s)
                have = w.weights()
                out["reports"].append({"version": rep.version, "bytes": rep.bytes, "committed": w.weight_version})
                out["exact"].append(exact(have, weights(rep.version)))
                out["digests"].append(_digest(have))
                await in_step()
        finally:
            await w.shutdown()
        return out

    return asyncio.run(trainer() if rank == 0 else rollout())


def crash_mid_write(rank: int, directory: str, files_before_death: int, setup: dict) -> str:
    torch.set_num_threads(1)
    import policyworker_files.writer as writer

    real = writer._write_file
    written: list[str] = []

    def write_then_die(path: str, tensors) -> None:
        real(path, tensors)
        written.append(path)
        if len(written) == files_before_death:
            os._exit(CRASH_EXIT_CODE)  # a crash: no exception, no finally, no cleanup

    writer._write_file = write_then_die

    async def main() -> str:
        w = make_trainer()
        await w.attach_transport("files", directory=directory, **setup)
        set_weights(w.model, 1)
        await w.refit("files")
        return "the trainer survived its own crash"

    return asyncio.run(main())


def two_trainers_and_rollout(rank: int, directory: str, refits: int, reports: Any, late: str, timeout_s: float,
                             setup: dict) -> dict:
    """Ranks 0 and 1 are trainers of one world (rank 0 writes), rank 2 a rollout; no
    barrier anywhere. ``late`` names the trainer that starts late: ``"non-writer"``
    attaches only once the writer committed all its versions, ``"writer"`` 1.5 s after
    the other. Each trainer puts ``(rank, refit index, version)`` on ``reports`` after
    each refit; the rollout acts as a controller would: once both trainers reported
    refit ``i``, it refits to that version (unless it already holds it) and checks the
    weights bit for bit against the version it landed."""
    import time

    from policyworker_files import dirs

    torch.set_num_threads(1)

    async def trainer() -> dict:
        if late == "non-writer" and rank == 1:
            until = time.monotonic() + timeout_s
            while not (os.path.isdir(directory) and dirs.committed_versions(directory)[-1:] == [refits]):
                if time.monotonic() > until:
                    raise TimeoutError("the writer did not commit its versions in time")
                await asyncio.sleep(0.05)
        if late == "writer" and rank == 0:
            await asyncio.sleep(1.5)
        w = make_trainer(rank=rank, world_size=2)
        out: dict[str, Any] = {"reports": []}
        try:
            await w.attach_transport("files", directory=directory, **setup)
            for i in range(refits):
                set_weights(w.model, w.transport_version("files") + 1)
                rep = await w.refit("files", refit_timeout_s=timeout_s)
                newest = dirs.committed_versions(directory)[-1:]
                out["reports"].append({"version": rep.version, "bytes": rep.bytes,
                                       "published_at_return": newest[0] if newest else 0})
                reports.put((rank, i, rep.version))
        finally:
            await w.shutdown()
        return out

    async def rollout() -> dict:
        w = make_rollout()
        out: dict[str, Any] = {"asked": [], "landed": [], "exact": [], "disagree": []}
        seen: dict[int, dict[int, int]] = {}
        try:
            await w.attach_transport("files", directory=directory, timeout_s=timeout_s)
            for i in range(refits):
                while len(seen.get(i, {})) < 2:
                    r, j, v = await asyncio.to_thread(reports.get, True, timeout_s)
                    seen.setdefault(j, {})[r] = v
                versions = set(seen[i].values())
                if len(versions) != 1:
                    out["disagree"].append(seen[i])
                want = max(versions)
                out["asked"].append(want)
                if want > w.weight_version:
                    rep = await w.refit("files", version=want, refit_timeout_s=timeout_s)
                    out["landed"].append(rep.version)
                    out["exact"].append(exact(w.weights(), weights(rep.version)))
            out["final"] = w.weight_version
        finally:
            await w.shutdown()
        return out

    return asyncio.run(trainer() if rank < 2 else rollout())
