"""``edgeswarm up --local``: start a broker, the coordinator and emulated devices; stop them on Ctrl-C."""

from __future__ import annotations

import argparse
import shlex
import threading
from pathlib import Path

from edgeswarm.cli.console import console
from edgeswarm.cli.status import status_table
from edgeswarm.devices.cluster import ClusterSpec, cluster_of, load_cluster
from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.netns.cluster import NetnsCluster
from edgeswarm.runtime.client import ClusterWatcher, client_bus, not_online, online_devices, settings_from_env
from edgeswarm.runtime.signals import stop_on_signals


def cluster_from_arg(devices: str, device_class: str | None) -> ClusterSpec:
    """``--devices``: a count (with ``--device-class`` or the default mix), a cluster file, or a bundled name."""
    if devices.isdigit():
        return cluster_of(int(devices), device_class)
    if device_class:
        raise ConfigError("--device-class only applies to --devices N; a cluster file names its classes")
    return load_cluster(devices)


def run_up(args: argparse.Namespace) -> int:
    if args.skewable and not args.netns:
        raise ConfigError("--skewable needs --netns: only a namespace cluster's nodes get their own clock")
    if args.local == args.netns:
        raise ConfigError("choose `edgeswarm up --local` (processes on this machine) or `edgeswarm up --netns` (each "
                          "node in its own network namespace); on real devices run `docker compose up` on each node "
                          "(see compose.yaml)")
    spec = cluster_from_arg(args.devices, args.device_class)
    if args.edges:
        spec = spec.with_edges(args.edges)
    stop = threading.Event()
    stop_on_signals(stop)
    workdir = Path(args.workdir) if args.workdir else None
    cluster: LocalCluster | NetnsCluster
    if args.netns:
        cluster = NetnsCluster(spec, heartbeat_interval_s=args.heartbeat, workdir=workdir,
                               skewable=tuple(args.skewable))
    else:
        for flag, port in (("--dashboard-port", args.dashboard_port), ("--gateway-port", args.gateway_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{flag} takes 0 (a free port) to 65535, not {port}")
        cluster = LocalCluster(spec, broker=args.broker, port=args.port, heartbeat_interval_s=args.heartbeat,
                               workdir=workdir, secure=args.secure, dashboard_port=args.dashboard_port,
                               gateway_port=args.gateway_port)
    try:
        cluster.start()
        if isinstance(cluster, NetnsCluster):
            console.print(f"namespaces: {', '.join(f'{n.node} {n.address}' for n in cluster.nodes)} on bridge "
                          f"{cluster.bridge}; a TLS Mosquitto per node, the hub's at {cluster.hub_url}")
            console.print(f"run id {cluster.run_id}: `edgeswarm chaos ACTION NODE --cluster {cluster.run_id}` "
                          "picks this cluster where several run", markup=False, soft_wrap=True)
        else:
            assert cluster.broker is not None
            console.print(f"broker: {cluster.broker.kind} (pid {cluster.broker.pid}) at {cluster.hub_url}"
                          + (" [MQTT 3.1.1 only: the envelope carries what MQTT 5 properties would]"
                             if cluster.broker.kind == "amqtt" else ""))
        edges = f" and {len(spec.edges)} edge servers" if spec.edges else ""
        console.print(f"cluster {spec.name}: coordinator on node hub, {len(spec.devices)} emulated devices{edges}; "
                      f"logs in {cluster.workdir / 'logs'}, checkpoints in {cluster.checkpoint_dir}")
        if cluster.secure:
            env_file = cluster.secrets / "operator.env"
            env_file.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in cluster.client_env().items()))
            console.print(f"secure: TLS with the CA {cluster.secrets / 'tls' / 'ca.crt'}, a password per node, the ACL "
                          f"from the topic tree; command lines log in as `operator`: `. {env_file}`", markup=False,
                          soft_wrap=True)
        late = _wait_ready(cluster, len(spec.nodes), args.ready_timeout, stop)
        hint = f". {cluster.secrets / 'operator.env'} && edgeswarm status" if cluster.secure else \
            f"edgeswarm status --hub {cluster.hub_url}"
        if isinstance(cluster, LocalCluster) and cluster.dashboard_url:
            console.print(f"dashboard: {cluster.dashboard_url}", markup=False, soft_wrap=True)
        if isinstance(cluster, LocalCluster) and cluster.gateway_url:
            console.print(f"OpenAI-compatible API (the serve-hmp jobs' language models): {cluster.gateway_url}",
                          markup=False, soft_wrap=True)
        if late:
            console.print(f"[yellow]cluster started, but not online after {args.ready_timeout:.0f} s: "
                          f"{', '.join(f'{s} on {n}' for n, s in late)}[/yellow] (their logs are in "
                          f"{cluster.workdir / 'logs'}); a job submitted now is planned without them. `{hint}`; "
                          "Ctrl-C stops it")
        else:
            console.print(f"[green]cluster up[/green], every service online: `{hint}`; Ctrl-C stops it")
        while not stop.wait(1.0):
            for child in cluster.failed_children():
                console.print(f"[red]{child.service} on {child.node} (pid {child.pid}) exited with code "
                              f"{child.process.returncode}; see {child.log_path}[/red]")
                cluster.children.remove(child)
    finally:
        count = len(cluster.children) + (len(cluster.brokers) if isinstance(cluster, NetnsCluster) else
                                         1 if cluster.broker else 0)
        cluster.stop()
        console.print(f"stopped {count} processes")
    return 0


def _wait_ready(cluster: LocalCluster | NetnsCluster, devices: int, timeout_s: float,
                stop: threading.Event) -> list[tuple[str, str]]:
    """Wait until every service the cluster started is online (every node beside the hub runs a node-agent, which
    is what ``devices`` counts); the ``(node, service)`` pairs still not online at ``timeout_s``. Raises
    EdgeswarmError when a device never came up or a service exited."""
    env = cluster.client_env()
    bus = client_bus(settings_from_env(env))
    started = {(c.node, c.service) for c in cluster.children}
    try:
        watcher = ClusterWatcher(bus)
        view, source = watcher.wait(settle_s=0.5, devices=devices, timeout_s=timeout_s, cancel=stop,
                                    services=started)
        if stop.is_set():
            raise KeyboardInterrupt
        console.print(status_table(view, source, cluster.hub_url))
        failed = cluster.failed_children()
        if failed or online_devices(view) < devices:
            details = "; ".join(f"{c.service} on {c.node} exited ({c.log_path})" for c in failed)
            raise EdgeswarmError(f"only {online_devices(view)} of {devices} devices came online within "
                                 f"{timeout_s:.0f} s. {details}")
        return not_online(view, started)
    finally:
        bus.stop()
