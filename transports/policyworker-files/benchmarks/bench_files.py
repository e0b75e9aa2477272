"""Benchmark of the files transport: a trainer process writes, a rollout process reads.

Both are real workers on the road (``attach_transport`` / ``refit``), sharing only
``--dir``. They go in step: the trainer refits (write, fsync, checksum, rename,
prune), then the rollout refits the committed version (map, verify every checksum and
header, copy into its tensors), so each side's time is its own. Ceilings measured in
the same run, same processes, same directory and byte count: writing one flat buffer
to one file and fsync'ing it (write ceiling), and ``readinto`` of that file into one
preallocated tensor (read ceiling). Every refit is checked bit for bit.

    python transports/policyworker-files/benchmarks/bench_files.py --preset small --refits 5 --json out.json

``--delta F``: instead, the same versions (seeded weights, then the lowest bit of ~F of
the elements flipped per version) go twice through the same processes, each pass in a
directory of its own: full versions (``delta=False``), then delta mode. Reported per
pass: the bytes each version put on disk, write and read seconds (medians over the
versions after the first), every version checked bit for bit against a reference the
rollout computes itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from policyworker import RolloutWorker, TorchPolicyWorker
from policyworker.models import get_preset, seeded_state_dict
from policyworker.models.toy_model import build_model
from policyworker.runtime.procs import process_context, run_world

DTYPE = torch.bfloat16


def _flat_bytes(config) -> int:
    return sum(t.numel() * t.element_size() for t in seeded_state_dict(config, seed=0, dtype=DTYPE).values())


def _write_ceiling(directory: str, nbytes: int, repeats: int) -> tuple[float, str]:
    flat = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    path = os.path.join(directory, "ceiling.bin")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            f.write(memoryview(flat.numpy()))
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), path


def _read_ceiling(path: str, nbytes: int, repeats: int) -> float:
    dst = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(dst.numpy())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(view)
        times.append(time.perf_counter() - t0)
        if got != nbytes:
            raise RuntimeError(f"read {got} of {nbytes} bytes")
    return statistics.median(times)


def body(rank: int, args: dict, barrier) -> dict:
    torch.set_num_threads(1)
    config = get_preset(args["preset"])
    setup = {"directory": args["dir"], "checksum": args["checksum"], "fsync": args["fsync"], "keep": 2}

    def step() -> None:
        barrier.wait(600)

    async def trainer() -> dict:
        w = TorchPolicyWorker(build_model(config, seed=0, dtype=DTYPE), device="cpu", timeout_s=120.0)
        await w.attach_transport("files", **setup)
        nbytes = _flat_bytes(config)
        ceiling, path = _write_ceiling(args["dir"], nbytes, 3)
        step()  # the file is there: the rollout measures its read ceiling
        step()
        os.unlink(path)
        out = {"write_ceiling_s": ceiling, "write_s": [], "bytes": nbytes}
        for version in range(1, args["refits"] + 1):
            new = seeded_state_dict(config, seed=version, dtype=DTYPE)
            with torch.no_grad():
                for name, p in w.model.named_parameters():
                    p.copy_(new[name])
            rep = await w.refit("files")
            out["write_s"].append(rep.seconds)
            out["files"] = rep.buckets
            step()  # committed: the rollout reads it
            step()
        await w.shutdown()
        return out

    async def rollout() -> dict:
        model = build_model(config, seed=0, dtype=DTYPE)
        params = {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()}
        del model
        w = RolloutWorker(params=params, device="cpu", timeout_s=120.0)
        await w.attach_transport("files", **setup, timeout_s=120.0)
        nbytes = _flat_bytes(config)
        step()
        out = {"read_ceiling_s": _read_ceiling(os.path.join(args["dir"], "ceiling.bin"), nbytes, 3),
               "read_s": [], "exact": []}
        step()
        for _ in range(args["refits"]):
            step()
            rep = await w.refit("files", refit_timeout_s=120.0)
            out["read_s"].append(rep.seconds)
            want = seeded_state_dict(config, seed=rep.version, dtype=DTYPE)
            out["exact"].append(all(torch.equal(w.weights()[k], want[k]) for k in want))
            step()
        await w.shutdown()
        return out

    return asyncio.run(trainer() if rank == 0 else rollout())


def delta_body(rank: int, args: dict, barrier) -> dict:
    from policyworker.testing.delta_weights import perturb_, versioned_state

    torch.set_num_threads(1)
    config = get_preset(args["preset"])
    fraction = args["delta"]

    def step() -> None:
        barrier.wait(600)

    async def one_pass(delta: bool) -> dict:
        directory = os.path.join(args["dir"], "delta" if delta else "full")
        setup = {"directory": directory, "checksum": args["checksum"], "fsync": args["fsync"], "keep": 2,
                 "delta": delta}
        out: dict = {"seconds": [], "disk_bytes": [], "notes": [], "exact": []}
        if rank == 0:
            w = TorchPolicyWorker(build_model(config, seed=0, dtype=DTYPE), device="cpu", timeout_s=120.0)
            await w.attach_transport("files", **setup)
            first = seeded_state_dict(config, seed=1, dtype=DTYPE)
            with torch.no_grad():
                for name, p in w.model.named_parameters():
                    p.copy_(first[name])
        else:
            model = build_model(config, seed=0, dtype=DTYPE)
            w = RolloutWorker(params={n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()},
                              device="cpu", timeout_s=120.0)
            del model
            step()  # the writer made the directory and its signature
            await w.attach_transport("files", **setup, timeout_s=120.0)
        if rank == 0:
            step()
        for version in range(1, args["refits"] + 1):
            if rank == 0:
                if version > 1:
                    perturb_(dict(w.model.named_parameters()), fraction, version)
                rep = await w.refit("files")
                vdir = os.path.join(directory, f"v{version:08d}")
                out["disk_bytes"].append(sum(os.path.getsize(os.path.join(vdir, n)) for n in os.listdir(vdir)))
                step()
                step()
            else:
                step()
                rep = await w.refit("files", refit_timeout_s=120.0)
                want = versioned_state(seeded_state_dict(config, seed=1, dtype=DTYPE),
                                       [0.0] + [fraction] * (version - 1))
                out["exact"].append(all(torch.equal(w.weights()[k], want[k]) for k in want))
                step()
            out["seconds"].append(rep.seconds)
            out["notes"].append(rep.notes[0] if rep.notes else "")
        out["shadow_bytes"] = rep.shadow_bytes
        await w.shutdown()
        return out

    async def both() -> dict:
        return {"full": await one_pass(False), "delta": await one_pass(True)}

    return asyncio.run(both())


def delta_main(ns, directory: str, argv) -> dict:
    args = {"preset": ns.preset, "refits": ns.refits, "checksum": ns.checksum, "fsync": ns.fsync,
            "dir": directory, "delta": ns.delta}
    barrier = process_context().Barrier(2)
    trainer, rollout = run_world(delta_body, 2, (args, barrier), timeout_s=1800.0)
    result = {"bench": "files-delta", "preset": ns.preset, "dtype": str(DTYPE), "changed_fraction": ns.delta,
              "refits": ns.refits, "checksum": ns.checksum, "fsync": ns.fsync,
              "bytes": _flat_bytes(get_preset(ns.preset)),
              "command": " ".join([os.path.basename(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])])}
    for mode in ("full", "delta"):
        t, r = trainer[mode], rollout[mode]
        if not t["disk_bytes"] or len(r["exact"]) != ns.refits:
            raise RuntimeError(f"the {mode} pass did not run all {ns.refits} versions")
        result[mode] = {"disk_bytes_per_version": statistics.median(t["disk_bytes"][1:] or t["disk_bytes"]),
                        "write_s": statistics.median(t["seconds"][1:] or t["seconds"]),
                        "read_s": statistics.median(r["seconds"][1:] or r["seconds"]),
                        "writer_notes": t["notes"], "shadow_bytes": t["shadow_bytes"], "bit_exact": all(r["exact"])}
    full, delta = result["full"], result["delta"]
    if not all(n.startswith("delta") for n in delta["writer_notes"][1:]):
        raise RuntimeError(f"the delta pass published full versions: {delta['writer_notes']}")
    result["disk_ratio"] = delta["disk_bytes_per_version"] / full["disk_bytes_per_version"]
    result["write_ratio"] = delta["write_s"] / full["write_s"]
    result["read_ratio"] = delta["read_s"] / full["read_s"]
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--checksum", default="sha256", choices=["sha256", "crc32"])
    ap.add_argument("--no-fsync", dest="fsync", action="store_false")
    ap.add_argument("--dir", default=None, help="the shared directory (default: a fresh temporary one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--delta", type=float, default=None, metavar="F",
                    help="compare full and delta versions at changed fraction F (see the module docstring)")
    ns = ap.parse_args(argv)
    directory = ns.dir or tempfile.mkdtemp(prefix="pw-files-bench-")
    result = delta_main(ns, directory, argv) if ns.delta is not None else _full_main(ns, directory, argv)
    text = json.dumps(result, indent=2)
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return result


def _full_main(ns, directory: str, argv) -> dict:
    """Full versions: writes and reads against their same-run ceilings."""
    args = {"preset": ns.preset, "refits": ns.refits, "checksum": ns.checksum, "fsync": ns.fsync, "dir": directory}
    barrier = process_context().Barrier(2)
    trainer, rollout = run_world(body, 2, (args, barrier), timeout_s=1800.0)
    nbytes = trainer["bytes"]
    # The first refit also creates the files; the median over the rest is the steady state.
    steady_w = trainer["write_s"][1:] or trainer["write_s"]
    steady_r = rollout["read_s"][1:] or rollout["read_s"]
    w, r = statistics.median(steady_w), statistics.median(steady_r)
    result = {
        "bench": "files", "preset": ns.preset, "dtype": str(DTYPE), "bytes": nbytes, "refits": ns.refits,
        "checksum": ns.checksum, "fsync": ns.fsync, "files_per_version": trainer["files"],
        "write": {"median_s": w, "gbps": nbytes / w / 1e9, "first_s": trainer["write_s"][0]},
        "write_ceiling": {"median_s": trainer["write_ceiling_s"], "gbps": nbytes / trainer["write_ceiling_s"] / 1e9},
        "read": {"median_s": r, "gbps": nbytes / r / 1e9, "first_s": rollout["read_s"][0]},
        "read_ceiling": {"median_s": rollout["read_ceiling_s"], "gbps": nbytes / rollout["read_ceiling_s"] / 1e9},
        "bit_exact": all(rollout["exact"]),
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])]),
    }
    result["write"]["ratio"] = trainer["write_ceiling_s"] / w
    result["read"]["ratio"] = rollout["read_ceiling_s"] / r
    return result


if __name__ == "__main__":
    main()
