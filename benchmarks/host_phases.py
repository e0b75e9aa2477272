"""The zmq colocated refit's host timeline on CPU, for a model with many tensors.

``PYTHONPATH=src python benchmarks/host_phases.py [--src DIR] [--refits 15] [--json out.json]``

A qwen3-shaped model with 36 layers (~400 tensors, as qwen3-8b has) but tiny dims, so
that the copies are nothing and what is left of a refit is host work: the rollout's
per-phase medians (``bench_fp8_zmq.py``'s ``rollout_phases_ms``: to the executor,
waiting for the trainer's Offer, Done -> Commit, return) for a bf16 and an fp8 refit,
two interleaved rounds. ``--src`` points at another checkout's ``src`` (an A/B of two
versions run alternately; each run is its own processes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _preset() -> None:
    from policyworker.models import config as C

    C.PRESETS["deep-tiny"] = C.PRESETS["tiny"].with_(num_layers=36, hidden_size=128, intermediate_size=256,
                                                     head_dim=64, name="deep-tiny")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default=str(HERE.parent / "src"), help="the policyworker sources to measure")
    p.add_argument("--refits", type=int, default=15)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    sys.path[:0] = [ns.src, str(HERE)]  # before policyworker's first import; the ranks inherit it
    _preset()
    import bench_fp8_zmq
    from policyworker.cli.output import write_json

    res = bench_fp8_zmq.run("deep-tiny", "cpu", ns.refits, 60.0, rounds=2)
    keep = ("to_transport", "offer_wait", "done_commit", "return")
    out = {"src": ns.src, "refits": ns.refits, "seconds": {m: res["seconds"][m] for m in ("bf16", "fp8")},
           "phases_ms": res["rollout_phases_ms"],
           "host_ms": {m: round(sum(ph.get(k, 0.0) for k in keep), 4) for m, ph in res["rollout_phases_ms"].items()}}
    write_json(ns.json, out, echo=True, indent=1)
    return 0


if __name__ == "__mp_main__":  # a spawned rank: the parent's sys.path is here already
    _preset()

if __name__ == "__main__":
    raise SystemExit(main())
