"""The benchmark split learning adds to the command line, ``edgeswarm bench splitfed``: its arguments, checks and
tables (the measurements live in ``splitfed.bench_splitfed``, imported when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from edgeswarm.errors import ConfigError
from edgeswarm.profiling.host_load import busy_cell
from edgeswarm.profiling.verdict import verdict, verdict_lines
from edgeswarm.workloads.commands import Bench, CommandTools

if TYPE_CHECKING:
    from rich.table import Table

    from edgeswarm.splitfed.bench_splitfed import SplitfedBenchConfig, SplitfedReport

MIB = 1 << 20


class SplitfedBench(Bench):
    name = "splitfed"
    help = ("SmartSplit against FedAvg and SplitFed: planner quality, round time, WAN bytes, participation, device "
            "memory and simulated accuracy")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--sections", default="planner,memory,accuracy",
                       help="comma-separated: planner, memory, accuracy, cluster (default: the first three, about 4 "
                       "minutes on 2 cores; cluster starts a local cluster of 3 emulated phones and an edge server)")
        p.add_argument("--seeds", default="0",
                       help="comma-separated seeds (the planner and simulation repeat per seed)")
        p.add_argument("--rounds", type=int, default=20, help="simulated rounds per method and setting")
        p.add_argument("--local-epochs", type=int, default=5, help="simulated local epochs per round (the spec's 5)")
        p.add_argument("--lr", type=float, default=0.05, help="the simulation's SGD learning rate (momentum 0.9)")
        p.add_argument("--settings", default="dirichlet-0.1,dirichlet-1.0,label-skew-2",
                       help="the simulation's data splits: dirichlet-0.1, dirichlet-1.0, label-skew-2, iid")
        p.add_argument("--cluster-rounds", type=int, default=3, help="rounds of each mode's job on the cluster")
        p.add_argument("--instances", type=int, default=50, help="random instances of the BO quality check (U6)")
        p.add_argument("--quick", action="store_true",
                       help="a few seconds: 5 BO instances, LeNet-5 only, 2 simulated rounds on one setting")
        p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
        p.add_argument("--netns", action="store_true", help="the cluster section in network namespaces, its links "
                       "shaped by the kernel (root; docs/netns.md)")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        """Print the tables, and write the report as JSON with --json."""
        from edgeswarm.splitfed.bench_splitfed import run_splitfed_bench

        config = splitfed_config(args)
        report = run_splitfed_bench(config, log=tools.log, cluster=tools.cluster)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(report.model_dump_json(indent=2))
        for table in splitfed_tables(report):
            tools.console.print(table)
        if report.budget_note:
            tools.console.print(report.budget_note, highlight=False)
        cells = [c for r in report.cluster if (c := r.cell()) is not None]
        for line in verdict_lines(verdict(cells), "round-time cells"):
            tools.console.print(line, highlight=False)
        return 0


def splitfed_config(args: argparse.Namespace) -> SplitfedBenchConfig:
    """The configuration from the arguments. Raises ConfigError."""
    from pydantic import ValidationError

    from edgeswarm.splitfed.bench_splitfed import SECTIONS, SplitfedBenchConfig
    from edgeswarm.splitfed.simulation import SETTINGS

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [f"section {s}" for s in sections if s not in SECTIONS] + \
          [f"setting {s}" for s in settings if s not in SETTINGS]
    if bad or not sections:
        raise ConfigError(f"unknown {', '.join(bad) or 'nothing'}: sections {', '.join(SECTIONS)}; settings "
                          f"{', '.join(SETTINGS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds: {args.seeds!r} is not a comma-separated list of integers") from None
    extra: dict[str, object] = {}
    if args.quick:
        extra = {"instances": min(args.instances, 5), "models": ["lenet5"], "memory_models": ["lenet5"],
                 "rounds": min(args.rounds, 2), "settings": settings[:1], "devices": 20, "mecs": 2}
    try:
        return SplitfedBenchConfig(**{"sections": sections, "seeds": seeds, "instances": args.instances,
                                      "rounds": args.rounds, "local_epochs": args.local_epochs, "lr": args.lr,
                                      "settings": settings, "cluster_rounds": args.cluster_rounds,
                                      "netns": args.netns, **extra})
    except ValidationError as exc:
        raise ConfigError(f"bad bench splitfed options: {exc}") from None


def _mean(values: list[float | None]) -> float | None:
    from edgeswarm.splitfed.bench_splitfed import mean_of

    return mean_of([v for v in values if v is not None])


def _last(accuracies: list[float], rounds: int = 5) -> float:
    """The mean held-out accuracy of the last ``rounds`` rounds: one round's 10 non-IID trainers swing it."""
    tail = accuracies[-rounds:]
    return sum(tail) / len(tail) if tail else 0.0


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def splitfed_tables(report: SplitfedReport) -> list[Table]:
    """The report's tables: U6, round time and WAN bytes (ratios against SmartSplit), I6, I1, accuracy."""
    from rich.table import Table

    from edgeswarm.splitfed.bench_splitfed import METHODS

    tables = []
    if report.quality:
        t = Table(title="U6: BO against exhaustive search on random instances")
        for col in ("seed", "instances", "within 2%", "mean gap", "worst gap", "evaluations / |chi|",
                    "worse than initial"):
            t.add_column(col)
        for seed, q in zip(report.config.seeds, report.quality, strict=False):
            t.add_row(str(seed), str(q.instances), f"{100 * q.within:.0f}%", f"{100 * q.mean_gap:.2f}%",
                      f"{100 * q.worst_gap:.2f}%", f"{q.evaluations}/{q.space}", str(q.worse_than_initial))
        tables.append(t)
    if report.planner:
        t = Table(title=f"I2/I5: one planned round on the paper's fleet ({report.config.participants} "
                  "participants, mean over seeds; ratios against SmartSplit)")
        for col in ("model", "method", "cuts", "round s", "time x", "WAN MiB", "WAN x", "LAN MiB"):
            t.add_column(col)
        for model in report.config.models:
            rows = {m: [r for r in report.planner if r.model == model and r.method == m] for m in METHODS}
            base_t = _mean([r.round_s for r in rows["smartsplit"]])
            base_w = _mean([float(r.wan_bytes) for r in rows["smartsplit"] if r.error is None])
            for m in METHODS:
                ok = [r for r in rows[m] if r.error is None]
                if not ok:
                    t.add_row(model, m, "-", "cannot plan", "-", "-", "-", "-")
                    continue
                rt = _mean([r.round_s for r in ok])
                wan = _mean([float(r.wan_bytes) for r in ok])
                lan = _mean([float(r.lan_bytes) for r in ok])
                cuts = sorted({c for r in ok for c in r.cuts})
                t.add_row(model, m, ",".join(map(str, cuts)), _f(rt), _f(rt / base_t if rt and base_t else None),
                          _f(wan / MIB if wan is not None else None, "{:.1f}"),
                          _f(wan / base_w if wan and base_w else None, "{:.1f}"),
                          _f(lan / MIB if lan is not None else None, "{:.1f}"))
        tables.append(t)
    if report.cap:
        cap = report.config.cap_bytes // MIB
        t = Table(title=f"I6: participants of {report.config.participants} with every budget <= {cap} MiB "
                  f"({report.config.cap_model})")
        for col in ("method", "seed", "participants", "devices that fit"):
            t.add_column(col)
        for r in report.cap:
            t.add_row(r.method, str(r.seed), str(r.participants), str(r.eligible))
        tables.append(t)
    if report.memory:
        t = Table(title="I1: device peak training memory, measured (one U-split iteration, batch 32)")
        for col in ("model", "units", "cut", "split MiB", "whole MiB", "whole / split", "modelled split MiB",
                    "modelled whole MiB"):
            t.add_column(col)
        for r in report.memory:
            t.add_row(r.model, str(r.units), str(r.cut), f"{r.split_peak_bytes / MIB:.2f}",
                      f"{r.local_peak_bytes / MIB:.2f}", f"{r.ratio:.1f}x", f"{r.split_model_bytes / MIB:.2f}",
                      f"{r.local_model_bytes / MIB:.2f}")
        tables.append(t)
    if report.accuracy:
        t = Table(title=f"Held-out accuracy after {report.config.rounds} simulated rounds (LeNet-5, digits, "
                  f"{report.config.devices} devices, {report.config.mecs} MECs, mean over seeds)")
        for col in ("setting", "method", "accuracy", "mean of the last 5 rounds", "best round", "trainers / round",
                    "never fit"):
            t.add_column(col)
        for setting in report.config.settings:
            for m in METHODS:
                rows = [r for r in report.accuracy if r.setting == setting and r.method == m]
                if not rows:
                    continue
                t.add_row(setting, m, f"{100 * float(sum(r.accuracy for r in rows) / len(rows)):.1f}%",
                          f"{100 * float(sum(_last(r.accuracies) for r in rows) / len(rows)):.1f}%",
                          f"{100 * float(sum(max(r.accuracies) for r in rows) / len(rows)):.1f}%",
                          f"{sum(r.mean_participants for r in rows) / len(rows):.1f}",
                          f"{sum(r.excluded_devices for r in rows) / len(rows):.0f}")
        tables.append(t)
    if report.cluster:
        where = "in network namespaces (kernel-shaped links)" if report.config.netns else "on a local cluster"
        t = Table(title=f"train-splitfed jobs {where} (3 emulated phones, 1 edge server, LeNet-5 on digits, 2 "
                  "participants a round)")
        for col in ("mode", "round", "cuts", "round s", "predicted s", "refitted s", "LAN KiB", "WAN KiB",
                    "accuracy", "device peak MiB", "host busy", "error"):
            t.add_column(col)
        for r in report.cluster:
            t.add_row(r.mode, str(r.round), ",".join(map(str, r.cuts)), f"{r.round_s:.2f}", f"{r.predicted_s:.2f}",
                      "-" if r.refitted_s is None else f"{r.refitted_s:.2f}",
                      f"{r.lan_bytes / 1024:.0f}", f"{r.wan_bytes / 1024:.0f}",
                      "-" if r.accuracy is None else f"{100 * r.accuracy:.1f}%", f"{r.peak_bytes / MIB:.2f}",
                      busy_cell(r.host_busy), r.error or "")
        tables.append(t)
    return tables
