"""The benchmark pipelined serving adds to the command line, ``edgeswarm bench serving``: measured on emulated
Asteroid environments (``pipeline_serve.bench_serving``), or with ``--sim`` the partition-placement paper's simulation
grid against its published numbers (``pipeline_serve.bench_sim``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from edgeswarm.errors import ConfigError
from edgeswarm.profiling.host_load import busy_cell
from edgeswarm.profiling.verdict import verdict, verdict_lines
from edgeswarm.workloads.commands import Bench, CommandTools


class ServingBench(Bench):
    name = "serving"
    help = ("pipelined serving measured on emulated Asteroid environments "
            "(planned, greedy-joint, single device); --sim: the partition-placement paper's "
            "simulation grid against its published numbers")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--sim", action="store_true", help="the simulation grid (simulated graphs, Keras-like models)")
        p.add_argument("--netns", action="store_true", help="on a namespace cluster (root; docs/netns.md)")
        p.add_argument("--quick", action="store_true", help="--sim: fewer trials and node counts (seconds); "
                       "measured: environment d only, fewer requests")
        p.add_argument("--trials", type=int, default=50, help="--sim: graphs per configuration (default 50)")
        p.add_argument("--ratio-trials", type=int, default=1000, help="--sim: graphs per model for the LB ratio (R6)")
        p.add_argument("--kpath", choices=("exact", "colour"), default="exact", help="--sim: K_PATH back-end")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--envs", default="a,b,c,d", help="measured: Asteroid environments at 100 Mbps")
        p.add_argument("--model", default="mobilenetv2", help="measured: zoo model (image_size 32, 10 classes)")
        p.add_argument("--micro-batch", type=int, default=8, help="measured: samples per request and micro-batch")
        p.add_argument("--requests", type=int, default=200, help="measured: requests per variant")
        p.add_argument("--profile-dir", default=None, help="measured: where profiles are cached (default: a "
                       "temporary folder)")
        p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        return _simulated(args, tools) if args.sim else _measured(args, tools)


def _simulated(args: argparse.Namespace, tools: CommandTools) -> int:
    """The partition-placement grid against the paper's reference numbers."""
    from edgeswarm.pipeline_serve.bench_sim import NODES, serving_report

    trials = min(args.trials, 5) if args.quick else args.trials
    ratio_trials = min(args.ratio_trials, 50) if args.quick else args.ratio_trials
    nodes = (5, 50) if args.quick else NODES
    report = serving_report(trials, ratio_trials, nodes=nodes, seed=args.seed, kpath=args.kpath,
                            progress=tools.log)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    table = Table(title=f"mean bottleneck beta (s), reference mode, C = 20, {trials} trials; ours / paper (spec 6.3)")
    for col in ("model", "cap MB", "nodes", "parts", "k-path", "paper", "greedy", "paper", "random", "paper"):
        table.add_column(col, justify="left" if col == "model" else "right")

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    for row in report["grid"]:
        ref = row["reference"]
        status = row["partition"]["status"]
        parts = str(row["partition"]["parts"]) if status in ("ok", "single_partition") else status
        table.add_row(row["model"], str(row["cap_mb"]), str(row["nodes"]), parts, f(row["kpath"]["mean"]),
                      f(ref["kpath"]), f(row["greedy"]["mean"]), f(ref["greedy"]), f(row["random"]["mean"]),
                      f(ref["random"]))
    tools.console.print(table)
    r3 = report["r3"]
    tools.console.print(f"R3: {sum(r['within_20pct'] for r in r3)}/{len(r3)} configs within 20% of the paper's k-path")
    r4 = report["r4"]
    if r4["per_config"]:
        worst = min(r["random_over_kpath"] for r in r4["per_config"])
        gap = max(abs(r["kpath_vs_greedy"]) for r in r4["per_config"])
        tools.console.print(f"R4 at {r4['nodes']} nodes: random/k-path >= {worst:.1f}x per config, matched means "
                            f"{r4['random_over_kpath_matched']:.1f}x (paper 7.9x); k-path vs greedy matched "
                            f"{r4['kpath_vs_greedy_matched']:+.1%} (paper -3.6%), worst config {gap:.1%}; "
                            f"published-style random {r4['published_style']['random_vs_kpath']:+.0%} (paper +983%), "
                            f"greedy {r4['published_style']['greedy_vs_kpath']:+.0%} (paper +33%)")
    r6 = report["r6"]
    tools.console.print("R6 LB ratio (50 nodes, 64 MB): " + ", ".join(
        f"{m} {f(v)} (paper {r6['reference'].get(m, '-')})" for m, v in r6["per_model"].items())
        + f"; mean {f(r6['mean'])}")
    flagged = [r for r in report["r7"] if r["flag"]]
    over = [r for r in report["r7"] if r["normative_over_capacity"]]
    tools.console.print(f"R7: normative over capacity in {len(over)} configs (must be 0); reference over capacity in "
                        f"{sum(r['reference_over_capacity'] for r in report['r7'])}; {len(flagged)} configs differ by "
                        f"more than 25%: " + ", ".join(f"{r['model']} {r['cap_mb']} MB {r['nodes']} nodes "
                                                 f"{r['difference']:+.0%}" for r in flagged))
    return 0


