"""The benchmarks HPP training adds to the command line: ``edgeswarm bench training`` (every strategy trained on
emulated Asteroid environments, and the closed loop correcting a wrong profile), ``recovery`` (a device dropped
mid-round, light against heavy recovery), ``planner`` (planning time and Asteroid's Table 4) and ``compute`` (one
stage's step on the accelerator against the CPU). Their measurements live in the ``bench_*`` modules beside this one,
imported when one runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from edgeswarm.errors import ConfigError
from edgeswarm.profiling.host_load import busy_cell
from edgeswarm.profiling.verdict import verdict, verdict_lines
from edgeswarm.workloads.commands import Bench, CommandTools, report_file

if TYPE_CHECKING:
    from edgeswarm.hpp.bench_misprofiled import MisprofiledRun
    from edgeswarm.hpp.bench_training import StrategyRun
    from edgeswarm.values.profiles import ModelSpec

SECTIONS = ("strategies", "misprofiled")


class TrainingBench(Bench):
    name = "training"
    help = ("hpp, dp, pp and single trained on emulated Asteroid environments: measured samples/s against the "
            "planner's prediction; the closed loop correcting a wrong profile")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--sections", default="strategies",
                       help="comma-separated: strategies (every strategy against its prediction), misprofiled (a "
                            "job started on speeds wrong about one device and one link, corrected by the closed loop)")
        p.add_argument("--envs", default="a,b,d", help="comma-separated Asteroid environments (at 100 Mbps)")
        p.add_argument("--model", default="mobilenetv2", help="a zoo model")
        p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                       help="model config override (repeatable; default for mobilenetv2: image_size=32)")
        p.add_argument("--strategies", default="hpp,dp,pp,single", help="comma-separated strategies")
        p.add_argument("--global-batch", type=int, default=64)
        p.add_argument("--micro-batches", type=int, default=4, help="M for every strategy (0: the planner picks)")
        p.add_argument("--rounds", type=int, default=4, help="rounds per strategy (the first is not timed)")
        p.add_argument("--learn-rounds", type=int, default=6,
                       help="misprofiled: rounds of the job that learns the correct speeds")
        p.add_argument("--loop-rounds", type=int, default=14, help="misprofiled: rounds of the job on wrong speeds")
        p.add_argument("--device-factor", type=float, default=3.0,
                       help="misprofiled: how many times faster than measured one device's speed is saved")
        p.add_argument("--link-factor", type=float, default=5.0,
                       help="misprofiled: how many times faster than measured one link's speed is saved")
        p.add_argument("--profile-dir", default="out/profile-cache", help="the devices' shared profile cache")
        p.add_argument("--out", type=report_file, default=None, help="also write the JSON report to this file")
        p.add_argument("--netns", action="store_true", help="on a namespace cluster: every node its own host, "
                       "broker and kernel-shaped links (root; see docs/netns.md)")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        """Every strategy trained on each environment, measured against predicted; and/or the closed loop on wrong
        speeds."""
        from edgeswarm.hpp.bench_training import DEFAULT_MODEL
        from edgeswarm.values.profiles import ModelSpec, parse_config

        sections = [s.strip() for s in args.sections.split(",") if s.strip()]
        unknown = [s for s in sections if s not in SECTIONS]
        if unknown or not sections:
            raise ConfigError(f"--sections {args.sections}: choose from {', '.join(SECTIONS)}")
        if min(args.learn_rounds, args.loop_rounds) < 2 or min(args.device_factor, args.link_factor) < 1:
            raise ConfigError("--learn-rounds and --loop-rounds must be at least 2, --device-factor and "
                              "--link-factor at least 1")
        config = parse_config(args.config)
        model = DEFAULT_MODEL if args.model == DEFAULT_MODEL.name and not config else ModelSpec(name=args.model,
                                                                                                 config=config)
        report: dict[str, list[dict[str, object]]] = {}
        failed = False
        if "strategies" in sections:
            rows = self._strategies(args, tools, model)
            report["strategies"] = [r.model_dump() for r in rows]
            failed = any(r.error is not None for r in rows)
        if "misprofiled" in sections:
            runs = self._misprofiled(args, tools, model)
            report["misprofiled"] = [r.model_dump() for r in runs]
            failed = failed or any(r.error is not None for r in runs)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
        return 1 if failed else 0  # the tables say which, and why

    def _strategies(self, args: argparse.Namespace, tools: CommandTools, model: ModelSpec) -> list[StrategyRun]:
        from edgeswarm.hpp.bench_training import run_training_bench

        rows = run_training_bench(args.envs.split(","), model=model, global_batch=args.global_batch,
                                  micro_batches=args.micro_batches or None, rounds=args.rounds,
                                  strategies=tuple(args.strategies.split(",")), profile_dir=Path(args.profile_dir),
                                  cluster=tools.cluster, netns=args.netns, log=tools.log)
        t = Table(title=f"{model.name}, global batch {args.global_batch}: measured on emulated devices"
                        + (" in network namespaces (kernel-shaped links)" if args.netns else "")
                        + " against the planner's prediction")
        for col in ("env", "strategy", "stages", "M x B", "predicted (s)", "measured (s)", "measured / predicted",
                    "measured / refitted", "samples/s", "HPP speed-up", "compute / profile", "replayed (s)",
                    "measured / replayed", "host busy", "overhead per micro-batch"):
            t.add_column(col, justify="left" if col in ("env", "strategy") else "right")
        hpp = {r.env: r.measured_sps for r in rows if r.strategy == "hpp" and r.measured_sps}
        for r in rows:
            if r.error is not None:
                t.add_row(r.env.upper(), r.strategy, "-", "-", "-", "failed", *["-"] * 8, r.error[:40])
                continue
            assert r.measured_round_s and r.measured_sps and r.replayed_round_s and r.ratio
            speedup = hpp.get(r.env)
            t.add_row(r.env.upper(), r.strategy, str(r.stages), f"{r.micro_batches} x {r.micro_batch_size}",
                      f"{r.predicted_round_s:.3f}", f"{r.measured_round_s:.3f}", f"{r.ratio:.2f}x",
                      f"{r.measured_round_s / r.refitted_round_s:.2f}x" if r.refitted_round_s else "-",
                      f"{r.measured_sps:.1f}", f"{speedup / r.measured_sps:.2f}x" if speedup else "-",
                      f"{r.compute_ratio:.2f}x", f"{r.replayed_round_s:.3f}",
                      f"{r.measured_round_s / r.replayed_round_s:.2f}x", busy_cell(r.host_busy),
                      f"{1000 * (r.overhead_per_micro_batch_s or 0):.2f} ms")
        tools.console.print(t)
        for line in verdict_lines(verdict([c for r in rows if (c := r.cell()) is not None]), "round-time cells"):
            tools.console.print(line, highlight=False)
        return rows

    def _misprofiled(self, args: argparse.Namespace, tools: CommandTools, model: ModelSpec) -> list[MisprofiledRun]:
        from edgeswarm.hpp.bench_misprofiled import run_misprofiled_bench

        runs = [run_misprofiled_bench(env, model=model, global_batch=args.global_batch,
                                      micro_batches=args.micro_batches or None, learn_rounds=args.learn_rounds,
                                      rounds=args.loop_rounds, device_factor=args.device_factor,
                                      link_factor=args.link_factor, profile_dir=Path(args.profile_dir),
                                      cluster=tools.cluster, netns=args.netns, log=tools.log)
                for env in args.envs.split(",")]
        t = Table(title=f"{model.name}: a job started on speeds wrong about one device and one link, corrected by "
                        "the closed loop" + (" (network namespaces)" if args.netns else ""))
        for col in ("env", "wrong about", "first plan: predicted / on the measured speeds (s)", "re-planned at round",
                    "ended on the correct plan (a class's devices alike)",
                    "last plan / correct plan, on the measured speeds",
                    "after: measured / predicted", "measured / refitted"):
            t.add_column(col, justify="left" if col in ("env", "wrong about", "re-planned at round") else "right")
        for r in runs:
            if r.error is not None:
                t.add_row(r.env.upper(), "-", "failed", r.error[:60], *["-"] * 4)
                continue
            assert r.started_predicted_s and r.started_true_s and r.final_true_s and r.correct_true_s
            t.add_row(r.env.upper(), f"{r.device} {r.device_factor:g}x, {r.link} {r.link_factor:g}x",
                      f"{r.started_predicted_s:.3f} / {r.started_true_s:.3f}",
                      ", ".join(str(p.round) for p in r.replans) or "never",
                      "yes" if r.ended_on_correct else "no", f"{r.final_true_s / r.correct_true_s:.2f}x",
                      _ratio(r.after_measured_s, r.after_predicted_s), _ratio(r.after_measured_s, r.after_refitted_s))
        tools.console.print(t)
        for r in runs:
            for p in r.replans:
                tools.console.print(f"{r.env.upper()}, round {p.round}: {p.detail}", highlight=False)
        return runs


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


class RecoveryBench(Bench):
    name = "recovery"
    help = ("drop each device of emulated Env D mid-round: detection "
            "time, light against heavy recovery, throughput after")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--env", default="d", help="the Asteroid environment (at 100 Mbps)")
        p.add_argument("--model", default="efficientnet-b1", help="a zoo model (AC-20: EfficientNet-B1)")
        p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                       help="model config (repeatable; default: image_size=32 num_classes=10)")
        p.add_argument("--victims", default="", help="comma-separated devices to drop (default: each in turn)")
        p.add_argument("--modes", default="light,heavy", help="comma-separated recovery modes")
        p.add_argument("--rounds", type=int, default=9, help="rounds per run")
        p.add_argument("--kill-round", type=int, default=3, help="the round during which the device dies")
        p.add_argument("--profile-dir", default="out/profile-cache", help="the devices' shared profile cache")
        p.add_argument("--out", type=report_file, default=None, help="also write the JSON report to this file")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        """Each device dropped in turn, light against heavy recovery."""
        from edgeswarm.hpp.bench_recovery import DEFAULT_MODEL, run_recovery_bench
        from edgeswarm.values.profiles import ModelSpec, parse_config

        model = ModelSpec(name=args.model, config=parse_config(args.config) or dict(DEFAULT_MODEL.config))
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        victims = [v.strip() for v in args.victims.split(",") if v.strip()] or None
        rows = run_recovery_bench(args.env, victims=victims, modes=modes, model=model, rounds=args.rounds,
                                  kill_round=args.kill_round, profile_dir=Path(args.profile_dir), cluster=tools.cluster,
                                  log=tools.log)
        t = Table(title=f"{model.name} on Env {args.env.upper()}: a device dropped during round {args.kill_round}")
        for col in ("dropped", "mode", "stages after", "detection", "recovery", "heavy / light", "moved",
                    "round before", "round after", "after / heavy after"):
            t.add_column(col, justify="left" if col in ("dropped", "mode", "stages after") else "right")
        heavy = {r.victim: r for r in rows if r.mode == "heavy" and r.error is None}
        for r in rows:
            if r.error is not None:
                t.add_row(r.victim, r.mode, "failed", "-", "-", "-", "-", "-", "-", r.error[:40])
                continue
            h = heavy.get(r.victim)
            speedup = f"{h.recovery_s / r.recovery_s:.1f}x" if h and r.recovery_s and h.recovery_s else "-"
            after = (f"{h.after_round_s / r.after_round_s:.0%}" if h and h.after_round_s and r.after_round_s else "-")
            t.add_row(r.victim, r.mode, " | ".join(",".join(s) for s in r.stages_after), f"{r.detection_s or 0:.2f} s",
                      f"{r.recovery_s or 0:.2f} s", speedup, f"{(r.moved_bytes or 0) / 1e6:.1f} MB",
                      f"{r.before_round_s or 0:.3f} s", f"{r.after_round_s or 0:.3f} s", after)
        tools.console.print(t)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps([r.model_dump() for r in rows], indent=2))
        return 0 if all(r.error is None for r in rows) else 1


class PlannerBench(Bench):
    name = "planner"
    help = ("planning time, and predicted speed-ups next to Asteroid's Table 4")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--time-only", action="store_true", help="only the planning-time part (seconds)")
        p.add_argument("--models", default=None, help="comma-separated Table 4 models (default: all four)")
        p.add_argument("--envs", default="a,b,c,d", help="comma-separated Asteroid environments")
        p.add_argument("--profiles", default="out/table4-profiles",
                       help="folder of cluster profiles: read when present, written when measured")
        p.add_argument("--profile-dir", default="out/profile-cache", help="the devices' shared profile cache")
        p.add_argument("--out", type=report_file, default=None, help="also write the JSON report to this file")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        """Planning time, then (unless --time-only) the Table 4 speed-ups."""
        from edgeswarm.hpp.bench_planner import planning_time, table4

        report: dict[str, object] = {}
        rows = planning_time()
        t = Table(title="planning time (Alg. 2, B=128, M=16, synthetic Env C-like profile, 6 devices)")
        for col in ("units L", "devices", "candidates", "seconds", "paper (Jetson NX)", "paper / ours"):
            t.add_column(col, justify="right")
        for r in rows:
            paper = f"{r.paper_seconds:.0f} s" if r.paper_seconds else "-"
            ratio = f"{r.paper_seconds / r.seconds:.0f}x" if r.paper_seconds else "-"
            t.add_row(str(r.units), str(r.devices), f"{r.candidates:,}", f"{r.seconds:.2f}", paper, ratio)
        tools.console.print(t)
        report["planning_time"] = [r.model_dump() for r in rows]
        if not args.time_only:
            models = args.models.split(",") if args.models else None
            cells = table4(Path(args.profiles), profile_dir=Path(args.profile_dir), cluster=tools.cluster,
                           models=models, envs=tuple(args.envs.split(",")), log=tools.log)
            t = Table(title="predicted HPP speed-up over single device / DP / PP (ours | paper's Table 4)")
            for col in ("model", "env", "Mbps", "groups", "M", "vs single", "vs DP", "vs PP", "paper", "direction"):
                t.add_column(col)
            for c in cells:
                fmt = [f"{v:.2f}x" if v is not None else "OOM" for v in (c.vs_single, c.vs_dp, c.vs_pp)]
                paper = " / ".join(f"{v}x" for v in c.paper) if c.paper else "-"
                match = {True: "matches", False: "differs", None: "-"}[c.direction_matches()]
                t.add_row(c.model, c.env.upper(), str(c.mbps), str(c.groups), str(c.micro_batches), *fmt, paper, match)
            tools.console.print(t)
            report["table4"] = [c.model_dump() for c in cells]
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
        return 0


class ComputeBench(Bench):
    name = "compute"
    help = ("one pipeline stage's training step on this machine's accelerator "
            "against its CPU, in the same run")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="mobilenetv2", help="a zoo model")
        p.add_argument("--start", type=int, default=0, help="the stage's first unit")
        p.add_argument("--end", type=int, default=None, help="one past the stage's last unit (default: the last)")
        p.add_argument("--batch", type=int, default=32, help="samples per step")
        p.add_argument("--repeats", type=int, default=10, help="timed steps per device (the median is shown)")
        p.add_argument("--json", action="store_true", help="print the figures as JSON")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        """One stage timed on the CPU and, where torch sees one, on the CUDA device."""
        import torch

        from edgeswarm.hpp.bench_compute import stage_speed, summary
        from edgeswarm.values.profiles import ModelSpec

        if args.batch < 1 or args.repeats < 1:
            raise ConfigError("--batch and --repeats must be at least 1")
        accelerator = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        speed = stage_speed(ModelSpec(name=args.model), args.start, args.end, args.batch, accelerator,
                            repeats=args.repeats)
        if args.json:
            tools.console.print_json(speed.model_dump_json())
            return 0
        tools.console.print(summary(speed), highlight=False)
        if accelerator is None:
            tools.console.print("no CUDA device here: the CPU figure only", highlight=False)
        return 0
