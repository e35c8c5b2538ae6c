"""What pipelined serving adds to the command line: ``edgeswarm infer`` for its jobs (the kind's ``infer_cli``), a
stream of tensors in (an .npz of samples, or generated ones), each answer's class or shape, the latency percentiles
and samples per second out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from edgeswarm.bus import Bus
from edgeswarm.errors import ConfigError
from edgeswarm.messages.jobs import JobState
from edgeswarm.models.inputs import as_input_dtype, read_npz
from edgeswarm.workloads import parse_spec_text
from edgeswarm.workloads.commands import CommandTools

if TYPE_CHECKING:
    import torch

    from edgeswarm.pipeline_serve.client import StreamReport


def run_infer(args: argparse.Namespace, bus: Bus, state: JobState, tools: CommandTools) -> int:
    """``edgeswarm infer`` for a serve-pipeline job: every request answered or failed, then the report."""
    from edgeswarm.pipeline_serve.client import infer_stream

    if args.text or args.tokens:
        raise ConfigError(f"job {args.job} is a {state.kind} job: it takes tensors (--npz or --count), not "
                          "--text or --tokens")
    report = infer_stream(bus, args.job, _inputs(args, state), window=args.window, timeout_s=args.timeout)
    _print_report(args, report, tools)
    return 0 if report.results and all(r.outputs is not None for r in report.results) else 1


def _inputs(args: argparse.Namespace, state: JobState) -> list[torch.Tensor]:
    """The requests' inputs: the .npz file's samples (in the model's input dtype), or ``--count`` generated requests
    for the job's model."""
    from edgeswarm.models.zoo import example_input

    spec = parse_spec_text(state.spec, source=f"the spec of job {state.job_id}")
    if args.npz is None:
        return [example_input(spec.model, args.rows, seed=i) for i in range(args.count)]  # type: ignore[attr-defined]
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
