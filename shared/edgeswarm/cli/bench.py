"""The command line's own benchmarks: ``edgeswarm bench transport``, ``spans`` and ``collectives`` (measured in
``edgeswarm.bench``). The job kinds' benchmarks come from their packages (``cli.kind_commands``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from edgeswarm.bench.transport import KB, MB, TransportReport, run_transport_bench
from edgeswarm.bus import Bus
from edgeswarm.cli.common import cli_settings, hub_url
from edgeswarm.cli.console import console, err_console
from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry
from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.runtime.client import ClusterWatcher, client_bus, online_device_ids

if TYPE_CHECKING:
    from edgeswarm.bench.collectives import CollectiveRow, CollectivesReport
    from edgeswarm.bench.peers import PeersReport

QUICK_PLAN = {KB: 500, 64 * KB: 100, MB: 20, 16 * MB: 2}


def run_bench_transport(args: argparse.Namespace) -> int:
    hub = hub_url(args.hub)
    cluster = None
    if hub is None:
        # No cluster given: bring up a private broker with one native node-agent as the receiver.
        spec = ClusterSpec(name="bench", devices=(DeviceEntry(id="bench-sink", device_class="native"),))
        cluster = LocalCluster(spec, port=0, dashboard_port=None)
        cluster.start()
        hub = cluster.hub_url
        err_console.print(f"no --hub given: started {cluster.broker.kind if cluster.broker else '?'} at {hub}")
    try:
        bus = client_bus(cli_settings(hub), role="bench")
        try:
            node = args.node or _first_device(bus)
            report = run_transport_bench(bus, node, plan=QUICK_PLAN if args.quick else None,
                                         rtt_samples=200 if args.quick else 1000,
                                         progress=lambda m: err_console.print(f"[dim]{m}[/dim]"))
        finally:
            bus.stop()
    finally:
        if cluster is not None:
            cluster.stop()
    if args.out:
        Path(args.out).write_text(report.model_dump_json(indent=2))
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        console.print(report_table(report))
        for line in report_lines(report):
            console.print(line)
    return 0


def _first_device(bus: Bus) -> str:
    view, _ = ClusterWatcher(bus).wait(settle_s=1.0, devices=1, timeout_s=30)
    devices = online_device_ids(view)
    if not devices:
        raise EdgeswarmError("no online node-agent to measure against; start a cluster or pass --node")
    return devices[0]


def report_table(report: TransportReport) -> Table:
    """The throughput rows as a table."""
    table = Table(title=f"transport: {report.broker_url} (MQTT {report.broker_protocol}) -> {report.target}, "
                        f"chunks of {report.chunk_bytes // KB} KiB, QoS 1")
    for col in ("payload", "count", "MQTT MB/s", "raw TCP MB/s", "MQTT/TCP"):
        table.add_column(col, justify="right")
    for row in report.rows:
        size = f"{row.size_bytes // MB} MB" if row.size_bytes >= MB else f"{row.size_bytes // KB} KB"
        table.add_row(size, str(row.count), f"{row.mqtt_mb_s:.1f}", f"{row.tcp_mb_s:.1f}", f"{row.ratio:.2f}")
    return table


def report_lines(report: TransportReport) -> list[str]:
    """The round-trip and codec figures, one line each."""
    c = report.codec
    return [
        f"QoS 1 round trip, 1 KB request and reply: median {report.rtt_1kb_qos1_median_ms:.2f} ms, "
        f"p90 {report.rtt_1kb_qos1_p90_ms:.2f} ms ({report.rtt_samples} samples)",
        f"codec on a {c.tensor_bytes // MB} MiB float32 tensor: encode {c.encode_gb_s:.2f} GB/s, decode "
        f"{c.decode_gb_s:.2f} GB/s ({'zero-copy' if c.decode_zero_copy else 'COPIES'}, CRC-32 checked), "
        f"reassembly from {c.chunk_bytes // KB} KiB chunks {c.reassemble_gb_s:.2f} GB/s",
    ]


_UNITS = {"B": 1, "KB": 1024, "KIB": 1024, "MB": 1024 * 1024, "MIB": 1024 * 1024}


def parse_size(text: str) -> int:
    """Bytes from ``64KB``, ``1MB``, ``512B`` or a plain number (KB = 1024 bytes). Raises ConfigError."""
    raw = text.strip().upper()
    digits = raw.rstrip("KMIB")
    unit = raw[len(digits):] or "B"
    if not digits.isdigit() or unit not in _UNITS:
        raise ConfigError(f"--sizes: {text!r} is not a size (write 1KB, 64KB, 1MB, 16MB or a number of bytes)")
    return int(digits) * _UNITS[unit]


def run_bench_spans(args: argparse.Namespace) -> int:
    """``edgeswarm bench spans``: the cost of recording one span (``edgeswarm.bench.spans``)."""
    from edgeswarm.bench.spans import measure_span_cost

    if args.spans < 1 or args.repeats < 1:
        raise ConfigError("--spans and --repeats must be at least 1")
    cost = measure_span_cost(args.spans, args.repeats)
    console.print(f"recording a span, CPU time per span, best of {args.repeats} x {cost.spans} spans on this machine:")
    console.print(f"  empty nullcontext block (baseline) {cost.baseline_ns:8.0f} ns")
    base = cost.baseline_ns
    console.print(f"  with lane.span(...)                {cost.span_ns:8.0f} ns  ({cost.span_ns / base:.1f}x "
                  f"the baseline, +{cost.overhead_ns:.0f} ns)")
    console.print(f"  lane.add(t0, t1) with its clocks   {cost.add_ns:8.0f} ns  ({cost.add_ns / base:.1f}x)")
    console.print(f"  batches(): to a published record   {cost.batch_ns:8.0f} ns  (on the publishing thread)")
    return 0


def run_bench_collectives(args: argparse.Namespace) -> int:
    """``edgeswarm bench collectives``: ring and direct collectives through the bus against the link and bare paho,
    a decode step's AllReduce, the 1 KB two-instance rate and a bulk tensor (``edgeswarm.bench.collectives``), and
    the bus's goals as measured."""
    from edgeswarm.bench.collectives import MAX_PEERS, MAX_SIZE, OPS, run_collectives_bench

    if args.quick:
        args.peers, args.sizes = "2,4", "1KB,1MB"
        args.repeats = args.repeats or 5
        args.rate_messages = min(args.rate_messages, 5000)
        args.decode_repeats = min(args.decode_repeats, 50)
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if not ops or unknown:
        raise ConfigError(f"--ops: each is one of {', '.join(OPS)}, not {unknown or 'none'}")
    try:
        peers = tuple(int(p) for p in args.peers.split(",") if p.strip())
    except ValueError:
        raise ConfigError(f"--peers: {args.peers!r} is not a comma-separated list of numbers") from None
    bad_peers = [p for p in peers if not 2 <= p <= MAX_PEERS]
    if not peers or bad_peers:
        raise ConfigError(f"--peers: each count is 2 to {MAX_PEERS}, not {bad_peers or 'none'}")
    sizes = tuple(parse_size(s) for s in args.sizes.split(",") if s.strip())
    bad_sizes = [s for s in sizes if not 4 <= s <= MAX_SIZE or s % 4]
    if not sizes or bad_sizes:
        raise ConfigError(f"--sizes: each is a whole number of float32 elements (a multiple of 4 bytes) up to "
                          f"{MAX_SIZE // MB} MB, not {bad_sizes or 'none'}")
    if args.repeats < 0 or args.rate_messages < 1 or args.decode_repeats < 0:
        raise ConfigError("--repeats and --decode-repeats must be 0 or more and --rate-messages at least 1")
    bulk = 0 if args.bulk.strip() == "0" else parse_size(args.bulk)
    if bulk and (not 4 <= bulk <= MAX_SIZE or bulk % 4):
        raise ConfigError(f"--bulk: a whole number of float32 elements up to {MAX_SIZE // MB} MB, or 0, not "
                          f"{args.bulk}")
    report = run_collectives_bench(peers=peers, sizes=sizes, ops=ops, repeats=args.repeats or None,  # type: ignore[arg-type]
                                   rate_messages=args.rate_messages, decode_repeats=args.decode_repeats,
                                   bulk_bytes=bulk, processes=args.processes,
                                   progress=lambda m: err_console.print(f"[dim]{m}[/dim]", highlight=False))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(report.model_dump_json(indent=2))
    for line in collectives_lines(report):
        console.print(line, highlight=False)
    for how, rows, decode in (("all ranks in one process", report.rows, report.decode),
                              ("a process per rank", report.process_rows, report.process_decode)):
        if rows:
            console.print(collectives_table(rows, how))
        for row in decode:
            console.print(f"decode AllReduce ({how}), {row.peers} ranks x {row.hidden} {row.dtype} ({row.repeats} "
                          f"times): bus median {row.bus_median_s * 1e3:.2f} ms, p99 {row.bus_p99_s * 1e3:.2f} ms; "
                          f"bare paho median {row.paho_median_s * 1e3:.2f} ms, p99 {row.paho_p99_s * 1e3:.2f} ms; "
                          f"bus/paho {row.over_paho:.2f}", highlight=False)
    goals = Table(title="the bus's goals (issue 31), as measured in this run")
    for col in ("goal", "target", "measured", "met"):
        goals.add_column(col)
    for goal in report.goals:
        goals.add_row(goal.name, goal.target, goal.measured, "yes" if goal.met else "no")
    console.print(goals)
    return 0


