"""FP8 vs BF16 refits over nccl_reshard on CPU (gloo): bytes moved and seconds, same run.

``PYTHONPATH=src python benchmarks/bench_fp8_nccl.py --json out.json``

For each of the demo's layouts, one world refits the generation layout in BF16 and
another in FP8 (``fp8=block128``: the trainers quantize while packing, on their
refit executor threads), back to back in this one invocation, alternating
bf16/fp8/bf16/fp8... for ``--rounds`` rounds so machine noise hits both alike. Each
world measures its own gloo ceiling (same byte count, plain sends) and checks every
rollout tensor (fp8 bytes and scales against the reference quantizer) bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from policyworker.cli.output import write_json  # noqa: E402
from policyworker.cli.refit_bench import RefitBenchSpec, run_refit_bench  # noqa: E402

LAYOUTS = [("tp=2,pp=2", "tp=2,dp=2"), ("tp=2", "tp=1"), ("tp=2", "tp=2")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--refits", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    rows = []
    for train, gen in LAYOUTS:
        runs: dict[str, list[dict]] = {"bf16": [], "fp8": []}
        for _ in range(ns.rounds):
            for mode, g in (("bf16", gen), ("fp8", gen + ",fp8=block128")):
                res = run_refit_bench(RefitBenchSpec(preset=ns.preset, train=train, gen=g, refits=ns.refits))
                runs[mode].append(res)
        row = {"train": train, "gen": gen}
        for mode, results in runs.items():
            secs = [statistics.median(r["seconds"] for r in res["refits"]) for res in results]
            row[mode] = {"bytes_moved": results[0]["bytes_moved"], "min_bytes": results[0]["min_bytes"],
                         "refit_s_median": statistics.median(secs), "refit_s_per_run": secs,
                         "ceiling_gbps": [r["ceiling_gbps"] for r in results],
                         "bit_exact": all(r["bit_exact"] for r in results)}
        row["fp8_bytes_over_bf16"] = row["fp8"]["bytes_moved"] / row["bf16"]["bytes_moved"]
        row["fp8_seconds_over_bf16"] = row["fp8"]["refit_s_median"] / row["bf16"]["refit_s_median"]
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("train", "gen", "fp8_bytes_over_bf16", "fp8_seconds_over_bf16")}),
              file=sys.stderr)
    out = {"benchmark": "fp8 vs bf16 refit, nccl_reshard on CPU (gloo)", "preset": ns.preset,
           "refits": ns.refits, "rounds": ns.rounds, "layouts": rows}
    write_json(ns.json, out, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
