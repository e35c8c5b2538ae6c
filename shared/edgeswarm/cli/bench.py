"""``edgeswarm bench transport``."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from edgeswarm.bench.transport import KB, MB, TransportReport, run_transport_bench
from edgeswarm.bus import Bus
from edgeswarm.cli.console import console, err_console
from edgeswarm.cli.main import hub_url
from edgeswarm.cli.status import cli_settings
from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry
from edgeswarm.errors import EdgeswarmError
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.runtime.client import ClusterWatcher, client_bus, online_device_ids

QUICK_PLAN = {KB: 500, 64 * KB: 100, MB: 20, 16 * MB: 2}


def run_bench_transport(args: argparse.Namespace) -> int:
    hub = hub_url(args.hub)
    cluster = None
    if hub is None:
        # No cluster given: bring up a private broker with one native node-agent as the receiver.
        spec = ClusterSpec(name="bench", devices=(DeviceEntry(id="bench-sink", device_class="native"),))
        cluster = LocalCluster(spec, port=0)
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
