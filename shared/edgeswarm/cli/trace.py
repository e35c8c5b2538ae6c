"""``edgeswarm trace JOB --out trace.json``: a job's measured spans as Chrome trace format (Perfetto opens it).

The spans come from the dashboard service on the hub (its trace collector holds every worker's spans, per job),
asked with a TraceRequest (``tracing.client.fetch_trace``, which HPP's ``train --timeline-png`` uses too).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgeswarm.cli.common import add_hub_arg, hub_url
from edgeswarm.cli.console import console
from edgeswarm.errors import ConfigError
from edgeswarm.runtime.client import client_bus
from edgeswarm.settings import Settings
from edgeswarm.tracing.chrome import chrome_trace_bytes
from edgeswarm.tracing.client import NoTraceError, fetch_trace


def add_trace_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``edgeswarm trace``."""
    p = sub.add_parser("trace", help="write a job's measured spans (forward, backward, transfers, waits) as Chrome "
                                     "trace format, for Perfetto or chrome://tracing")
    p.add_argument("job", help="the job's name")
    p.add_argument("--out", required=True, help="the JSON file to write (replaced if it exists)")
    add_hub_arg(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the dashboard's answer")


def run_trace(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; name the file to write, e.g. {out / (args.job + '.json')}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {out.parent} does not exist")
    bus = client_bus(Settings(hub_url=hub_url(args.hub) or "mqtt://127.0.0.1:1883"), role="trace")
    try:
        reply = fetch_trace(bus, args.job, args.timeout)
    finally:
        bus.stop()
    if not reply.found:
        held = ", ".join(reply.jobs) or "none"
        raise NoTraceError(f"the dashboard holds no spans of job {args.job} (jobs with spans: {held}); spans are "
                           "kept from when the dashboard started, for its most recent jobs")
    out.write_bytes(chrome_trace_bytes(reply.spans, job_id=args.job))
    spans = reply.spans
    rounds = sorted({s.round for s in spans if s.round is not None})
    nodes = sorted({s.node for s in spans})
    round_text = (f"rounds {rounds[0]}-{rounds[-1]}" if len(rounds) > 1 else f"round {rounds[0]}" if rounds
                  else "no rounds")
    dropped = f", {reply.dropped} dropped on the way" if reply.dropped else ""
    console.print(f"wrote {out}: {len(spans)} spans of job {args.job} on {len(nodes)} nodes ({', '.join(nodes)}), "
                  f"{round_text}{dropped}; open it at https://ui.perfetto.dev", markup=False, highlight=False,
                  soft_wrap=True)  # one line however long the path: scripts read it
    return 0
