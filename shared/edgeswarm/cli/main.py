"""The ``edgeswarm`` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from edgeswarm import __version__
from edgeswarm.cli.common import add_hub_arg
from edgeswarm.cli.failures import BROKEN_PIPE_STATUS, detach_stdout, exit_status, report, settings_problem
from edgeswarm.workloads.commands import report_file


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argument parser of every subcommand. The installed job kinds' verbs and benchmarks are added only when
    ``argv`` (the command line to parse) may name one: finding them imports every kind."""
    parser = argparse.ArgumentParser(prog="edgeswarm", description="Heterogeneous edge devices training and "
                                     "serving DNNs together over MQTT.")
    parser.add_argument("--version", action="version", version=f"edgeswarm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a cluster")
    up.add_argument("--local", action="store_true", help="the whole cluster on this machine, as separate processes")
    up.add_argument("--netns", action="store_true",
                    help="each node a real host on this machine: its own network namespace, address, TLS broker and "
                         "kernel-shaped links (root, ip, tc, nft and iptables needed)")
    up.add_argument("--skewable", action="append", default=[], metavar="NODE",
                    help="with --netns: run NODE's processes with a wall clock `edgeswarm chaos skew` can move "
                         "(libfaketime; it slows them: repeatable, only the nodes you will skew)")
    up.add_argument("--devices", default="4",
                    help="a number of emulated devices, a cluster file, or a bundled one's name "
                    "(asteroid-env-d-100mbps)")
    up.add_argument("--device-class", default=None, help="with --devices N: give every device this class")
    up.add_argument("--edges", type=int, default=0, metavar="N",
                    help="add N edge servers (the edge role: an MEC that hosts work for devices), class native")
    up.add_argument("--broker", default="auto", choices=["auto", "mosquitto", "amqtt"],
                    help="auto: Mosquitto when on PATH, otherwise the embedded amqtt broker")
    up.add_argument("--port", type=int, default=1883, help="broker port on 127.0.0.1 (0: any free port)")
    up.add_argument("--heartbeat", type=float, default=None, help="heartbeat interval in seconds")
    up.add_argument("--workdir", default=None, help="where logs and broker files go (default: a temporary folder)")
    up.add_argument("--ready-timeout", type=float, default=60.0,
                    help="seconds to wait for every service of every node to come online")
    up.add_argument("--dashboard-port", type=int, default=0, metavar="PORT",
                    help="with --local: the dashboard's port on 127.0.0.1 (default 0: a free one; the URL is printed)")
    up.add_argument("--gateway-port", type=int, default=0, metavar="PORT",
                    help="with --local: the OpenAI-compatible API's port on 127.0.0.1 (default 0: a free one; printed)")
    up.add_argument("--secure", action="store_true",
                    help="TLS, a password per node and the topic-tree ACL, as in a deployment (files in the workdir)")

    status = sub.add_parser("status", help="nodes, services, their state and heartbeat age")
    add_hub_arg(status)
    status.add_argument("--json", action="store_true", help="print the cluster view as JSON")
    status.add_argument("--wait-devices", type=int, default=0, help="wait until this many devices are online")
    status.add_argument("--timeout", type=float, default=60.0, help="seconds --wait-devices may wait")

    tops = sub.add_parser("topics", help="the topic tree with each topic's schema, retention and QoS")
    tops.add_argument("--json", action="store_true")

    service = sub.add_parser("service", help="run one service in this process (the entry point of every container)")
    service.add_argument("name", help="coordinator, node-agent, ...")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    transport = bench_sub.add_parser("transport", help="MQTT data path vs raw TCP, QoS 1 round trip, codec speed")
    add_hub_arg(transport)
    transport.add_argument("--node", default=None,
                           help="the node whose node-agent receives (default: the first online)")
    transport.add_argument("--quick", action="store_true", help="fewer and smaller payloads (seconds, not a minute)")
    transport.add_argument("--json", action="store_true", help="print the report as JSON")
    transport.add_argument("--out", type=report_file, default=None, help="also write the JSON report to this file")

    spans = bench_sub.add_parser("spans", help="what recording one trace span costs a worker, against an empty block")
    spans.add_argument("--spans", type=int, default=100_000, help="spans recorded per repeat")
    spans.add_argument("--repeats", type=int, default=5, help="repeats, the fastest kept")

    collectives = bench_sub.add_parser("collectives", help="ring and direct collectives among 2 to 6 bus instances "
                                       "against the link and bare paho; a decode step's AllReduce; the 1 KB message "
                                       "rate; a bulk tensor against loopback TCP")
    collectives.add_argument("--peers", default="2,3,4,5,6", help="comma-separated peer counts, each 2 to 6")
    collectives.add_argument("--sizes", default="1KB,64KB,1MB,16MB",
                             help="comma-separated vector sizes (B, KB, MB; float32, up to 64MB)")
    collectives.add_argument("--repeats", type=int, default=0,
                             help="collectives timed per cell, the median shown (0: by size, 30 to 3)")
    collectives.add_argument("--rate-messages", type=int, default=20000,
                             help="1 KB messages for the two-instance rate (default 20000)")
    collectives.add_argument("--ops", default="all_gather,reduce_scatter,all_reduce,direct_all_gather,"
                             "direct_all_reduce", help="comma-separated collectives")
    collectives.add_argument("--decode-repeats", type=int, default=200,
                             help="direct AllReduces of one decode step timed per dtype (0: none)")
    collectives.add_argument("--bulk", default="64MB", help="the bulk tensor's size (0: none)")
    collectives.add_argument("--processes", action="store_true",
                             help="also run the collectives and the decode AllReduce with a process per rank, as a "
                             "real cluster has them")
    collectives.add_argument("--quick", action="store_true", help="peers 2 and 4, 1KB and 1MB, fewer repeats")
    collectives.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")

    peers = bench_sub.add_parser("peers", help="each kind beside the tool its users would pick instead (Flower, torch "
                                 "pipelining and tensor parallelism) and the bus beside raw TCP, on the same namespace "
                                 "clusters (root)")
    peers.add_argument("--sections", default="", help="comma-separated sections (default: every installed one; "
                       "flower: FedAvg and SmartSplit against Flower, pipeline: HPP against torch pipelining, "
                       "tp: Galaxy against torch TP, transport: MQTT against raw TCP)")
    peers.add_argument("--flower-env", default=os.environ.get("EDGESWARM_FLOWER_ENV", ""), metavar="DIR",
                       help="flower: the virtual environment with edgeswarm[peers] (default: EDGESWARM_FLOWER_ENV, "
                       "else this one; `make peers-venv` makes .venv-peers)")
    peers.add_argument("--quick", action="store_true", help="the smallest sizes, one cell a section: the cross-checks "
                       "and that every row has figures, in a few minutes")
    peers.add_argument("--bandwidths", default="125,1000", help="tp: comma-separated link bandwidths, Mbps")
    peers.add_argument("--devices", default="2,3,4", help="tp: comma-separated device counts, each 2 to 4")
    peers.add_argument("--requests", type=int, default=3, help="measured repetitions of each figure")
    peers.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")

    if argv[:1] == ["bench"]:
        from edgeswarm.cli.kind_commands import add_kind_commands

        add_kind_commands(bench_sub, "benches")

    from edgeswarm.cli.chaos import add_chaos_parser
    from edgeswarm.cli.dashboard import add_dashboard_parser
    from edgeswarm.cli.health import add_health_parser
    from edgeswarm.cli.plan import add_plan_parser
    from edgeswarm.cli.profile import add_profile_parser
    from edgeswarm.cli.security import add_security_parsers
    from edgeswarm.cli.serve import add_serve_parsers
    from edgeswarm.cli.trace import add_trace_parser
    from edgeswarm.cli.train import add_train_parser
    from edgeswarm.cli.watch import add_watch_parser

    add_security_parsers(sub)
    add_profile_parser(sub)
    add_plan_parser(sub, kind_options=argv[:1] == ["plan"])
    add_train_parser(sub, kind_options=argv[:1] == ["train"])
    add_serve_parsers(sub, kind_options=argv[:1] == ["infer"])
    add_chaos_parser(sub)
    add_health_parser(sub)
    add_watch_parser(sub)
    add_dashboard_parser(sub)
    add_trace_parser(sub)
    if not argv or argv[0] not in sub.choices:  # --help, --version, or a verb of a kind
        from edgeswarm.cli.kind_commands import add_kind_commands

        add_kind_commands(sub, "commands")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status. A user's mistake (a bad argument, hub URL or ``EDGESWARM_*``
    value, an unreachable broker, a port in use, a missing extra) ends in one ``error:`` line on stderr and a
    non-zero status, and a reader that goes away (``| head``) ends the command quietly with status 141; only a bug
    shows a traceback."""
    try:
        try:
            status = _run(argv)
        except ValidationError as exc:
            if exc.title != "Settings":  # any other model is the program's own business: a bug, with its traceback
                raise
            report(settings_problem(exc))
            status = 2
        # Flushed here, inside the guard, so that a reader gone away shows now and not at the interpreter's exit.
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        detach_stdout()
        return BROKEN_PIPE_STATUS


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if args.command == "service":
        from edgeswarm.cli.service import service_process

        return service_process(args.name)
    from edgeswarm.logs import configure_cli_logging

    configure_cli_logging(os.environ.get("EDGESWARM_LOG_LEVEL", "WARNING"))
    return exit_status(lambda: _command(args))


# Each verb's runner, imported only when it runs (``edgeswarm status`` must not pay for torch).
_RUNNERS = {"up": "up:run_up", "status": "status:run_status", "topics": "status:run_topics",
            "watch": "watch:run_watch", "dashboard": "dashboard:run_dashboard", "health": "health:run_health",
            "credentials": "security:run_credentials", "certs": "security:run_certs", "chaos": "chaos:run_chaos",
            "plan": "plan:run_plan", "train": "train:run_train", "trace": "trace:run_trace",
            "explain": "trace:run_explain",
            "serve": "serve:run_serve", "infer": "serve:run_infer", "jobs": "train:run_jobs",
            "cancel": "train:run_cancel", "profile": "profile:run_profile"}
_BENCHES = {"spans": "bench:run_bench_spans", "collectives": "bench:run_bench_collectives",
            "peers": "bench:run_bench_peers"}


def _command(args: argparse.Namespace) -> int:
    from importlib import import_module

    kind_command = getattr(args, "kind_command", None)
    if args.command in ("plan", "bench", "train") or kind_command is not None:
        from edgeswarm.runtime.signals import terminate_as_interrupt

        terminate_as_interrupt()  # they may start a local cluster, which must not outlive them
    if kind_command is not None:
        from edgeswarm.cli.kind_commands import run_kind_command

        return run_kind_command(args)
    if args.command == "bench":
        target = _BENCHES.get(args.bench, "bench:run_bench_transport")
    elif args.command in _RUNNERS:
        target = _RUNNERS[args.command]
    else:
        return 2
    module, _, function = target.partition(":")
    run: Callable[[argparse.Namespace], int] = getattr(import_module(f"edgeswarm.cli.{module}"), function)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
