"""``edgeswarm train JOB``: run a training job on a running cluster and follow it round by round.

Today the command itself drives the job (profile, plan, deploy, rounds, checkpoints) through
``edgeswarm.training.lifecycle.run_job``; it stays in the foreground until the job ends.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from edgeswarm.cli.console import console, err_console
from edgeswarm.cli.main import hub_url
from edgeswarm.cli.plan import plan_table
from edgeswarm.planning.types import Plan
from edgeswarm.runtime.client import client_bus
from edgeswarm.settings import Settings
from edgeswarm.training.driver import RoundReport
from edgeswarm.training.jobs import load_job
from edgeswarm.training.lifecycle import run_job


def add_train_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``edgeswarm train``."""
    p = sub.add_parser("train", help="train a job (YAML or JSON spec) on the running cluster and follow it")
    p.add_argument("job", help="the job spec file")
    p.add_argument("--hub", default=None, help="hub broker URL (default: $EDGESWARM_HUB_URL or mqtt://127.0.0.1:1883)")
    p.add_argument("--wait", action="store_true", help="follow the job to its end (what the command does today)")
    p.add_argument("--store-node", default="hub", help="node of the checkpoint store ('' for no checkpoints)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the plan and every round to FILE")


def run_train(args: argparse.Namespace) -> int:
    job = load_job(Path(args.job))
    hub = hub_url(args.hub) or "mqtt://127.0.0.1:1883"
    bus = client_bus(Settings(hub_url=hub))
    progress = Progress(TextColumn("round {task.completed}"), BarColumn(),
                        TextColumn("{task.description}"), TimeElapsedColumn(), console=console)
    task = None

    def on_plan(plan: Plan) -> None:
        nonlocal task
        console.print(plan_table(plan, []))
        console.print(f"predicted {plan.round_latency_s:.3f} s per round, {plan.throughput_sps:.1f} samples/s")
        progress.start()
        task = progress.add_task("", total=None)

    def on_round(report: RoundReport, plan: Plan) -> None:
        ratio = report.round_s / plan.round_latency_s
        progress.update(task, completed=report.round + 1, description=(
            f"loss {report.loss:.4f}  accuracy {report.accuracy:.1%}  "
            f"{plan.options.global_batch / report.round_s:.1f} samples/s  "
            f"round {report.round_s:.3f} s = {ratio:.2f}x predicted"))

    try:
        result = run_job(bus, hub, job, store_node=args.store_node or None, on_plan=on_plan, on_round=on_round,
                         on_profile=lambda n, f, m: err_console.print(f"  {n}: {f:4.0%} {m}", highlight=False))
    finally:
        progress.stop()
        bus.stop()
    last = result.rounds[-1] if result.rounds else None
    if last is not None:
        mean_s = sum(r.round_s for r in result.rounds) / len(result.rounds)
        predicted = result.plan.round_latency_s
        console.print(f"job {job.name}: {len(result.rounds)} rounds, final loss {last.loss:.4f}, accuracy "
                      f"{last.accuracy:.1%}; measured {mean_s:.3f} s per round against {predicted:.3f} s "
                      f"predicted ({mean_s / predicted:.2f}x)")
    if result.saved:
        console.print(f"final model saved to the checkpoint store on {args.store_node} as version {len(result.rounds)}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "plan": result.plan.model_dump(mode="json"),
            "rounds": [r.model_dump(mode="json") for r in result.rounds]}, indent=2))
    return 0
