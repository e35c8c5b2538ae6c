"""Kernel-shaped links of one node: rate, delay, jitter and loss per peer, and partitions, all set inside the
node's network namespace.

How each property is made, and why:

- **Rate** (this node's sending toward a peer): an HTB class per peer on the node's interface, chosen by a u32
  filter on the destination address; its leaf is a byte FIFO holding about 100 ms of the rate (at least four 64 KB
  GSO packets), so a saturated link queues like a real one instead of the interface's 1000-packet default. The
  rate counts what a wire would carry (a 64 KB GSO packet counts with the headers of each of its segments), so a
  TCP stream's payload rate is about 95 percent of it (measured: 47.9 Mbit/s of payload at 50 Mbit/s).
- **Loss** (packets arriving from a peer): an nft rule ``ip saddr X numgen random mod 10000 < K drop`` in our own
  table (``ip edgeswarm``) at the prerouting hook. It drops on the receiving side on purpose: a packet dropped at
  the sender's output hook or qdisc is reported to the sending socket (TCP keeps the segment and sends it again at
  once, UDP's send fails with EPERM), which is not what a lossy wire does; a packet dropped as it arrives is a gap
  on the wire for both ends. Configure the loss of a link on both of its nodes to lose both directions.
- **Delay and jitter**: this kernel (a minimal VM build, and CI's) has no ``sch_netem``, and nftables here has no
  ``queue`` expression either (CONFIG_NFT_QUEUE is off), but the xtables NFQUEUE target is built in. So packets
  arriving from a delayed peer are sent by an ``iptables -t mangle`` rule (``-j NFQUEUE --queue-bypass``, in our
  own chain ``EDGESWARM``) to :mod:`edgeswarm.netns.delayer`, a small process in the namespace that gives each
  packet its verdict once the delay has passed. Like the loss, it acts on arrival: a packet held at the sender
  would still count against TCP's small-queue budget of the sending socket (netem orphans its packets for this
  reason), which caps a delayed link's throughput near 2 x 64 KB per delay. Where the kernel has netem
  (:func:`host.netem_available`), delay and jitter are a netem qdisc under the peer's HTB class instead (on this
  node's sending side), and no process is needed. Either way a link configured on both nodes has a round trip of
  twice the one-way delay.
- **Partitions** (:meth:`NodeShaper.block`): nft drops of everything to the address (at the interface's egress
  hook, table ``netdev edgeswarm``) and from it (prerouting hook), so one node alone can cut itself off from a
  peer in both directions. The egress hook, not the output hook, because a drop there is not an error for the
  sending socket (a connect() waits and times out, a UDP send succeeds), as on a cut cable.

Everything made is named so a later process finds it: the nft tables ``ip edgeswarm`` and ``netdev edgeswarm``,
the iptables chain ``EDGESWARM``, the HTB root ``1:``, and the delayer, which records itself in ``workdir``. The
state (shapes, class and queue numbers, blocked peers) lives in ``workdir`` too, so ``edgeswarm chaos`` can change
a link of a cluster another process started: build a ``NodeShaper`` on the same namespace and workdir, with the
cluster's process as ``owner`` (a delayer started from a short-lived command would otherwise end with it), and call
:meth:`NodeShaper.set`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from edgeswarm.netns import host, network
from edgeswarm.netns.delayer import DelayerConfig, QueueDelay
from edgeswarm.procfs import read_cmdline, read_stat
from edgeswarm.settings import LinkSpec

log = logging.getLogger(__name__)

TABLE = "edgeswarm"
CHAIN = "EDGESWARM"
UNLIMITED_BPS = 1.25e9  # 10 Gbit/s: the class rate of a peer with a netem delay but no rate limit
LOSS_SCALE = 10000  # loss resolution: 1/10000
FIRST_CLASS = 0x10
FIRST_QUEUE = 1000
QUEUE_TIME_S = 0.1  # a rate-limited class's FIFO holds this much of its rate
MIN_QUEUE_BYTES = 4 * 65536
DELAYER_START_S = 5.0
DELAYER_STOP_S = 2.0
_DEV = re.compile(r"[A-Za-z0-9_.@-]{1,15}")
STATE_FILE = "shaper-state.json"
DELAYER_CONFIG = "delayer.json"
DELAYER_LOG = "delayer.log"
DELAYER_MODULE = "edgeswarm.netns.delayer"


class LinkShape(BaseModel):
    """One link's shape as seen from one node. ``rate_bps``: bytes per second this node may send toward the peer
    (None: unlimited); ``delay_s`` and ``jitter_s``: one-way delay and its uniform spread, seconds; ``loss``: the
    fraction of packets lost (0..1). See the module docstring for which direction each acts on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rate_bps: float | None = Field(default=None, gt=0)
    delay_s: float = Field(default=0.0, ge=0, le=60)
    jitter_s: float = Field(default=0.0, ge=0, le=60)
    loss: float = Field(default=0.0, ge=0, le=1)

    def changed(self, **changes: float | None) -> LinkShape:
        """This shape with the named properties changed, the rest kept; validated as a whole (``model_copy`` would
        not check the changed values). Raises ValueError for a property a link does not have or a value it cannot
        take."""
        unknown = sorted(set(changes) - set(LinkShape.model_fields))
        if unknown:
            raise ValueError(f"a link has no {', '.join(unknown)}; it has {', '.join(LinkShape.model_fields)}")
        return LinkShape.model_validate({**self.model_dump(), **changes})

    @classmethod
    def from_link(cls, spec: LinkSpec) -> LinkShape:
        """The shape of an emulated link of a cluster or device-class file (no jitter, no loss)."""
        return cls(rate_bps=spec.bandwidth_bps, delay_s=spec.latency_s)


