"""A namespace cluster's faults, from any process: a partition as blackhole routes inside each node's namespace
(packets to the other side are dropped where they would be sent, silently, as a dead switch port drops them),
signals to every process of a node, a broker restart, and link changes through the nodes' shapers (the shapes in
force are kept in the cluster's folder, so a change names only what it changes)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from edgeswarm.files import locked
from edgeswarm.netns import brokers, host, network
from edgeswarm.netns.shaping import LinkShape, NodeShaper
from edgeswarm.netns.state import NetnsNode, NetnsState

log = logging.getLogger(__name__)


def partition(nodes: list[NetnsNode], groups: list[list[NetnsNode]]) -> None:
    """Drop traffic between nodes of different ``groups``; a node in no group keeps every link. Idempotent."""
    side = {n.node: i for i, group in enumerate(groups) for n in group}
    for node in nodes:
        if node.node not in side:
            continue
        for peer in nodes:
            if peer.node in side and side[peer.node] != side[node.node]:
                host.run(["ip", "route", "replace", "blackhole", f"{peer.address}/32"], ns=node.netns)


def heal_partition(nodes: list[NetnsNode]) -> None:
    """Remove every partition route (what is already gone is skipped)."""
    for node in nodes:
        out = host.run(["ip", "route", "show", "type", "blackhole"], ns=node.netns, check=False)
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "blackhole":
                host.run(["ip", "route", "del", "blackhole", parts[1]], ns=node.netns, check=False)


def signal_node(node: NetnsNode, sig: signal.Signals) -> int:
    """Send ``sig`` to every process in ``node``'s namespace; returns how many got it."""
    count = 0
    for pid in network.pids_in(node.netns):
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, sig)
            count += 1
        except ProcessLookupError:
            pass
    return count


def broker_pids(node: NetnsNode) -> list[int]:
    """The Mosquitto processes in ``node``'s namespace."""
    out = []
    for pid in network.pids_in(node.netns):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "mosquitto":
                out.append(pid)
        except OSError:
            continue
    return out


def restart_broker(state: NetnsState, name: str, *, down_s: float = 1.0,
                   kill: bool = False) -> tuple[subprocess.Popen[bytes], float]:
    """Stop ``name``'s broker (SIGTERM, or SIGKILL as a crash), wait ``down_s``, start it again from the
    configuration the cluster wrote; returns the new broker's process and the seconds it was unreachable. Works from
    any process (the new broker is in its own session, and the cluster's stop removes it with the namespace)."""
    node = state.node(name)
    folder = Path(state.workdir) / "brokers" / name
    started = time.monotonic()
    for pid in broker_pids(node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while broker_pids(node) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(down_s)
    proc = brokers.start(node, folder / "mosquitto.conf", folder / "mosquitto.log")
    return proc, time.monotonic() - started


def shaper_of(state: NetnsState, name: str) -> NodeShaper:
    """``name``'s kernel shaper, rebuilt from the state it keeps in the cluster's folder. The cluster's launcher
    owns it, the hub's too, whichever process changes it: a delay line started by a short-lived ``edgeswarm chaos``
    lives as long as the cluster, not as long as that command."""
    node = state.node(name)
    return NodeShaper(node.netns, network.INSIDE_DEV, Path(state.workdir) / "shaping" / name, owner=state.owner_pid)


@contextlib.contextmanager
def links_lock(state: NetnsState) -> Iterator[None]:
    """Held while a link's shapes are read and written back, so that two ``chaos link`` commands at once (another
    process each) never write over each other's change."""
    with locked(Path(state.workdir) / "shaping" / ".lock"):
        yield


def set_link(state: NetnsState, a: str, b: str, shape: LinkShape) -> dict[str, LinkShape]:
    """Shape the link between nodes ``a`` and ``b`` as ``shape`` in both directions (each end shapes what it sends
    and receives from the other), replacing the whole shape. Returns each end's previous shape of it, by node
    (unshaped: a default shape)."""
    return change_link(state, a, b, **shape.model_dump())


def change_link(state: NetnsState, a: str, b: str, **changes: float | None) -> dict[str, LinkShape]:
    """Change only the named properties of the link between nodes ``a`` and ``b`` (``LinkShape`` fields: ``rate_bps``
    (None: unlimited), ``delay_s``, ``jitter_s``, ``loss``), at both ends; each end keeps the rest of what it had
    (the cluster file's rate and delay, an earlier change). Returns each end's previous shape, by node, for
    ``restore_link``. Raises ValueError for a property a link does not have or a value it cannot take."""
    before = {}
    with links_lock(state):
        for here, there in ((a, b), (b, a)):
            shaper = shaper_of(state, here)
            peer = state.node(there).address
            before[here] = shaper.shapes.get(peer, LinkShape())
            shaper.set(peer, before[here].changed(**changes))
    return before


def restore_link(state: NetnsState, a: str, b: str, before: dict[str, LinkShape]) -> None:
    """Put back exactly what ``set_link`` or ``change_link`` returned, whatever changed the link meanwhile."""
    with links_lock(state):
        for here, there in ((a, b), (b, a)):
            if here in before:
                shaper_of(state, here).set(state.node(there).address, before[here])