def collectives_lines(report: CollectivesReport) -> list[str]:
    """The link, the rate and the bulk transfer, one line each."""
    from edgeswarm.bench.collectives import human_size

    r = report.rate
    return [f"{report.broker}, loopback bulk rate {report.loopback_mb_s:.0f} MB/s, chunks of "
            f"{report.chunk_bytes // KB} KiB, QoS 1",
            f"{r.payload_bytes // KB} KB one way between two instances: bus {r.bus_per_s:.0f} msg/s, bare paho "
            f"{r.paho_per_s:.0f} msg/s, bus/paho {r.ratio:.2f} ({r.messages} messages)"] + (
        [] if (b := report.bulk) is None else
        [f"{human_size(b.size_bytes)} bulk between two instances: bus {b.bus_mb_s:.0f} MB/s, bare paho "
         f"{b.paho_mb_s:.0f} MB/s, loopback TCP {b.loopback_mb_s:.0f} MB/s; bus/loopback {b.over_loopback:.2f}"])


def collectives_table(rows: list[CollectiveRow], how: str) -> Table:
    """The collective rows: median time per collective through the bus, against bare paho and the link."""
    from edgeswarm.bench.collectives import human_size

    table = Table(title=f"collectives, {how}, median per collective (bus: Bus + TensorExchange + CollectivePort; "
                        "paho: the same frames and steps over bare paho)")
    for col in ("op", "peers", "vector", "msgs", "bus ms", "paho ms", "bus/paho", "link ms", "bus/link", "msg/s"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for row in rows:
        table.add_row(row.op, str(row.peers), human_size(row.size_bytes), str(row.messages), f"{row.bus_s * 1e3:.2f}",
                      f"{row.paho_s * 1e3:.2f}", f"{row.over_paho:.2f}", f"{row.link_s * 1e3:.3f}",
                      f"{row.over_link:.1f}", f"{row.messages_per_s:.0f}")
    return table


def run_bench_peers(args: argparse.Namespace) -> int:
    """``edgeswarm bench peers``: every installed kind beside the tool its users would pick instead, on clusters in
    network namespaces (``edgeswarm.bench.peers``): one table, and the report as JSON with --json."""
    from edgeswarm.bench.peers import run_peers_bench
    from edgeswarm.cli.kind_commands import command_tools
    from edgeswarm.workloads.peers import PeersConfig

    try:
        config = PeersConfig(quick=args.quick, requests=args.requests, flower_env=args.flower_env,
                             bandwidths=[float(b) for b in args.bandwidths.split(",") if b.strip()],
                             devices=[int(d) for d in args.devices.split(",") if d.strip()])
    except ValueError as exc:
        raise ConfigError(f"--bandwidths, --devices, --requests: {exc}") from None
    if any(d < 2 or d > 4 for d in config.devices):
        raise ConfigError("--devices: each count is 2 to 4")
    names = [n.strip() for n in args.sections.split(",") if n.strip()]

    def save(report: PeersReport) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(peers_json(report))

    report = run_peers_bench(config, names, command_tools(args), save)
    if report.rows:
        console.print(peers_table(report))
    for problem in report.problems:
        err_console.print(f"[yellow]warning:[/yellow] {escape(problem)}", soft_wrap=True)
    return 1 if any(r.checked is False for r in report.rows) or (report.problems and not report.rows) else 0


def peers_json(report: PeersReport) -> str:
    """The report as JSON, each row with its ``advantage`` (how many times better ours is)."""
    import json

    out = report.model_dump(mode="json")
    out["rows"] = [r.model_dump(mode="json") | {"advantage": r.advantage} for r in report.rows]
    return json.dumps(out, indent=1)


def peers_table(report: PeersReport) -> Table:
    """One row per figure: the cell, both sides' figures, how far ours is ahead, the cross-check."""
    table = Table(title="edgeswarm beside its peers (one run per cell; ahead: how many times better ours is)")
    for col in ("section", "cell", "metric", "ours", "peer", "ahead", "check"):
        table.add_column(col, overflow="fold")

    def value(v: float | None, unit: str) -> str:
        if v is None:
            return "-"
        if unit == "s":
            return f"{v * 1000:.1f} ms" if v < 10 else f"{v:.1f} s"
        if unit == "B":
            return f"{v / 2**20:.2f} MiB" if v >= 2**20 else f"{v / 1024:.1f} KiB"
        return f"{v:.1f} {unit}"

    for r in report.rows:
        ahead = f"{r.advantage:.2f}x" if r.advantage is not None else "-"
        check = "held" if r.checked else ("FAILED" if r.checked is False else "-")
        table.add_row(r.section, escape(r.cell), r.metric, f"{escape(r.ours)}: {value(r.ours_value, r.unit)}",
                      f"{escape(r.peer)}: {value(r.peer_value, r.unit)}", ahead,
                      check + (f" ({escape(r.error)})" if r.error else ""))
    return table
