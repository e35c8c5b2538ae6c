"""What pipelined serving adds to the command line: ``edgeswarm infer`` for its jobs (the kind's ``infer_cli``, its
options ``infer_arguments``), a stream of tensors in (an .npz of samples, or generated ones), each answer's class or
shape, the latency percentiles and samples per second out; and ``edgeswarm plan --kind serve-pipeline``
(``plan_cli``, its options ``plan_arguments``): the partition and placement for a profiled cluster, with the
predicted throughput."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from edgeswarm.bus import Bus
from edgeswarm.errors import ConfigError
from edgeswarm.messages.jobs import JobState
from edgeswarm.models.inputs import as_input_dtype, read_npz
from edgeswarm.planning.serve.load import LoadPrediction, at_offered_load
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.values.profiles import ClusterProfile
from edgeswarm.workloads import parse_spec_text
from edgeswarm.workloads.commands import CommandTools

if TYPE_CHECKING:
    import torch

    from edgeswarm.pipeline_serve.client import StreamReport


DEFAULT_COUNT = 8  # requests of generated inputs when neither --npz nor --count is given (their help says so)


def add_infer_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve-pipeline`` options of ``edgeswarm infer`` (its kind's ``infer_arguments``; the job, the inputs
    ``--npz`` and ``--count``, ``--window``, ``--timeout``, ``--show``, ``--out`` and ``--json`` are shared)."""
    p.add_argument("--rows", type=int, default=1, help="samples per request (at most the job's micro-batch size)")


def run_infer(args: argparse.Namespace, bus: Bus, state: JobState, tools: CommandTools) -> int:
    """``edgeswarm infer`` for a serve-pipeline job: every request answered or failed, then the report."""
    from edgeswarm.pipeline_serve.client import infer_stream

    # --text and --tokens are a text kind's options: absent from the command line when no such kind is installed.
    if getattr(args, "text", None) or getattr(args, "tokens", None):
        raise ConfigError(f"job {args.job} is a {state.kind} job: it takes tensors (--npz or --count), not "
                          "--text or --tokens")
    if args.rows < 1:
        raise ConfigError("--rows must be at least 1")
    report = infer_stream(bus, args.job, _inputs(args, state), window=args.window, timeout_s=args.timeout)
    _print_report(args, report, tools)
    return 0 if report.results and all(r.outputs is not None for r in report.results) else 1


def _inputs(args: argparse.Namespace, state: JobState) -> list[torch.Tensor]:
    """The requests' inputs: the .npz file's samples (in the model's input dtype), or ``--count`` generated requests
    for the job's model."""
    from edgeswarm.models.zoo import example_input

    spec = parse_spec_text(state.spec, source=f"the spec of job {state.job_id}")
    if args.npz is None:
        count = DEFAULT_COUNT if args.count is None else args.count
        return [example_input(spec.model, args.rows, seed=i) for i in range(count)]  # type: ignore[attr-defined]
    samples = as_input_dtype(read_npz(args.npz), example_input(spec.model, 1).dtype, args.npz)  # type: ignore[attr-defined]
    return list(samples.split(args.rows))


def _print_report(args: argparse.Namespace, report: StreamReport, tools: CommandTools) -> None:
    answered = report.answered
    for r in answered[:max(0, args.show)]:
        assert r.outputs is not None
        out = r.outputs.float()
        summary = (f"class {out.argmax(-1).tolist()}" if out.dim() == 2 else f"shape {list(out.shape)}")
        tools.console.print(f"request {r.index}: {summary}, {r.latency_s * 1000:.1f} ms"
                            + (" (replayed)" if r.replayed else ""))
    errors: dict[str, int] = {}
    for r in report.results:
        if r.outputs is None:
            errors[r.reason or "failed"] = errors.get(r.reason or "failed", 0) + 1
            tools.err_console.print(f"request {r.index}: {r.reason}: {escape(r.error or '')}")
    latency = report.latency_s()
    if latency is not None:
        p50, p99 = latency
        tools.console.print(f"{len(answered)}/{len(report.results)} requests answered, {report.samples} samples in "
                            f"{report.wall_s:.2f} s: [bold]{report.samples / report.wall_s:.1f} samples/s[/bold]; "
                            f"latency p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    if args.out and answered:
        import numpy as np
        import torch

        np.savez(args.out, y=torch.cat([r.outputs for r in answered if r.outputs is not None]).numpy())
        tools.console.print(f"outputs written to {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "answered": len(answered), "requests": len(report.results), "samples": report.samples,
            "wall_s": report.wall_s, "busy_retries": report.busy_retries, "errors": errors,
            "results": [{"index": r.index, "latency_s": r.latency_s, "server_latency_s": r.server_latency_s,
                         "epoch": r.epoch, "replayed": r.replayed, "reason": r.reason,
                         "outputs": r.outputs.tolist() if r.outputs is not None else None}
                        for r in report.results]}, indent=1))