class PeerState(BaseModel):
    """A peer's shape and the numbers it was given (HTB minor, NFQUEUE number), kept stable across changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: LinkShape
    classid: int = Field(ge=1, le=0xFFFF)
    queue: int = Field(ge=0, le=0xFFFF)


class ShaperState(BaseModel):
    """What a NodeShaper made, saved in its workdir so another process can change or remove it."""

    model_config = ConfigDict(extra="forbid")

    ns: str
    dev: str
    owner: int | None = None  # whose exit stops the delayer: the cluster's process, or the first to apply shapes
    delayer_pid: int | None = None
    generation: int = 0
    peers: dict[str, PeerState] = Field(default_factory=dict)
    blocked: list[str] = Field(default_factory=list)

    @field_validator("blocked")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        return [str(ipaddress.IPv4Address(v)) for v in value]


def _ip(address: str) -> str:
    """``address`` checked as an IPv4 address, in canonical form (it goes into nft and tc command lines)."""
    return str(ipaddress.IPv4Address(address))


def _uses_delayer(shape: LinkShape, netem: bool) -> bool:
    return not netem and (shape.delay_s > 0 or shape.jitter_s > 0)


def _uses_class(shape: LinkShape, netem: bool) -> bool:
    return shape.rate_bps is not None or (netem and (shape.delay_s > 0 or shape.jitter_s > 0))


def nft_script(dev: str, peers: dict[str, LinkShape], blocked: Iterable[str]) -> str:
    """The nft script that replaces our two tables in one transaction: ``ip edgeswarm`` drops what arrives from
    blocked addresses and the random loss of what arrives from each lossy peer; ``netdev edgeswarm`` drops what
    this node sends to blocked addresses at ``dev``'s egress hook (there, unlike at the output hook, the drop is
    not an error for the sending socket: connect() waits and UDP's send succeeds, as on a cut cable)."""
    if not _DEV.fullmatch(dev):
        raise ValueError(f"not an interface name: {dev!r}")
    blocked = sorted({_ip(b) for b in blocked})
    pre = [f"\t\tip saddr {b} counter drop" for b in blocked]
    out = [f"\t\tip daddr {b} counter drop" for b in blocked]
    for peer, shape in sorted(peers.items()):
        threshold = round(shape.loss * LOSS_SCALE)
        if threshold > 0:
            pre.append(f"\t\tip saddr {_ip(peer)} numgen random mod {LOSS_SCALE} < {threshold} counter drop")
    lines = [
        f"table ip {TABLE}", f"delete table ip {TABLE}", f"table netdev {TABLE}", f"delete table netdev {TABLE}",
        f"table ip {TABLE} {{",
        "\tchain prerouting {", "\t\ttype filter hook prerouting priority -300; policy accept;", *pre, "\t}",
        "}",
        f"table netdev {TABLE} {{",
        "\tchain egress {", f'\t\ttype filter hook egress device "{dev}" priority 0; policy accept;', *out, "\t}",
        "}",
    ]
    return "\n".join(lines) + "\n"


