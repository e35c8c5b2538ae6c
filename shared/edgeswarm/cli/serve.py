"""``edgeswarm serve`` (deploy a model as a pipeline on a running cluster) and ``edgeswarm infer`` (ask it)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from edgeswarm.cli.common import add_hub_arg
from edgeswarm.cli.console import console, err_console
from edgeswarm.cli.plan import print_serve_plan
from edgeswarm.cli.train import job_bus, read_spec, submit_printing_events
from edgeswarm.errors import ConfigError
from edgeswarm.messages.jobs import FINISHED, JobState
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.workloads import KINDS, installed_workload, parse_spec_text, workload
from edgeswarm.workloads.client import JobRequestError, job_states

if TYPE_CHECKING:
    import torch

    from edgeswarm.pipeline_serve.client import StreamReport


def add_serve_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``edgeswarm serve`` and ``edgeswarm infer``."""
    p = sub.add_parser("serve", help="serve a model over the cluster's devices: as a pipeline (serve-pipeline) or "
                                      "split by heads, columns and rows (serve-hmp)")
    p.add_argument("spec", help="the serving job spec file (YAML or JSON, kind: serve-pipeline or serve-hmp)")
    add_hub_arg(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the pipeline to be serving")
    p.add_argument("--no-wait", action="store_true", help="submit and return at once")

    q = sub.add_parser("infer", help="send inputs to a serving job and print its outputs, latency and throughput")
    q.add_argument("job", help="the serving job's name")
    add_hub_arg(q)
    source = q.add_mutually_exclusive_group()
    source.add_argument("--npz", default=None, metavar="FILE",
                        help="inputs from FILE: array x (or its only array), [samples, ...], split into requests "
                             "(a text model: token ids, one request per row)")
    source.add_argument("--count", type=int, default=8, help="requests of generated inputs (default 8)")
    source.add_argument("--text", action="append", default=None, metavar="TEXT",
                        help="a text model with a tokenizer: one request of TEXT (repeatable)")
    source.add_argument("--tokens", action="append", default=None, metavar="IDS",
                        help="a text model: one request of these comma-separated token ids (repeatable)")
    q.add_argument("--max-new-tokens", type=int, default=None,
                   help="a text decoder: tokens to generate per request (default: the job's max_new_tokens)")
    q.add_argument("--rows", type=int, default=1, help="samples per request (at most the job's micro-batch size)")
    q.add_argument("--window", type=int, default=8, help="requests in flight at once")
    q.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each answer")
    q.add_argument("--show", type=int, default=4, help="outputs to print (0: none)")
    q.add_argument("--out", default=None, metavar="FILE",
                   help="write every output to FILE (.npz): array y, one row per sample (serve-pipeline), or an "
                        "array y<N> per request N (serve-hmp: its generated token ids, or an encoder's hidden "
                        "states)")
    q.add_argument("--json", default=None, metavar="FILE", help="write the figures and every answer to FILE")


def serving_kinds() -> list[str]:
    """The job kinds ``edgeswarm serve`` submits (those whose workload's command is ``serve``)."""
    return [k for k in KINDS if (w := installed_workload(k)) is not None and w.command == "serve"]


def run_serve(args: argparse.Namespace) -> int:
    path = Path(args.spec)
    text = read_spec(path)
    spec = parse_spec_text(text, source=str(path))  # the coordinator checks again; this fails before connecting
    work = workload(spec.kind)  # type: ignore[attr-defined]
    if work.command != "serve":
        raise ConfigError(f"{path} is a {work.kind} job: `edgeswarm serve` takes serving kinds "
                          f"({', '.join(serving_kinds())}); `edgeswarm {work.command}` runs this one")
    name = spec.name  # type: ignore[attr-defined]
    bus = job_bus(args)
    try:
        follower = submit_printing_events(bus, name, text)
        if args.no_wait:
            return 0
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            state = follower.state
            if state is not None and (state.status == "running" or state.status in FINISHED):
                break
            time.sleep(0.1)
        state = follower.state
        if state is None or state.status != "running":
            where = f"{state.status}: {escape(state.detail)}" if state else "no state seen"
            err_console.print(f"job {name} is not serving ({where})")
            return 1
        if isinstance(state.plan, ServePlan):
            print_serve_plan(state.plan)
        console.print(f"job {name} is serving: `edgeswarm infer {name}` asks it, `edgeswarm cancel {name}` stops it")
        return 0
    finally:
        bus.stop()


def run_infer(args: argparse.Namespace) -> int:
    from edgeswarm.pipeline_serve.client import infer_stream
    from edgeswarm.plugins import load_target

    if args.rows < 1 or args.window < 1 or (args.npz is None and args.count < 1) or (args.max_new_tokens or 0) < 0:
        raise ConfigError("--rows, --window and --count must be at least 1, --max-new-tokens at least 0")
    bus = job_bus(args)
    try:
        state = next((s for s in job_states(bus) if s.job_id == args.job), None)
        work = installed_workload(state.kind) if state is not None else None
        if state is None or work is None or work.command != "serve":
            raise JobRequestError(f"no serving job {args.job} (see `edgeswarm jobs`)" if state is None else
                                  f"job {args.job} is a {state.kind} job, not a serving job")
        if state.status != "running":
            raise JobRequestError(f"job {args.job} is {state.status}, not serving")
        if work.infer_cli:
            return int(load_target(work.infer_cli, f"the infer command of {work.kind}")(args, bus, state))
        if args.text or args.tokens:
            raise ConfigError(f"job {args.job} is a {work.kind} job: it takes tensors (--npz or --count), not "
                              "--text or --tokens")
        inputs = _inputs(args, state)
        report = infer_stream(bus, args.job, inputs, window=args.window, timeout_s=args.timeout)
    finally:
        bus.stop()
    _print_report(args, report)
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


def read_npz(path: str) -> torch.Tensor:
    """Array ``x`` of the .npz file ``path`` (or its only array), [samples, ...]. Raises ConfigError saying what is
    wrong with the file."""
    import numpy as np
    import torch

    try:
        with np.load(path, allow_pickle=False) as data:
            key = "x" if "x" in data.files else data.files[0] if len(data.files) == 1 else None
            if key is None:
                raise ConfigError(f"{path} holds {', '.join(data.files)}: name the inputs x")
            samples = torch.from_numpy(np.ascontiguousarray(data[key]))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read inputs from {path}: {exc}") from None
    if samples.dim() < 1 or samples.shape[0] == 0:
        raise ConfigError(f"{path}: x must be [samples, ...] with at least one sample")
    return samples


def _exact_as(integers: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of ``integers`` (an integer or bool tensor) is exactly a value of the float ``dtype``."""
    import torch

    # Every float16/bfloat16/float32 value is a float64, and one rounded from an integer is integral: back to int64
    # it compares exactly, once it is inside int64's range (2^63 itself, where int64's top rounds to, is not).
    if integers.numel() == 0:
        return True
    wide = integers.to(dtype).to(torch.float64)
    if not bool(torch.isfinite(wide).all()) or float(wide.abs().max()) >= 2.0 ** 63:
        return False
    return torch.equal(wide.to(torch.int64), integers.to(torch.int64))


def as_input_dtype(samples: torch.Tensor, dtype: torch.dtype, source: str) -> torch.Tensor:
    """``samples`` in the model's input ``dtype`` when that loses nothing a user cares about: any float to the
    model's float (NumPy's float64 default to float32, say), integers to a float that holds each of them exactly,
    integers to a wider or equal integer, and integral values of any dtype to an integer type that holds them (token
    ids saved as floats). Raises ConfigError when it would change values (an int64 of 2^40 + 1 to float32, say)."""
    import torch

    if samples.dtype == dtype:
        return samples
    if dtype.is_floating_point and samples.dtype.is_floating_point:
        return samples.to(dtype)
    if dtype.is_floating_point and not samples.dtype.is_complex and _exact_as(samples, dtype):
        return samples.to(dtype)
    if not dtype.is_floating_point and not dtype.is_complex and samples.dtype != torch.bool:
        info = torch.iinfo(dtype)
        converted = samples.to(torch.float64)
        if bool((converted == converted.round()).all()) and (samples.numel() == 0 or (
                float(converted.min()) >= info.min and float(converted.max()) <= info.max)):
            return samples.to(dtype)
    raise ConfigError(f"{source}: the model takes {str(dtype).removeprefix('torch.')} inputs; "
                      f"{str(samples.dtype).removeprefix('torch.')} values would change on the way (save them as "
                      f"{str(dtype).removeprefix('torch.')})")


def _print_report(args: argparse.Namespace, report: StreamReport) -> None:
    answered = report.answered
    for r in answered[:max(0, args.show)]:
        assert r.outputs is not None
        out = r.outputs.float()
        summary = (f"class {out.argmax(-1).tolist()}" if out.dim() == 2 else f"shape {list(out.shape)}")
        console.print(f"request {r.index}: {summary}, {r.latency_s * 1000:.1f} ms"
                      + (" (replayed)" if r.replayed else ""))
    errors: dict[str, int] = {}
    for r in report.results:
        if r.outputs is None:
            errors[r.reason or "failed"] = errors.get(r.reason or "failed", 0) + 1
            err_console.print(f"request {r.index}: {r.reason}: {escape(r.error or '')}")
    latency = report.latency_s()
    if latency is not None:
        p50, p99 = latency
        console.print(f"{len(answered)}/{len(report.results)} requests answered, {report.samples} samples in "
                      f"{report.wall_s:.2f} s: [bold]{report.samples / report.wall_s:.1f} samples/s[/bold]; latency "
                      f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    if args.out and answered:
        import numpy as np
        import torch

        np.savez(args.out, y=torch.cat([r.outputs for r in answered if r.outputs is not None]).numpy())
        console.print(f"outputs written to {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "answered": len(answered), "requests": len(report.results), "samples": report.samples,
            "wall_s": report.wall_s, "busy_retries": report.busy_retries, "errors": errors,
            "results": [{"index": r.index, "latency_s": r.latency_s, "server_latency_s": r.server_latency_s,
                         "epoch": r.epoch, "replayed": r.replayed, "reason": r.reason,
                         "outputs": r.outputs.tolist() if r.outputs is not None else None}
                        for r in report.results]}, indent=1))
