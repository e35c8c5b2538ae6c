"""What a namespace cluster created, on disk, so that every part of it can be found again: by ``edgeswarm chaos``
(another process), by ``stop()``, and by the next start after a crash, which removes what a dead owner left.

Names carry the run id: namespaces ``es<id>-<node>``, the bridge ``es<id>br``, host-side veths ``es<id>h<n>``
(interface names are at most 15 characters). The state files live in ``/run/edgeswarm-netns`` (a tmpfs: a reboot,
which also removes every namespace, empties it)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from edgeswarm.files import locked
from edgeswarm.procfs import read_stat
from edgeswarm.roles import NodeRole

STATE_DIR = Path(os.environ.get("EDGESWARM_NETNS_STATE_DIR", "/run/edgeswarm-netns"))
BROKER_PORT = 8883  # every node's broker listens where compose.yaml puts it: TLS on 8883, in its own namespace
SUBNETS = ipaddress.ip_network("10.123.0.0/16")  # one /24 of it per cluster, the first one no address here uses
HOST_INDEX = 1  # the bridge's address in the root namespace (how command lines reach the hub): .1
FIRST_NODE_INDEX = 10  # nodes get .10, .11, ... in cluster order, the hub first


class NetnsNode(BaseModel):
    """One node: its namespace, address, role and the host side of its link to the bridge."""

    model_config = ConfigDict(frozen=True)

    node: str
    role: NodeRole
    netns: str
    address: str
    veth: str  # the host-side end, on the bridge; the namespace's end is ``eth0``

    @property
    def broker_url(self) -> str:
        return f"mqtts://{self.address}:{BROKER_PORT}"


class NetnsState(BaseModel):
    """A running namespace cluster: who owns it (the launcher's pid), its network and its nodes."""

    run_id: str
    owner_pid: int
    owner_started: int | None = None  # the owner's start time (``process_start_ticks``)
    subnet: str
    bridge: str
    workdir: str
    nodes: list[NetnsNode]

    def node(self, name: str) -> NetnsNode:
        for n in self.nodes:
            if n.node == name:
                return n
        raise KeyError(name)

    @property
    def hub(self) -> NetnsNode:
        return next(n for n in self.nodes if n.role == "hub")

    @property
    def host_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[HOST_INDEX])

    @property
    def prefix_len(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def path(self) -> Path:
        return STATE_DIR / f"{self.run_id}.json"

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = self.path().with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=1))
        tmp.replace(self.path())


def new_run_id() -> str:
    """Four hex digits: short enough for interface names, and checked against the state files in use."""
    taken = {p.stem for p in STATE_DIR.glob("*.json")} if STATE_DIR.exists() else set()
    while True:
        rid = secrets.token_hex(2)
        if rid not in taken:
            return rid


def saved_states() -> list[NetnsState]:
    """Every state file, oldest first; unreadable ones are skipped (a crash mid-write leaves only ``.tmp``)."""
    if not STATE_DIR.exists():
        return []
    out = []
    for path in sorted(STATE_DIR.glob("*.json"), key=lambda p: p.stat().st_mtime):
        try:
            out.append(NetnsState.model_validate_json(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, /proc/PID/stat field 22), or None when it does not
    exist: with the pid, what tells a process from a later one that reuses its pid."""
    stat = read_stat(pid)
    return None if stat is None else stat.start_ticks


def owner_alive(state: NetnsState) -> bool:
    """Whether the process that made ``state`` still runs (the same process: its pid and its start time)."""
    started = process_start_ticks(state.owner_pid)
    return started is not None and started == state.owner_started


@contextlib.contextmanager
def allocation_lock() -> Iterator[None]:
    """Held while a cluster picks its run id and subnet and records them, so two starting at once never take the
    same subnet."""
    with locked(STATE_DIR / ".lock"):
        yield


def free_subnet(addresses_in_use: list[str]) -> str:
    """The first /24 of ``SUBNETS`` that no address in use (root namespace addresses, other clusters' subnets)
    falls in. Raises RuntimeError when all 256 are taken."""
    used = [ipaddress.ip_interface(a).network if "/" in a else ipaddress.ip_network(a) for a in addresses_in_use]
    for net in SUBNETS.subnets(new_prefix=24):
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise RuntimeError(f"every /24 of {SUBNETS} is in use")


def clock_file(workdir: Path | str, node: str) -> Path:
    """The file whose offset every process of ``node`` adds to its wall clock (``netns.clock``)."""
    return Path(workdir) / "nodes" / node / "clock"
