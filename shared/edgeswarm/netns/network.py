"""Creating and removing a namespace cluster's network: a bridge in the root namespace (whose address is how this
machine's command lines reach the nodes), and per node a namespace joined to it by a veth pair, with its address on
``eth0`` and loopback up. Cutting a node off is its host-side veth going down, as a Wi-Fi link drops."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import time

from edgeswarm.netns import host
from edgeswarm.netns.state import FIRST_NODE_INDEX, NetnsNode, NetnsState, owner_alive, saved_states

log = logging.getLogger(__name__)

INSIDE_DEV = "eth0"


def addresses_in_use() -> list[str]:
    """Every IPv4 address (with prefix) of the root namespace, and every saved cluster's subnet."""
    out = host.run(["ip", "-4", "-o", "addr", "show"])
    found = [line.split()[3] for line in out.splitlines() if len(line.split()) > 3]
    return found + [s.subnet for s in saved_states()]


def create(state: NetnsState) -> None:
    """Make the bridge and every node's namespace and link. Raises HostCommandError; the caller removes what was
    made (``destroy``), also after a partial failure."""
    prefix = state.prefix_len
    host.run(["ip", "link", "add", state.bridge, "type", "bridge"])
    host.run(["ip", "addr", "add", f"{state.host_address}/{prefix}", "dev", state.bridge])
    host.run(["ip", "link", "set", state.bridge, "up"])
    for node in state.nodes:
        host.run(["ip", "netns", "add", node.netns])
        host.run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", INSIDE_DEV, "netns", node.netns])
        host.run(["ip", "link", "set", node.veth, "master", state.bridge])
        host.run(["ip", "link", "set", node.veth, "up"])
        host.run(["ip", "addr", "add", f"{node.address}/{prefix}", "dev", INSIDE_DEV], ns=node.netns)
        host.run(["ip", "link", "set", "lo", "up"], ns=node.netns)
        host.run(["ip", "link", "set", INSIDE_DEV, "up"], ns=node.netns)


def pids_in(netns: str) -> list[int]:
    """The processes whose network namespace is ``netns`` (empty when it does not exist)."""
    out = host.run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def kill_all_in(netns: str, timeout_s: float = 5.0) -> None:
    """SIGTERM every process in ``netns``, then SIGKILL whatever is left after ``timeout_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [p for p in pids_in(netns) if p != os.getpid()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 2.0)
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            time.sleep(0.05)
        if not pids:
            return


def destroy(state: NetnsState) -> None:
    """Remove everything ``state`` names: the processes in its namespaces, the namespaces (their veths go with
    them), the bridge, the state file. Never raises for what is already gone."""
    existing = set(host.netns_names())
    for node in state.nodes:
        if node.netns in existing:
            kill_all_in(node.netns)
            host.run(["ip", "netns", "del", node.netns], check=False)
        host.run(["ip", "link", "del", node.veth], check=False)
    host.run(["ip", "link", "del", state.bridge], check=False)
    state.path().unlink(missing_ok=True)


def clean_stale() -> list[str]:
    """Remove every saved cluster whose owner is dead (a launcher killed by SIGKILL or a crash). Returns their
    run ids."""
    removed = []
    for state in saved_states():
        if not owner_alive(state):
            log.warning("removing namespace cluster %s left by dead process %d", state.run_id, state.owner_pid)
            destroy(state)
            removed.append(state.run_id)
    return removed


def set_link(node: NetnsNode, up: bool) -> None:
    """Bring ``node``'s host-side link up or down (down: cut off from every other node and the host)."""
    host.run(["ip", "link", "set", node.veth, "up" if up else "down"])


def layout(run_id: str, subnet: str, nodes: list[tuple[str, str]]) -> list[NetnsNode]:
    """Names and addresses for ``nodes`` (name, role), in order, on ``subnet``."""
    net = ipaddress.ip_network(subnet)
    if len(nodes) + FIRST_NODE_INDEX > net.num_addresses - 2:
        raise ValueError(f"{len(nodes)} nodes do not fit in {subnet}")
    return [NetnsNode(node=name, role=role, netns=f"es{run_id}-{name}", address=str(net[FIRST_NODE_INDEX + i]),  # type: ignore[arg-type]
                      veth=f"es{run_id}h{i}") for i, (name, role) in enumerate(nodes)]

