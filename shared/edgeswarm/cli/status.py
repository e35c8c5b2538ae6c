"""``edgeswarm status`` and ``edgeswarm topics``."""

from __future__ import annotations

import argparse
import json

from rich.markup import escape
from rich.table import Table

from edgeswarm.cli.common import cli_settings, hub_url
from edgeswarm.cli.console import console
from edgeswarm.messages import ClusterView
from edgeswarm.messages.cluster import NodeView
from edgeswarm.runtime.client import CLI_CONNECT_TIMEOUT_S, ClusterWatcher, ViewSource, client_bus, online_devices
from edgeswarm.service_registry import services
from edgeswarm.topics import service_topics, topic_tree

_STATE_STYLE = {"online": "green", "suspect": "yellow", "offline": "red"}


def run_status(args: argparse.Namespace) -> int:
    # When asked to wait for devices, also wait for a broker that is still starting.
    bus = client_bus(cli_settings(hub_url(args.hub)), connect_timeout_s=max(args.timeout if args.wait_devices else 0,
                                                                             CLI_CONNECT_TIMEOUT_S))
    try:
        watcher = ClusterWatcher(bus)
        view, source = watcher.wait(devices=args.wait_devices, timeout_s=args.timeout if args.wait_devices else 0)
    finally:
        bus.stop()
    if args.json:
        print(view.model_dump_json(indent=2))
    else:
        console.print(status_table(view, source, bus.hub.url))
        for node in view.nodes:
            for conflict in node.conflicts:
                console.print(f"[red]duplicate node id:[/red] {escape(conflict)}")
    if online_devices(view) < args.wait_devices:
        console.print(f"[red]only {online_devices(view)} of {args.wait_devices} devices online "
                      f"after {args.timeout:.0f} s[/red]")
        return 1
    return 0


def status_table(view: ClusterView, source: ViewSource, url: str) -> Table:
    """The view as a table: one row per service instance."""
    table = Table(title=f"edgeswarm cluster at {url} ({len(view.nodes)} nodes; view from {source})")
    for col in ("node", "class", "compute", "service", "state", "heartbeat age", "memory reserved / used / budget",
                "instance", "pid"):
        table.add_column(col, justify="right" if col in ("heartbeat age", "pid") else "left")
    for node in view.nodes:
        for i, svc in enumerate(node.services):
            age = "-" if svc.heartbeat_age_s is None else f"{svc.heartbeat_age_s:.1f} s"
            memory = _memory(node)
            # Every string here came from the network: escaped, so a "[/x]" in it is text, not rich markup.
            table.add_row(node.node if i == 0 else "", escape(node.device_class) if i == 0 else "",
                          (escape(node.compute) or "-") if i == 0 else "", svc.service,
                          f"[{_STATE_STYLE[svc.state]}]{svc.state}[/]", age, memory if i == 0 else "",
                          svc.instance, str(svc.pid))
    return table


def _memory(node: NodeView) -> str:
    """A node's memory: reserved in its ledger for jobs, used (the budget less what is free), and its budget."""
    used = max(0, node.memory_budget_bytes - node.free_memory_bytes)
    return " / ".join(_size(n) for n in (node.reserved_memory_bytes, used, node.memory_budget_bytes))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def run_topics(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps([t.model_dump() for t in topic_tree()], indent=2))
        return 0
    table = Table(title="edgeswarm topic tree")
    for col in ("topic", "schema", "retained", "QoS", "broker", "written by", "read by", "purpose"):
        table.add_column(col, overflow="fold")
    for t in topic_tree():
        table.add_row(escape(t.pattern), t.schemas, "yes" if t.retained else "no", str(t.qos), t.broker,
                      escape(t.who_writes), "the node it names" if t.readers == "node" else "every member",
                      t.purpose)
    console.print(table)
    # Every installed service, plug-ins' included, with its own two topics: the tree above has a row of its own only
    # for a service whose writers are not the defaults.
    table = Table(title="installed services: the topics each is addressed on")
    for col in ("service", "runs on", "requests", "requests written by", "tensors", "tensors written by"):
        table.add_column(col, overflow="fold")
    for name, entry in services().items():
        requests, tensors = service_topics(name)
        table.add_row(name, ", ".join(entry.roles), escape(requests.pattern), escape(requests.who_writes),
                      escape(tensors.pattern), escape(tensors.who_writes))
    console.print(table)
    return 0