def iptables_rules(peers: dict[str, PeerState], netem: bool) -> list[list[str]]:
    """The ``iptables -t mangle -A EDGESWARM`` rules (as argument lists, after the ``-A EDGESWARM``) that send
    packets arriving from each delayed peer to its queue; ``--queue-bypass`` lets them through when no delayer
    listens."""
    return [["-s", f"{_ip(peer)}/32", "-j", "NFQUEUE", "--queue-num", str(state.queue), "--queue-bypass"]
            for peer, state in sorted(peers.items()) if _uses_delayer(state.shape, netem)]


def tc_commands(dev: str, peers: dict[str, PeerState], netem: bool) -> list[list[str]]:
    """The ``tc`` commands that build the HTB tree of ``dev`` from scratch (the root is deleted first, by the
    caller): unclassified traffic leaves unshaped (``default 0``)."""
    commands = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "0"]]
    for peer, state in sorted(peers.items()):
        shape = state.shape
        if not _uses_class(shape, netem):
            continue
        minor = f"{state.classid:x}"
        if netem and (shape.delay_s > 0 or shape.jitter_s > 0):
            commands.append(_class_commands(dev, state.classid, shape, "add")[0])
            delay = ["delay", f"{round(shape.delay_s * 1e6)}us"]
            if shape.jitter_s > 0:
                delay.append(f"{round(shape.jitter_s * 1e6)}us")
            commands.append(["tc", "qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle", f"{minor}:",
                             "netem", *delay, "limit", "10000"])
        else:
            commands.extend(_class_commands(dev, state.classid, shape, "add"))
        commands.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                         "match", "ip", "dst", f"{_ip(peer)}/32", "flowid", f"1:{minor}"])
    return commands


def _class_commands(dev: str, classid: int, shape: LinkShape, verb: str) -> list[list[str]]:
    """``tc class {verb}`` of a peer's HTB class at the shape's rate, and ``tc qdisc {verb}`` of its FIFO leaf
    (sized to the rate)."""
    rate_bps = shape.rate_bps if shape.rate_bps is not None else UNLIMITED_BPS
    bits = f"{max(8, round(rate_bps * 8))}bit"
    limit = max(MIN_QUEUE_BYTES, round(rate_bps * QUEUE_TIME_S))
    minor = f"{classid:x}"
    return [["tc", "class", verb, "dev", dev, "parent", "1:", "classid", f"1:{minor}", "htb", "rate", bits, "ceil",
             bits, "quantum", "60000"],
            ["tc", "qdisc", verb, "dev", dev, "parent", f"1:{minor}", "handle", f"{minor}:", "bfifo", "limit",
             str(limit)]]


