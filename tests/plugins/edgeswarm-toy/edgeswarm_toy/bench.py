"""``edgeswarm bench toy``: the toy kind's own benchmark, offered by the command line through the kind's
``benches`` as the built-in kinds' are. It runs toy jobs on a local cluster the command line starts for it and
measures what one step (a request to a device and its answer, over MQTT) costs."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.table import Table

from edgeswarm.devices.cluster import cluster_of
from edgeswarm.errors import ConfigError
from edgeswarm.workloads.client import JobFollower, submit_job
from edgeswarm.workloads.commands import Bench, CommandTools
from edgeswarm_toy.spec import ToyProgress


class ToyBench(Bench):
    name = "toy"
    help = "toy jobs on a local cluster of native devices: what one step (a request and its answer) costs"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--devices", type=int, default=2, help="native devices in the cluster (1 to 8)")
        parser.add_argument("--steps", type=int, default=200, help="steps of the toy job (1 to 10000)")
        parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        if not 1 <= args.devices <= 8 or not 1 <= args.steps <= 10_000:
            raise ConfigError("--devices takes 1 to 8 and --steps 1 to 10000")
        tools.log(f"starting {args.devices} native devices")
        with tools.cluster(cluster_of(args.devices, "native"), skip_services=("tensor-shard-worker",)) as (_, bus):
            follower = JobFollower(bus, "bench-toy")
            started = time.monotonic()
            submit_job(bus, f"kind: toy\nname: bench-toy\nsteps: {args.steps}\nstep_s: 0\n",
                       submission=follower.submission)
            state = follower.wait(600)
            wall_s = time.monotonic() - started
        progress = state.progress_as(ToyProgress)
        figures = {"devices": args.devices, "steps": progress.steps_done, "status": state.status, "wall_s": wall_s,
                   "ms_per_step": 1000 * wall_s / max(1, progress.steps_done),
                   "doubled_sum": progress.doubled_sum, "expected_sum": args.steps * (args.steps + 1)}
        table = Table(title="toy jobs on a local cluster (submission to the last answer)")
        for column in figures:
            table.add_column(column.replace("_", " "))
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in figures.values()))
        tools.console.print(table)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
        return 0 if state.status == "succeeded" and figures["doubled_sum"] == figures["expected_sum"] else 1