# --- edgeswarm plan --kind serve-pipeline ----------------------------------------------------------------


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve-pipeline`` options of ``edgeswarm plan`` (its kind's ``plan_arguments``; ``--exclude``, ``--json``
    and the sources are shared)."""
    p.add_argument("--serve-micro-batch", type=int, default=1,
                   help="serve-pipeline: samples per micro-batch (default 1)")
    p.add_argument("--max-stages", type=int, default=None, help="serve-pipeline: at most this many stages")
    p.add_argument("--serve-method", choices=("auto", "kpath", "greedy", "optimal"), default="auto",
                   help="serve-pipeline: search (auto: the best predicted of all)")
    p.add_argument("--offered-load", type=float, default=None, metavar="SAMPLES_PER_S",
                   help="serve-pipeline: also predict the throughput and a request's latency when clients offer "
                        "this many samples a second at random")


def run_plan(args: argparse.Namespace, cluster: ClusterProfile, tools: CommandTools) -> int:
    """Print the serve-pipeline plan for ``cluster`` with the ``--serve-*``, ``--max-stages`` and ``--exclude``
    options (its kind's ``plan_cli``)."""
    from pydantic import ValidationError

    from edgeswarm.planning.serve.plan import plan_serving
    from edgeswarm.planning.serve.types import ServeOptions

    try:
        options = ServeOptions(micro_batch_size=args.serve_micro_batch, max_stages=args.max_stages,
                               method=args.serve_method,
                               exclude=[x for x in args.exclude.split(",") if x.strip()])
    except ValidationError as exc:
        raise ConfigError(f"bad serve-pipeline options: {exc}") from exc
    if args.offered_load is not None and not (0 < args.offered_load < math.inf):
        raise ConfigError(f"--offered-load is a positive number of samples a second, not {args.offered_load}")
    plan = plan_serving(cluster, options)
    load = None if args.offered_load is None else at_offered_load(plan, args.offered_load)
    if args.json:
        # With a load, the plan and its prediction at that load; without one, the plan alone (as before).
        text = plan.model_dump_json(indent=2) if load is None else json.dumps(
            {"plan": plan.model_dump(mode="json"), "at_offered_load": load.model_dump(mode="json")}, indent=2)
        tools.console.out(text, highlight=False)
    else:
        names = [u.name for u in cluster.model.units]
        tools.console.print(f"[bold]{cluster.model.model.name}[/bold]: serve-pipeline, {len(names)} units, "
                            f"{len(cluster.devices)} devices, micro-batch {plan.micro_batch_size}, "
                            f"method {plan.method}")
        print_plan(plan, tools, names)
        if load is not None:
            tools.console.print(_load_text(args.offered_load, load))
    return 0


def _load_text(offered_per_s: float, load: LoadPrediction) -> str:
    if load.saturated:
        return (f"at {offered_per_s:g} samples/s offered: [bold]saturated[/bold], it serves its capacity of "
                f"{load.throughput_per_s:.1f} samples/s and the queue grows without bound")
    return (f"at {offered_per_s:g} samples/s offered: serves all of it, a request's latency "
            f"[bold]{load.latency_s:.4f} s[/bold] on average (bottleneck {load.utilisation:.0%} busy)")


def print_plan(plan: ServePlan, tools: CommandTools, names: list[str] | None = None) -> None:
    """The serve-pipeline plan as a table (with the units' names when given), then its predicted throughput,
    latency and bottleneck."""
    table = Table(title=f"serve-pipeline plan, epoch {plan.epoch}")
    for col in ("stage", "units", "layers", "device", "compute (s)", "transfer in (s)", "input (bytes)",
                "memory used / budget"):
        table.add_column(col)
    for s in plan.stages:
        layers = f"{names[s.start]} .. {names[s.end - 1]}" if names else "-"
        table.add_row(str(s.index), f"[{s.start}, {s.end})", layers, s.device,
                      f"{s.compute_s:.4f}", f"{s.transfer_in_s:.4f}", str(s.input_bytes),
                      f"{s.memory_bytes / 2**20:.0f}/{s.memory_budget_bytes / 2**20:.0f} MiB")
    tools.console.print(table)
    tools.console.print(f"predicted throughput [bold]{plan.throughput_per_s:.1f} samples/s[/bold], latency "
                        f"[bold]{plan.latency_s:.4f} s[/bold] per micro-batch, bottleneck {plan.bottleneck_s:.4f} s "
                        f"({plan.bottleneck})")