def _measured(args: argparse.Namespace, tools: CommandTools) -> int:
    """Each variant served on emulated Asteroid environments, measured on the stage-workers."""
    import tempfile

    from edgeswarm.pipeline_serve.bench_serving import run_serving_bench
    from edgeswarm.values.profiles import ModelSpec

    envs = ["d"] if args.quick else [e.strip() for e in args.envs.split(",") if e.strip()]
    unknown = [e for e in envs if e not in ("a", "b", "c", "d")]
    if unknown or not envs:
        raise ConfigError(f"--envs: Asteroid's environments are a, b, c and d, not {', '.join(unknown) or 'none'}")
    if args.micro_batch < 1 or args.requests < 1:
        raise ConfigError("--micro-batch and --requests must be at least 1")
    model = ModelSpec(name=args.model, config={"image_size": 32, "num_classes": 10})
    with tempfile.TemporaryDirectory(prefix="edgeswarm-bench-serving-") as tmp:
        rows = run_serving_bench(envs, model=model, micro_batch=args.micro_batch,
                                 requests=50 if args.quick else args.requests,
                                 profile_dir=Path(args.profile_dir or tmp), netns=args.netns,
                                 cluster=tools.cluster, log=tools.log)
    if args.json:
        Path(args.json).write_text(json.dumps([r.model_dump() | {"ratio": r.ratio} for r in rows], indent=2))
    table = Table(title=f"{model.name} served on Asteroid environments at 100 Mbps, micro-batch {args.micro_batch}: "
                        "measured on the stage-workers" + (" in network namespaces" if args.netns else ""))
    for col in ("env", "variant", "stages", "devices", "predicted samples/s", "measured samples/s",
                "measured / predicted", "measured / refitted", "over single device", "p50 ms",
                "p50 ms predicted", "p99 ms", "host busy"):
        table.add_column(col, justify="left" if col in ("env", "variant", "devices") else "right")
    single = {r.env: r.measured_per_s for r in rows if r.variant == "single" and r.measured_per_s}
    for r in rows:
        if r.error:
            table.add_row(r.env, r.variant, "-", escape(r.error[:60]), *["-"] * 9)
            continue
        base = single.get(r.env)
        table.add_row(r.env, r.variant, str(r.stages), ",".join(r.devices), f"{r.predicted_per_s:.1f}",
                      f"{r.measured_per_s:.1f}", f"{r.ratio:.2f}x" if r.ratio else "-",
                      f"{r.measured_per_s / r.refitted_per_s:.2f}x" if r.measured_per_s and r.refitted_per_s else "-",
                      f"{r.measured_per_s / base:.2f}x" if base and r.measured_per_s else "-",
                      f"{(r.p50_s or 0) * 1000:.0f}",
                      f"{r.predicted_p50_s * 1000:.0f}" if r.predicted_p50_s is not None else "-",
                      f"{(r.p99_s or 0) * 1000:.0f}", busy_cell(r.host_busy))
    tools.console.print(table)
    for line in verdict_lines(verdict([c for r in rows if (c := r.cell()) is not None]), "throughput cells"):
        tools.console.print(line, highlight=False)
    return 0 if all(r.error is None for r in rows) else 1
