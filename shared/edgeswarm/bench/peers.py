"""``edgeswarm bench peers``: each installed kind's sections (``Workload.peers``: the kind beside a tool its users
would pick instead, on the same cluster) and the transport's own section, run in one command, one report.

The transport section is the bus's data path beside raw TCP, as ``bench transport`` measures it (the same bytes,
a sink on the other end of each): the cost of sending tensors as MQTT messages rather than down a socket of one's
own.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.workloads.commands import CommandTools
from edgeswarm.workloads.peers import Figure, PeerRow, PeersConfig, PeerSection

TRANSPORT = "transport"


class PeersReport(BaseModel):
    """Every section's rows, and why a section asked for could not run."""

    config: PeersConfig
    rows: list[PeerRow] = []
    problems: list[str] = []


def sections() -> tuple[list[PeerSection], list[str]]:
    """The installed kinds' sections and the transport's, and a line for each kind's that cannot be offered."""
    from edgeswarm.workloads import kind_peers

    found, problems = kind_peers(taken=(TRANSPORT,))
    return [*found, TransportPeers()], problems


def run_peers_bench(config: PeersConfig, names: list[str], tools: CommandTools,
                    save: Callable[[PeersReport], None] = lambda _r: None) -> PeersReport:
    """Run the sections named ``names`` (every one when empty) and return their rows, handing the report to
    ``save`` after each section. Raises ConfigError for a name no installed section has."""
    offered, problems = sections()
    by_name = {s.name: s for s in offered}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ConfigError(f"--sections: {', '.join(unknown)} is not a section (installed: {', '.join(by_name)})")
    report = PeersReport(config=config, problems=problems)
    cannot = _why_no_netns()
    for section in (by_name[n] for n in names) if names else offered:
        if section.netns and cannot is not None:
            report.problems.append(f"{section.name}: {cannot}")
            continue
        tools.log(f"section {section.name}: {section.title}")
        try:
            report.rows += section.run(config, tools)
        except EdgeswarmError as exc:
            report.problems.append(f"{section.name}: {exc}")
        except ImportError as exc:
            extra = f" (pip install 'edgeswarm[{section.extra}]')" if section.extra else ""
            report.problems.append(f"{section.name}: its peer is not installed: {exc}{extra}")
        save(report)
    return report


def _why_no_netns() -> str | None:
    """Why this machine cannot run namespace clusters, or None when it can."""
    from edgeswarm.netns.host import NetnsUnavailableError, preflight

    try:
        preflight()
    except NetnsUnavailableError as exc:
        return str(exc)
    return None


class TransportPeers(PeerSection):
    name = TRANSPORT
    title = "the bus's data path (MQTT, QoS 1, chunked) against raw TCP, the same bytes"
    netns = False

    def run(self, config: PeersConfig, tools: CommandTools) -> list[PeerRow]:
        from edgeswarm.bench.transport import KB, MB, run_transport_bench
        from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry

        plan = {64 * KB: 100, MB: 20} if config.quick else {KB: 2000, 64 * KB: 400, MB: 100, 16 * MB: 16}
        spec = ClusterSpec(name="peers-transport", devices=(DeviceEntry(id="sink", device_class="native"),))
        with tools.cluster(spec) as (_running, bus):
            report = run_transport_bench(bus, "sink", plan=plan, rtt_samples=200 if config.quick else 1000,
                                         progress=tools.log)
        rtt = Figure(name="QoS 1 round trip of 1 KB, median", value=report.rtt_1kb_qos1_median_ms / 1000, unit="s")
        return [PeerRow(section=self.name, cell="one host, loopback", metric=f"{_size(r.size_bytes)} messages",
                        ours="MQTT data path", peer="raw TCP", ours_value=r.mqtt_mb_s, peer_value=r.tcp_mb_s,
                        unit="MB/s", better="higher", checked=True,
                        check=f"{r.count} messages each way, every one confirmed by its sink", figures=[rtt])
                for r in report.rows]


def _size(nbytes: int) -> str:
    return f"{nbytes // (1 << 20)} MB" if nbytes >= 1 << 20 else f"{nbytes // 1024} KB"
