"""``edgeswarm serve`` (deploy a model as a pipeline on a running cluster) and ``edgeswarm infer`` (ask it)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.markup import escape

from edgeswarm.cli.common import add_hub_arg
from edgeswarm.cli.console import console, err_console
from edgeswarm.cli.train import job_bus, print_job, read_spec, submit_printing_events
from edgeswarm.errors import ConfigError
from edgeswarm.messages.jobs import FINISHED
from edgeswarm.workloads import KINDS, installed_workload, parse_spec_text, workload
from edgeswarm.workloads.client import JobRequestError, job_states
from edgeswarm.workloads.commands import report_file


def add_serve_parsers(sub: argparse._SubParsersAction, *, kind_options: bool = True) -> None:  # type: ignore[type-arg]
    """Register ``edgeswarm serve`` and ``edgeswarm infer``; with ``kind_options``, every installed kind's own
    ``infer`` options too (its ``infer_arguments``: finding them imports every kind)."""
    p = sub.add_parser("serve", help="serve a model over the cluster's devices: as a pipeline (serve-pipeline) or "
                                      "split by heads, columns and rows (serve-hmp)")
    p.add_argument("spec", help="the serving job spec file (YAML or JSON, kind: serve-pipeline or serve-hmp)")
    add_hub_arg(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the pipeline to be serving")
    p.add_argument("--no-wait", action="store_true", help="submit and return at once")

    # The options every serving kind's infer_cli reads; a kind's own (its input sources beyond these two included)
    # come from its infer_arguments, and that kind checks them against these.
    q = sub.add_parser("infer", help="send inputs to a serving job and print its outputs, latency and throughput")
    q.add_argument("job", help="the serving job's name")
    add_hub_arg(q)
    source = q.add_mutually_exclusive_group()
    source.add_argument("--npz", default=None, metavar="FILE",
                        help="inputs from FILE: array x (or its only array), [samples, ...], split into requests "
                             "(a text model: token ids, one request per row)")
    # None when not given, so that a kind's own input sources can refuse it; the kinds make it 8.
    source.add_argument("--count", type=int, default=None, help="requests of generated inputs (default 8)")
    q.add_argument("--window", type=int, default=8, help="requests in flight at once")
    q.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each answer")
    q.add_argument("--show", type=int, default=4, help="outputs to print (0: none)")
    q.add_argument("--out", type=report_file, default=None, metavar="FILE",
                   help="write every output to FILE (.npz): array y, one row per sample (serve-pipeline), or an "
                        "array y<N> per request N (serve-hmp: its generated token ids, or an encoder's hidden "
                        "states)")
    q.add_argument("--json", default=None, metavar="FILE", help="write the figures and every answer to FILE")
    if kind_options:
        from edgeswarm.cli.kind_commands import add_kind_arguments

        add_kind_arguments(q, "infer_arguments")


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
        print_job(state)
        console.print(f"job {name} is serving: `edgeswarm infer {name}` asks it, `edgeswarm cancel {name}` stops it")
        return 0
    finally:
        bus.stop()


def run_infer(args: argparse.Namespace) -> int:
    """``edgeswarm infer JOB``: the running serving job's kind asks it (its ``infer_cli``, which reads and checks the
    options its ``infer_arguments`` added)."""
    from edgeswarm.cli.kind_commands import command_tools
    from edgeswarm.plugins import load_target

    if args.window < 1 or (args.count is not None and args.count < 1):  # a kind checks its own options
        raise ConfigError("--window and --count must be at least 1")
    bus = job_bus(args)
    try:
        state = next((s for s in job_states(bus) if s.job_id == args.job), None)
        work = installed_workload(state.kind) if state is not None else None
        if state is None or work is None or work.command != "serve":
            raise JobRequestError(f"no serving job {args.job} (see `edgeswarm jobs`)" if state is None else
                                  f"job {args.job} is a {state.kind} job, not a serving job")
        if state.status != "running":
            raise JobRequestError(f"job {args.job} is {state.status}, not serving")
        if not work.infer_cli:
            raise ConfigError(f"job {args.job} is a {work.kind} job, whose kind has no infer command")
        infer = load_target(work.infer_cli, f"the infer command of {work.kind}")
        return int(infer(args, bus, state, command_tools(args)))
    finally:
        bus.stop()