class NodeShaper:
    """The shaped links of the node in namespace ``ns``, whose interface toward the others is ``dev``. State and
    the delayer's files live in ``workdir`` (one workdir per node). Building one loads what an earlier NodeShaper
    on the same workdir applied, so any process can change or remove it.

    ``owner`` is the pid whose exit ends this node's delayer, whichever process starts it: a cluster passes its own,
    so a delay set by a command that exits right after (``edgeswarm chaos link``) stays. Without it the first
    process to apply a shape owns the delayer (and a later one takes over once that process is gone)."""

    def __init__(self, ns: str, dev: str, workdir: Path, *, owner: int | None = None) -> None:
        self.ns = ns
        self.dev = dev
        self.workdir = Path(workdir)
        self._proc: subprocess.Popen[bytes] | None = None
        state_path = self.workdir / STATE_FILE
        self.state = ShaperState(ns=ns, dev=dev)
        if state_path.exists():
            try:
                loaded = ShaperState.model_validate_json(state_path.read_text())
                if loaded.ns == ns and loaded.dev == dev:
                    self.state = loaded
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable shaper state %s: %s", state_path, exc)
        if owner is not None:
            self.state.owner = owner

    @property
    def shapes(self) -> dict[str, LinkShape]:
        """Peer address -> the shape in force."""
        return {peer: state.shape for peer, state in self.state.peers.items()}

    @property
    def blocked(self) -> list[str]:
        return list(self.state.blocked)

    def apply(self, peers: dict[str, LinkShape]) -> None:
        """Replace every shape of this node with ``peers`` (peer IPv4 address -> shape); blocks are kept. Raises
        host.HostCommandError when a command fails (the node is left partly shaped: call close())."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        old = self.state.peers
        states: dict[str, PeerState] = {}
        used_classes = {s.classid for p, s in old.items() if _ip(p) in {_ip(q) for q in peers}}
        used_queues = {s.queue for p, s in old.items() if _ip(p) in {_ip(q) for q in peers}}
        for peer, shape in peers.items():
            peer = _ip(peer)
            if peer in old:
                states[peer] = old[peer].model_copy(update={"shape": shape})
                continue
            classid = next(c for c in range(FIRST_CLASS, 0xFFFF) if c not in used_classes)
            queue = next(q for q in range(FIRST_QUEUE, 0xFFFF) if q not in used_queues)
            used_classes.add(classid)
            used_queues.add(queue)
            states[peer] = PeerState(shape=shape, classid=classid, queue=queue)
        self.state.peers = states
        if self.state.owner is None or not _alive(self.state.owner):
            self.state.owner = os.getpid()
        self._build_tc()
        self._build_filters()
        self._sync_delayer()
        self._save()

    def set(self, peer_ip: str, shape: LinkShape) -> None:
        """Change the shape of one link (a peer not shaped before is added). The change is in force when this
        returns; set the old shape back to restore it."""
        peer = _ip(peer_ip)
        old = self.state.peers.get(peer)
        if old is None:
            self.apply({**self.shapes, peer: shape})
            return
        netem = host.netem_available()
        queued_before = iptables_rules(self.state.peers, netem)
        self.state.peers[peer] = old.model_copy(update={"shape": shape})
        if not netem and _uses_class(old.shape, netem) and _uses_class(shape, netem):
            if shape.rate_bps != old.shape.rate_bps:
                for command in _class_commands(self.dev, old.classid, shape, "change"):
                    host.run(command, ns=self.ns)
        elif _uses_class(old.shape, netem) or _uses_class(shape, netem):
            self._build_tc()
        if iptables_rules(self.state.peers, netem) == queued_before:
            self._apply_nft()  # the queue rules stay: rebuilding them would let a few packets through undelayed
        else:
            self._build_filters()
        self._sync_delayer()
        self._save()

    def block(self, peer_ips: Iterable[str]) -> None:
        """Drop every packet to and from ``peer_ips`` at this node until unblock()."""
        self.state.blocked = sorted({*self.state.blocked, *(_ip(p) for p in peer_ips)})
        self._apply_nft()
        self._save()

    def unblock(self, peer_ips: Iterable[str]) -> None:
        """Let traffic to and from ``peer_ips`` pass again (their shapes still apply)."""
        gone = {_ip(p) for p in peer_ips}
        self.state.blocked = [b for b in self.state.blocked if b not in gone]
        self._apply_nft()
        self._save()

    def close(self) -> None:
        """Remove everything this node's shaping made: the delayer, the HTB tree, the nft table, the iptables
        chain and the state files. Idempotent; works after the owner crashed and when the namespace is gone."""
        self._stop_delayer()
        if self.ns in _namespaces():
            host.run(["tc", "qdisc", "del", "dev", self.dev, "root"], ns=self.ns, check=False)
            host.run(["nft", "delete", "table", "ip", TABLE], ns=self.ns, check=False)
            host.run(["nft", "delete", "table", "netdev", TABLE], ns=self.ns, check=False)
            self._drop_chain()
        for name in (STATE_FILE, DELAYER_CONFIG):
            (self.workdir / name).unlink(missing_ok=True)
        self.state = ShaperState(ns=self.ns, dev=self.dev)

    # -- the kernel side

    def _build_tc(self) -> None:
        host.run(["tc", "qdisc", "del", "dev", self.dev, "root"], ns=self.ns, check=False)
        for command in tc_commands(self.dev, self.state.peers, host.netem_available()):
            host.run(command, ns=self.ns)

    def _build_filters(self) -> None:
        self._apply_nft()
        self._drop_chain()
        rules = iptables_rules(self.state.peers, host.netem_available())
        if not rules:
            return
        host.run(["iptables", "-w", "-t", "mangle", "-N", CHAIN], ns=self.ns)
        for rule in rules:
            host.run(["iptables", "-w", "-t", "mangle", "-A", CHAIN, *rule], ns=self.ns)
        host.run(["iptables", "-w", "-t", "mangle", "-A", "PREROUTING", "-j", CHAIN], ns=self.ns)

    def _drop_chain(self) -> None:
        for _ in range(16):  # one jump per earlier apply at most; bounded in case -D keeps failing
            if not _chain_jumped(self.ns):
                break
            host.run(["iptables", "-w", "-t", "mangle", "-D", "PREROUTING", "-j", CHAIN], ns=self.ns, check=False)
        host.run(["iptables", "-w", "-t", "mangle", "-F", CHAIN], ns=self.ns, check=False)
        host.run(["iptables", "-w", "-t", "mangle", "-X", CHAIN], ns=self.ns, check=False)

    def _apply_nft(self) -> None:
        host.run(["nft", "-f", "-"], ns=self.ns, stdin=nft_script(self.dev, self.shapes, self.state.blocked))

    # -- the delayer

    def _sync_delayer(self) -> None:
        netem = host.netem_available()
        queues = {s.queue: QueueDelay(delay_s=s.shape.delay_s, jitter_s=s.shape.jitter_s)
                  for s in self.state.peers.values() if _uses_delayer(s.shape, netem)}
        if not queues:
            self._stop_delayer()
            return
        self.state.generation += 1
        config = DelayerConfig(queues=queues, seed=self.state.generation, generation=self.state.generation)
        path = self.workdir / DELAYER_CONFIG
        tmp = path.with_suffix(".tmp")
        tmp.write_text(config.model_dump_json())
        os.replace(tmp, path)
        pid = self.state.delayer_pid
        if pid is not None and _is_delayer(pid, self.ns):
            os.kill(pid, signal.SIGHUP)
        else:
            self._start_delayer(path)
        self._wait_applied(path, self.state.generation)

    def _start_delayer(self, config: Path) -> None:
        config.with_suffix(".applied").unlink(missing_ok=True)  # a dead delayer's, maybe of a higher generation
        owner = self.state.owner if self.state.owner is not None and _alive(self.state.owner) else os.getpid()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        with open(self.workdir / DELAYER_LOG, "ab") as log_file:
            self._proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, sys.executable, "-m", DELAYER_MODULE, "--config", str(config),
                 "--netns", self.ns, "--owner", str(owner)],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env, start_new_session=True)
        self.state.delayer_pid = self._proc.pid

    def _wait_applied(self, config: Path, generation: int) -> None:
        applied = config.with_suffix(".applied")
        deadline = time.monotonic() + DELAYER_START_S
        while time.monotonic() < deadline:
            try:
                if int(applied.read_text() or -1) >= generation:
                    return
            except (OSError, ValueError):
                pass
            if self._proc is not None and self._proc.poll() is not None:
                break
            time.sleep(0.02)
        raise host.HostCommandError(f"the delayer of {self.ns} did not take its configuration; see "
                                    f"{self.workdir / DELAYER_LOG}")

    def _stop_delayer(self) -> None:
        # Every process of the namespace, filtered: also a delayer whose pid a crash kept out of the state file (one
        # whose namespace is gone stops by itself).
        candidates = [self.state.delayer_pid, *network.pids_in(self.ns)]
        pids = {p for p in candidates if p is not None and _is_delayer(p, self.ns)}
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + DELAYER_STOP_S
        for pid in pids:
            while _is_delayer(pid, self.ns) and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.02)
            if _is_delayer(pid, self.ns):
                log.warning("delayer %d of %s ignored SIGTERM: killing it", pid, self.ns)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._reap(block=True)
        self.state.delayer_pid = None
        for suffix in (".applied",):
            (self.workdir / DELAYER_CONFIG).with_suffix(suffix).unlink(missing_ok=True)

    def _reap(self, block: bool = False) -> None:
        if self._proc is None:
            return
        try:
            self._proc.wait(timeout=DELAYER_STOP_S if block else 0)
        except subprocess.TimeoutExpired:
            return
        self._proc = None

    def _save(self) -> None:
        path = self.workdir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.state.model_dump_json())
        os.replace(tmp, path)


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _is_delayer(pid: int, ns: str) -> bool:
    """Whether ``pid`` is (still) the delayer of namespace ``ns`` and not a zombie (a pid may have been reused)."""
    cmd = read_cmdline(pid) or []
    if DELAYER_MODULE not in cmd or ns not in cmd:
        return False
    stat = read_stat(pid)
    return stat is not None and stat.state != "Z"


def _chain_jumped(ns: str) -> bool:
    rules = host.run(["iptables", "-w", "-t", "mangle", "-S", "PREROUTING"], ns=ns, check=False)
    return f"-j {CHAIN}" in rules


def _namespaces() -> list[str]:
    try:
        return host.netns_names()
    except host.HostCommandError:
        return []
