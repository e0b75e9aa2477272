"""policyworker command line: demo | bench | drill | plan | transports.

Arguments are checked before any process starts: bad input is one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from policyworker.cli.args import int_at_least, json_path, model_config, positive_float
from policyworker.cli.output import write_json

__all__ = ["main"]


def _staging_arg(text: str) -> int | str:
    """``--staging``: a count of buffers (nccl_reshard) or a vLLM staging mode (``--engine vllm``)."""
    if text in ("device", "host", "none", "none-torch", "all"):
        return text
    return int_at_least(1)(text)


def _cmd_transports(args: argparse.Namespace) -> int:
    """List the registered transports; with ``--load`` import each, report every broken
    plugin (and every ignored claim on a built-in name) and exit 1 if there is any."""
    from rich.console import Console
    from rich.table import Table

    from policyworker.errors import TransportLoadError
    from policyworker.registry import TransportRegistry

    registry = TransportRegistry()
    infos = registry.list()
    failed: dict[str, str] = {}
    if args.load:
        for info in infos:
            try:
                registry.load(info.name)
            except TransportLoadError as exc:  # show every broken plugin, keep loading the rest
                failed[info.name] = str(exc)
        for problem in registry.problems():  # e.g. a plugin claiming a built-in's name
            if problem.entry_point not in failed:
                failed[f"{problem.entry_point} ({problem.distribution})"] = str(problem)
        for name, message in failed.items():
            print(f"policyworker transports: {name}: {message}", file=sys.stderr)
        infos = registry.list()
    if args.json:
        print(json.dumps([dataclasses.asdict(info) for info in infos], indent=2))
    else:
        table = Table(title="policyworker transports")
        for col in ("name", "distribution", "target", "loaded", "problem"):
            table.add_column(col)
        for info in infos:
            problem = "load failed" if info.name in failed else ("name conflict" if info.problem else "")
            table.add_row(info.name, info.distribution, info.target, "yes" if info.loaded else "no", problem)
        Console().print(table)
    if failed:
        print(f"policyworker transports: {len(failed)} plugin problem(s)", file=sys.stderr)
        return 1
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        given = [f"--{k}" for k in ("preset", "train", "gen") if getattr(args, k) is not None]
        if given:
            from policyworker.errors import ConfigError

            raise ConfigError(f"demo --engine vllm runs its own tiny Qwen3 (trainers tp=2 -> vLLM tp=1); "
                              f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply (use bench --engine vllm --vllm-train/--vllm-tp)")
        from policyworker.cli.vllm_bench import run_vllm_demo

        result = run_vllm_demo(refits=args.refits)
        write_json(args.json, result)
        return 0 if result["passed"] else 1
    from policyworker.cli.demo import main as demo_main

    args.preset = args.preset or "small"
    args.train = args.train or "tp=2,pp=2"
    args.gen = args.gen or "tp=2,dp=2"
    return demo_main(args)


def _bench_vllm_overlap(args: argparse.Namespace) -> int:
    from policyworker.errors import ConfigError

    if not args.overlap or args.engine != "vllm" or args.engines != 1 or args.lora is not None:
        raise ConfigError("bench --overlap (and --plot) measure one vLLM engine: add --engine vllm --overlap; "
                          "--engines 2 and --lora do not apply")
    if args.plot:
        from policyworker.cli.overlap_plot import plot_timelines, require_matplotlib

        require_matplotlib()  # before minutes of benchmark, not after
    from policyworker.cli.vllm_overlap_bench import run_vllm_overlap_bench

    result = run_vllm_overlap_bench(preset=args.preset, train=args.vllm_train, tp=args.vllm_tp, refits=args.refits,
                                    dtype=args.dtype, bucket_bytes=int(args.bucket_mb * 2**20),
                                    cpu_linear=args.vllm_cpu_linear, timeout_s=args.timeout,
                                    log=lambda msg: print(msg, file=sys.stderr, flush=True))
    write_json(args.json, result, echo=True)
    if args.plot:
        plot_timelines(result, args.plot)
    if not result["tokens_match_hf"]:
        bad = [r["version"] for r in [result["cold_refit"], *result["refits"]] if not r["tokens_match_hf"]]
        print(f"error: vLLM's greedy tokens after the commit of version(s) {bad} differ from Hugging Face's "
              f"with the same weights", file=sys.stderr)
        return 1
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.lora is not None and args.engine != "vllm":
        from policyworker.errors import ConfigError

        raise ConfigError("bench --lora RANK refits into vLLM: add --engine vllm")
    if args.engines != 1 and (args.engine != "vllm" or args.lora is not None or args.vllm_tp != 1):
        from policyworker.errors import ConfigError

        raise ConfigError("bench --engines 2 refits two tp=1 vLLM engines: add --engine vllm; "
                          "--lora and --vllm-tp do not apply")
    if args.overlap or args.plot:
        return _bench_vllm_overlap(args)
    if args.engines == 2:
        from policyworker.cli.vllm_engines_bench import run_vllm_engines_bench

        result = run_vllm_engines_bench(preset=args.preset, train=args.vllm_train, rounds=args.refits,
                                        dtype=args.dtype, bucket_bytes=int(args.bucket_mb * 2**20),
                                        timeout_s=args.timeout, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        write_json(args.json, result, echo=True)
        return 0 if all(result["tokens_match_hf_per_engine"]) or args.dtype != "float32" else 1
    if args.engine == "vllm" and args.lora is not None:
        from policyworker.cli.vllm_lora_bench import run_vllm_lora_bench

        result = run_vllm_lora_bench(rank=args.lora, preset=args.preset, train=args.vllm_train, refits=args.refits,
                                     executor=args.vllm_executor,
                                     dtype=args.dtype, bucket_bytes=int(args.bucket_mb * 2**20),
                                     timeout_s=args.timeout, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        write_json(args.json, result, echo=True)
        return 0 if result["tokens_match_peft"] or args.dtype != "float32" else 1
    if args.engine == "vllm" and isinstance(args.staging, str):
        from policyworker.cli.vllm_staging_bench import run_vllm_staging_bench

        result = run_vllm_staging_bench(modes=args.staging, preset=args.preset, train=args.vllm_train,
                                        tp=args.vllm_tp, refits=args.refits, dtype=args.dtype,
                                        bucket_bytes=int(args.bucket_mb * 2**20), executor=args.vllm_executor,
                                        timeout_s=args.timeout, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        write_json(args.json, result, echo=True)
        return 0 if result["tokens_match_hf"] or args.dtype != "float32" else 1
    if args.engine == "vllm":
        from policyworker.cli.vllm_bench import run_vllm_bench

        result = run_vllm_bench(preset=args.preset, train=args.vllm_train, tp=args.vllm_tp, refits=args.refits,
                                dtype=args.dtype, bucket_bytes=int(args.bucket_mb * 2**20), timeout_s=args.timeout,
                                executor=args.vllm_executor, cpu_linear=args.vllm_cpu_linear,
                                log=lambda msg: print(msg, file=sys.stderr, flush=True))
        write_json(args.json, result, echo=True)
        # Greedy tokens are exact only in float32 (bf16 kernels round differently from HF).
        return 0 if result["tokens_match_hf"] or args.dtype != "float32" else 1
    if args.transport is None:
        from policyworker.errors import ConfigError

        raise ConfigError("bench needs --transport nccl_reshard|zmq or --engine vllm")
    if isinstance(args.staging, str):
        from policyworker.errors import ConfigError

        raise ConfigError(f"--staging {args.staging} is a vLLM staging mode (--engine vllm); --transport takes a count")
    if args.transport == "zmq":
        return _bench_zmq(args)
    if args.delta:
        return _bench_delta(args)
    from policyworker.cli.refit_bench import RefitBenchSpec, run_refit_bench

    spec = RefitBenchSpec(preset=args.preset, train=args.train, gen=args.gen, refits=args.refits,
                          dtype=args.dtype, bucket_bytes=int(args.bucket_mb * 2**20), in_flight=args.in_flight,
                          staging=args.staging, checksum=args.checksum, trainer_params=args.trainer_params, verify=not args.no_verify, timeout_s=args.timeout)
    result = run_refit_bench(spec, on_event=lambda rank, kind, v: print(f"rank {rank}: {kind} {v or ''}",
                                                                           file=sys.stderr, flush=True))
    write_json(args.json, result, echo=True)
    return 0 if result["bit_exact"] in (True, None) else 1


def _bench_delta(args: argparse.Namespace) -> int:
    from policyworker.cli.delta_bench import DeltaBenchSpec, run_delta_bench

    spec = DeltaBenchSpec(preset=args.preset, train=args.train, gen=args.gen, dtype=args.dtype,
                          real_steps=args.real_steps, timeout_s=args.timeout)
    result = run_delta_bench(spec, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    write_json(args.json, result, echo=True)
    return 0 if result["bit_exact"] else 1


def _bench_zmq(args: argparse.Namespace) -> int:
    import torch

    from policyworker.cli.zmq_bench import run_zmq_bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = run_zmq_bench(args.preset, args.dtype, args.refits, device)
    write_json(args.json, result, echo=True)
    return 0 if result.get("bit_exact") else 1


def _cmd_drill(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from policyworker.cli.drill import SCENARIOS, run_drill

    names = args.scenario or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        from policyworker.errors import ConfigError

        raise ConfigError(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    console = Console()
    console.print(f"[bold]policyworker drill[/]: {len(names)} fault scenarios over nccl_reshard (2 trainers tp=2 "
                  "-> 2 rollouts tp=2, gloo), zmq (a colocated pair) and sglang_ipc (2 trainers -> an in-process "
                  f"engine); the fault hits refit v2 of 3; {args.jobs} at a time")

    def on_row(row) -> None:
        mark = "[green]pass[/]" if row["passed"] else "[red]FAIL[/]"
        console.print(f"  {mark} {row['name']}: detected {', '.join(row['errors'])}"
                      + (f" after {row['detect_seconds']:.2f}s" if row["detect_seconds"] is not None else ""))

    with console.status("running scenarios in real processes…"):
        result = run_drill(names, on_row=on_row, jobs=args.jobs)
    table = Table(title="fault drill")
    table.add_column("scenario", no_wrap=True)
    table.add_column("transport", no_wrap=True)
    for col in ("passed", "detect s", "served torn", "recovered", "errors"):
        table.add_column(col)
    for row in result["scenarios"]:
        table.add_row(row["name"], row.get("transport", "?"), "yes" if row["passed"] else "NO",
                      "-" if row["detect_seconds"] is None else f"{row['detect_seconds']:.3f}",
                      str(row["served_torn"]).lower(), str(row["recovered"]).lower(), ", ".join(row["errors"]))
    console.print(table)
    if args.json:
        write_json(args.json, result)
        console.print(f"wrote {args.json}")
    return 0 if result["passed"] else 1


def _cmd_plan(args: argparse.Namespace) -> int:
    from policyworker.layout.fabric import load_fabric
    from policyworker.layout.report import format_plan_report, plan_report

    fabric = load_fabric(args.fabric) if args.fabric else None
    bucket = int(args.bucket_mb * 2**20) if args.bucket_mb is not None else None
    report = plan_report(model_config(args.preset), args.train, args.gen, fabric=fabric, bucket_bytes=bucket)
    print(format_plan_report(report))
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="policyworker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run trainers and rollouts on this host (CPU, gloo) and refit")
    p.add_argument("--json", metavar="PATH", type=json_path, help="also write the results as JSON")
    p.add_argument("--preset", help="model preset (default small)")
    p.add_argument("--train", help="training layout (default tp=2,pp=2)")
    p.add_argument("--gen", help="generation layout (default tp=2,dp=2)")
    p.add_argument("--refits", type=int_at_least(2), default=6, help="refits, >= 2 (the first is cold and "
                   "reported apart)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="bound on each step of the world (s)")
    p.add_argument("--engine", choices=["rollout", "vllm"], default="rollout",
                   help="vllm: refit a real vLLM engine (needs policyworker[vllm]) and compare its tokens with HF's")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="measure a transport against its same-run ceiling; prints JSON")
    p.add_argument("--transport", choices=["nccl_reshard", "zmq"])
    p.add_argument("--engine", choices=["vllm"], help="vllm: refit a real vLLM engine (nccl_reshard) vs its "
                   "same-run gloo ceiling and a safetensors checkpoint + vLLM reload_weights")
    p.add_argument("--lora", type=int, metavar="RANK", help="--engine vllm: refit a rank-RANK LoRA adapter "
                   "(backend policyworker-lora) against full refits of the model, same run")
    p.add_argument("--engines", type=int, choices=[1, 2], default=1, help="--engine vllm: 2 refits two tp=1 "
                   "engines on one update group against one engine, same trainers, same run (--refits rounds)")
    p.add_argument("--overlap", action="store_true", help="--engine vllm: the engine's longest stall and "
                   "tokens/s under a continuous load (AsyncLLM) during overlapped and paused refits, alternating")
    p.add_argument("--plot", metavar="PATH", type=json_path, help="--overlap: also write a PNG timeline of one "
                   "overlapped and one paused refit (needs policyworker[plot])")
    p.add_argument("--vllm-train", default="tp=2", help="--engine vllm: trainer layout")
    p.add_argument("--vllm-tp", type=int, default=1, help="--engine vllm: vLLM tensor_parallel_size")
    p.add_argument("--vllm-executor", choices=["mp", "uni"], default="mp",
                   help="--engine vllm: vLLM's executor: mp (its default: an engine-core process) or uni "
                        "(the worker in this process; tp=1)")
    p.add_argument("--vllm-cpu-linear", choices=["prepack", "torch", "background"], default="prepack",
                   help="--engine vllm: init_info.cpu_linear (prepack: vLLM's oneDNN kernels, a prepack per "
                        "commit; torch: its plain F.linear path reads the received tensors; background: torch "
                        "at commit, then prepacked on a background thread)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="zmq: where the pair runs (default: cuda if present)")
    p.add_argument("--preset", default="small")
    p.add_argument("--train", default="tp=2,pp=2")
    p.add_argument("--gen", default="tp=2,dp=2")
    p.add_argument("--refits", type=int_at_least(2), default=6, help="refits, >= 2 (the first is cold and "
                   "reported apart)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bucket-mb", type=positive_float, default=16.0)
    p.add_argument("--in-flight", type=int_at_least(1), default=16, help="messages outstanding per rank")
    p.add_argument("--staging", type=_staging_arg, default=2, help="nccl_reshard: staging buffers of --bucket-mb per "
                   "rank; --engine vllm: a staging mode (device, host, none, none-torch: none with cpu_linear=torch) "
                   "or all, measured per mode")
    p.add_argument("--checksum", action="store_true")
    p.add_argument("--trainer-params", choices=["flat", "views"], default="flat",
                   help="nccl_reshard: trainers hold their shards in one buffer, or send views of a full model")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact check (large presets)")
    p.add_argument("--delta", action="store_true",
                   help="nccl_reshard: delta refits at several changed fractions vs full refits, same run")
    p.add_argument("--real-steps", type=int_at_least(1), default=3,
                   help="--delta: AdamW steps (lr 1e-6) of the toy model for the measured changed fraction")
    p.add_argument("--timeout", type=positive_float, default=300.0)
    p.add_argument("--json", metavar="PATH", type=json_path)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("transports", help="list registered transports (imports none unless --load)")
    p.add_argument("--load", action="store_true",
                   help="import each one; report broken plugins and exit 1 when there is any")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_transports)

    p = sub.add_parser("drill", help="run fault scenarios (kill, stall, corrupt, ...) and check recovery")
    p.add_argument("--scenario", action="append", help="run only this scenario (repeatable)")
    p.add_argument("--json", metavar="PATH", type=json_path)
    p.add_argument("--jobs", type=int_at_least(1), default=2, help="scenarios run at the same time (default 2; each "
                   "mostly waits on deadlines and process starts)")
    p.set_defaults(func=_cmd_drill)

    p = sub.add_parser("plan", help="print the reshard plan's byte counts for a model and layouts")
    p.add_argument("--preset", "--model", dest="preset", required=True, metavar="PRESET|PATH",
                   help="a preset's name, or a Hugging Face config.json / model directory")
    p.add_argument("--train", required=True, help="e.g. tp=2,pp=2,dp=1")
    p.add_argument("--gen", required=True, help="e.g. tp=4,dp=1")
    p.add_argument("--fabric", metavar="FILE",
                   help="fabric file (JSON/TOML: GPUs per node, NVLink/NIC GB/s, placement): "
                        "print the modelled refit time of the plan, a rank-0 broadcast and full tensors")
    p.add_argument("--bucket-mb", type=positive_float, help="with --fabric: bucket size (default: the file's)")
    p.add_argument("--json", metavar="PATH", type=json_path)
    p.set_defaults(func=_cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from policyworker.errors import PolicyWorkerError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PolicyWorkerError as exc:
        print(f"policyworker {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
