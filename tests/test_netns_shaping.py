"""Kernel-shaped links between two network namespaces: the measured rate, round trip and loss of a real TCP/UDP
socket pair against the configured shape (rate within 15 percent, round trip within 2 ms of twice the one-way
delay), runtime changes, partitions, and that close() (or the owner's death) leaves nothing behind."""

from __future__ import annotations

import json
import os
import random
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgeswarm.netns import host
from edgeswarm.netns.delayer import DelayLine, QueueDelay, bind_messages, parse_packets, verdict_batch
from edgeswarm.netns.shaping import LinkShape, NodeShaper, PeerState, iptables_rules, nft_script, tc_commands
from edgeswarm.settings import LinkSpec

PROBE = str(Path(__file__).with_name("netns_probe.py"))
TOOLS = ("ip", "tc", "nft", "iptables")
MBIT = 1e6 / 8  # bytes per second


def _why_not() -> str | None:
    try:
        host.preflight(TOOLS)
    except host.NetnsUnavailableError as exc:
        return str(exc)
    return None


needs_netns = pytest.mark.skipif(_why_not() is not None, reason=f"namespace shaping unavailable: {_why_not()}")


# -- pure helpers


def test_link_shape_from_link_spec() -> None:
    shape = LinkShape.from_link(LinkSpec(bandwidth_bps=1.25e6, latency_s=0.02))
    assert shape == LinkShape(rate_bps=1.25e6, delay_s=0.02)
    with pytest.raises(ValueError):
        LinkShape(loss=1.5)
    with pytest.raises(ValueError):
        LinkShape(rate_bps=0)


def test_nft_script_drops_blocked_both_ways_and_loses_on_arrival() -> None:
    script = nft_script("veth0", {"10.0.0.2": LinkShape(loss=0.05), "10.0.0.3": LinkShape(delay_s=0.01)},
                        ["10.0.0.4"])
    assert script.startswith("table ip edgeswarm\ndelete table ip edgeswarm\n")  # replaced in one transaction
    assert "ip saddr 10.0.0.4 counter drop" in script and "ip daddr 10.0.0.4 counter drop" in script
    assert 'hook egress device "veth0"' in script
    assert "ip saddr 10.0.0.2 numgen random mod 10000 < 500 counter drop" in script
    assert "10.0.0.3" not in script  # no loss, not blocked: no rule
    with pytest.raises(ValueError):
        nft_script("veth0", {"10.0.0.2; flush ruleset": LinkShape(loss=0.1)}, [])
    with pytest.raises(ValueError):
        nft_script('veth0" ; flush ruleset', {}, [])


def test_tc_and_iptables_commands_follow_the_shapes() -> None:
    peers = {"10.0.0.2": PeerState(shape=LinkShape(rate_bps=50 * MBIT), classid=0x10, queue=1000),
             "10.0.0.3": PeerState(shape=LinkShape(delay_s=0.01, jitter_s=0.002), classid=0x11, queue=1001)}
    commands = tc_commands("eth0", peers, netem=False)
    joined = [" ".join(c) for c in commands]
    assert joined[0] == "tc qdisc add dev eth0 root handle 1: htb default 0"
    assert any("classid 1:10 htb rate 50000000bit ceil 50000000bit" in c for c in joined)
    assert any("match ip dst 10.0.0.2/32 flowid 1:10" in c for c in joined)
    assert not any("10.0.0.3" in c or "1:11" in c for c in joined)  # delay alone: no class without netem
    assert iptables_rules(peers, netem=False) == [
        ["-s", "10.0.0.3/32", "-j", "NFQUEUE", "--queue-num", "1001", "--queue-bypass"]]
    with_netem = [" ".join(c) for c in tc_commands("eth0", peers, netem=True)]
    assert any("parent 1:11 handle 11: netem delay 10000us 2000us" in c for c in with_netem)
    assert iptables_rules(peers, netem=True) == []


def _packet_message(queue: int, packet_id: int) -> bytes:
    attr = struct.pack("=HH", 11, 1) + struct.pack("!IHB", packet_id, 0x0800, 0) + b"\0"
    body = struct.pack("!BBH", 2, 0, queue) + attr
    return struct.pack("=IHHII", 16 + len(body), (3 << 8) | 0, 0, 0, 0) + body


def test_delayer_parses_packets_and_survives_garbage() -> None:
    ack = struct.pack("=IHHII", 36, 2, 0, 7, 0) + struct.pack("=i", -1) + b"\0" * 16
    data = _packet_message(1000, 41) + ack + _packet_message(1001, 42)
    assert parse_packets(data) == ([(1000, 41), (1001, 42)], {7: 1})
    rng = random.Random(3)
    for _ in range(300):  # truncated and corrupted messages are skipped, never raised
        cut = bytearray(data[: rng.randrange(len(data) + 1)])
        for _ in range(rng.randrange(4)):
            if cut:
                cut[rng.randrange(len(cut))] = rng.randrange(256)
        packets, _ = parse_packets(bytes(cut))
        assert all(0 <= q <= 0xFFFF for q, _ in packets)
    assert parse_packets(struct.pack("=IHHII", 0, 0, 0, 0, 0)) == ([], {})  # a zero length never loops


def test_delayer_messages_have_the_netlink_layout() -> None:
    bind, params = bind_messages(1234, seq=5)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", bind)
    assert (length, kind, flags & 0x5, seq) == (len(bind), (3 << 8) | 2, 0x5, 5)
    assert struct.unpack_from("!H", bind, 18)[0] == 1234
    assert struct.unpack_from("=IHHII", params)[3] == 6
    verdict = verdict_batch(7, 99)
    assert struct.unpack_from("=H", verdict, 4)[0] == (3 << 8) | 3
    assert struct.unpack_from("!II", verdict, 24) == (1, 99)  # NF_ACCEPT, every id up to 99


def test_delay_line_holds_each_packet_and_never_reorders() -> None:
    line = DelayLine(QueueDelay(delay_s=0.010, jitter_s=0.008), random.Random(1))
    for i in range(200):
        line.add(i, now=i * 0.001)
    released: list[int] = []
    t = 0.0
    while len(line):
        last = line.due(t)
        if last is not None:
            assert not released or last > released[-1]
            released.append(last)
        t += 0.0005
    assert released[-1] == 199
    plain = DelayLine(QueueDelay(delay_s=0.010), random.Random(1))
    plain.add(5, now=1.0)
    assert plain.due(1.0099) is None and plain.due(1.0101) == 5


# -- two namespaces


@dataclass
class Pair:
    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    ip_a: str
    ip_b: str
    work: Path


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[Pair]:
    pid = os.getpid()
    p = Pair(f"esta{pid}", f"estb{pid}", f"esta{pid}", f"estb{pid}", "10.231.0.1", "10.231.0.2", tmp_path)
    try:
        _sh("ip", "netns", "add", p.ns_a)
        _sh("ip", "netns", "add", p.ns_b)
        _sh("ip", "link", "add", p.dev_a, "type", "veth", "peer", "name", p.dev_b)
        for ns, dev, ip in ((p.ns_a, p.dev_a, p.ip_a), (p.ns_b, p.dev_b, p.ip_b)):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield p
    finally:
        for ns in (p.ns_a, p.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", p.dev_a], capture_output=True, timeout=20)


def _shapers(p: Pair) -> tuple[NodeShaper, NodeShaper]:
    return NodeShaper(p.ns_a, p.dev_a, p.work / "a"), NodeShaper(p.ns_b, p.dev_b, p.work / "b")


class _Server:
    """A probe server in a namespace, started and stopped by PID."""

    def __init__(self, ns: str, *args: str) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, PROBE, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready", self.proc.stderr.read() if self.proc.stderr else ""

    def result(self, timeout: float = 20) -> dict:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


def _client(ns: str, *args: str, timeout: float = 30) -> dict:
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, PROBE, *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rate(p: Pair, port: int, seconds: float = 2.0) -> float:
    """The median received rate (bytes/s) of a TCP stream from A to B."""
    server = _Server(p.ns_b, "sink", p.ip_b, str(port), "15")
    try:
        _client(p.ns_a, "send", p.ip_b, str(port), str(seconds))
        rates = server.result()["rates"]
    finally:
        server.stop()
    assert len(rates) >= 3, rates
    return statistics.median(rates)


def _rtts(p: Pair, port: int, count: int = 25) -> list[float]:
    """Round trips (seconds) of 64-byte exchanges over one TCP connection from A to B."""
    server = _Server(p.ns_b, "echo", p.ip_b, str(port), "15")
    try:
        return _client(p.ns_a, "ping", p.ip_b, str(port), str(count))["rtts"]
    finally:
        server.stop()


def _rtt(p: Pair, port: int, count: int = 25) -> float:
    return statistics.median(_rtts(p, port, count))


def _assert_rate(measured: float, configured: float) -> None:
    message = f"{measured / MBIT:.1f} Mbit/s against {configured / MBIT:.1f}"
    assert abs(measured - configured) <= 0.15 * configured, message


@needs_netns
def test_rate_is_the_configured_one_and_set_changes_it(pair: Pair) -> None:
    a, b = _shapers(pair)
    try:
        a.apply({pair.ip_b: LinkShape(rate_bps=50 * MBIT)})
        _assert_rate(_rate(pair, 5001), 50 * MBIT)
        a.set(pair.ip_b, LinkShape(rate_bps=10 * MBIT))
        _assert_rate(_rate(pair, 5002), 10 * MBIT)
        a.set(pair.ip_b, LinkShape(rate_bps=50 * MBIT))  # restored
        _assert_rate(_rate(pair, 5003), 50 * MBIT)
    finally:
        a.close()
        b.close()


@needs_netns
def test_round_trip_is_twice_the_delay_and_a_live_change_restores(pair: Pair) -> None:
    a, b = _shapers(pair)
    try:
        base = _rtt(pair, 5010)
        a.apply({pair.ip_b: LinkShape(delay_s=0.010)})
        b.apply({pair.ip_a: LinkShape(delay_s=0.010)})
        assert abs(_rtt(pair, 5011) - 0.020) <= 0.002 + base
        a.set(pair.ip_b, LinkShape(delay_s=0.030))  # chaos: more delay for a while
        assert abs(_rtt(pair, 5012) - 0.040) <= 0.002 + base
        a.set(pair.ip_b, LinkShape(delay_s=0.010))
        assert abs(_rtt(pair, 5013) - 0.020) <= 0.002 + base
        a.set(pair.ip_b, LinkShape(delay_s=0.010, jitter_s=0.004))  # uniform in 6..14 ms one way
        rtts = _rtts(pair, 5014, count=40)
        assert abs(statistics.median(rtts) - 0.020) <= 0.002 + base
        assert statistics.pstdev(rtts) > 0.001 and max(rtts) - min(rtts) > 0.004
        assert min(rtts) >= 0.016 - 0.001  # never less than the least delay drawn (6 + 10 ms)
    finally:
        a.close()
        b.close()


@needs_netns
def test_rate_and_delay_together(pair: Pair) -> None:
    a, b = _shapers(pair)
    try:
        a.apply({pair.ip_b: LinkShape(rate_bps=10 * MBIT, delay_s=0.005)})
        b.apply({pair.ip_a: LinkShape(rate_bps=10 * MBIT, delay_s=0.005)})
        _assert_rate(_rate(pair, 5020, seconds=2.5), 10 * MBIT)
        assert abs(_rtt(pair, 5021) - 0.010) <= 0.002
    finally:
        a.close()
        b.close()


@needs_netns
def test_loss_drops_about_the_configured_fraction_and_tcp_still_completes(pair: Pair) -> None:
    a, b = _shapers(pair)
    sent = 4000
    try:
        b.apply({pair.ip_a: LinkShape(loss=0.05)})  # packets from A are lost as they arrive at B
        server = _Server(pair.ns_b, "udp-count", pair.ip_b, "5030", "1.0")
        try:
            assert _client(pair.ns_a, "udp-send", pair.ip_b, "5030", str(sent))["errors"] == 0  # sender never sees it
            received = server.result()["received"]
        finally:
            server.stop()
        # 5 percent of 4000 is 200 lost, sd about 14: the bound is more than 7 sd wide on each side.
        assert 100 <= sent - received <= 300, received
        b.set(pair.ip_a, LinkShape())  # restored: nothing lost
        server = _Server(pair.ns_b, "udp-count", pair.ip_b, "5032", "1.0")
        try:
            _client(pair.ns_a, "udp-send", pair.ip_b, "5032", str(sent))
            assert server.result()["received"] == sent
        finally:
            server.stop()
        server = _Server(pair.ns_b, "sink", pair.ip_b, "5031", "15")
        try:
            _client(pair.ns_a, "send", pair.ip_b, "5031", "1.0")
            assert server.result()["total"] > 0
        finally:
            server.stop()
    finally:
        a.close()
        b.close()


@needs_netns
def test_block_cuts_both_directions_and_unblock_heals(pair: Pair) -> None:
    a, b = _shapers(pair)
    listen_a = _Server(pair.ns_a, "listen", pair.ip_a, "5040")
    listen_b = _Server(pair.ns_b, "listen", pair.ip_b, "5041")
    try:
        a.apply({pair.ip_b: LinkShape(delay_s=0.002)})
        assert _client(pair.ns_a, "connect", pair.ip_b, "5041", "2")["connected"]
        a.block([pair.ip_b])
        # Both directions are cut, and as on a cut cable: connect() times out (no EPERM), a UDP send succeeds.
        out = _client(pair.ns_a, "connect", pair.ip_b, "5041", "1")
        assert not out["connected"] and "timed out" in out["error"]
        assert not _client(pair.ns_b, "connect", pair.ip_a, "5040", "1")["connected"]
        assert _client(pair.ns_a, "udp-send", pair.ip_b, "5042", "20")["errors"] == 0
        a.unblock([pair.ip_b])
        assert _client(pair.ns_a, "connect", pair.ip_b, "5041", "2")["connected"]
        assert _client(pair.ns_b, "connect", pair.ip_a, "5040", "2")["connected"]
        assert a.shapes == {pair.ip_b: LinkShape(delay_s=0.002)}  # the shape outlived the partition
    finally:
        listen_a.stop()
        listen_b.stop()
        a.close()
        b.close()


def _leftovers(ns: str, dev: str) -> list[str]:
    found = []
    if "htb" in host.run(["tc", "qdisc", "show", "dev", dev], ns=ns):
        found.append("htb qdisc")
    if "edgeswarm" in host.run(["nft", "list", "tables"], ns=ns):
        found.append("nft table")
    if "EDGESWARM" in host.run(["iptables", "-w", "-t", "mangle", "-S"], ns=ns):
        found.append("iptables chain")
    return found


def _delayer_pids(ns: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"edgeswarm.netns.delayer" in cmd and ns.encode() in cmd:
            pids.append(int(entry.name))
    return pids


def _wait_gone(ns: str, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while _delayer_pids(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _delayer_pids(ns)


@needs_netns
def test_close_leaves_nothing_and_is_idempotent(pair: Pair) -> None:
    a, _ = _shapers(pair)
    try:
        a.apply({pair.ip_b: LinkShape(rate_bps=10 * MBIT, delay_s=0.005, loss=0.01)})
        a.block([pair.ip_b])
        assert _delayer_pids(pair.ns_a) and _leftovers(pair.ns_a, pair.dev_a) == ["htb qdisc", "nft table",
                                                                                  "iptables chain"]
        NodeShaper(pair.ns_a, pair.dev_a, pair.work / "a").close()  # another process's view closes it all
        assert _leftovers(pair.ns_a, pair.dev_a) == [] and _wait_gone(pair.ns_a, 0.5) == []
        a.close()
        assert _leftovers(pair.ns_a, pair.dev_a) == []
    finally:
        a.close()


@needs_netns
def test_the_delayer_dies_with_its_owner_or_its_namespace(pair: Pair) -> None:
    script = ("import sys; from pathlib import Path; from edgeswarm.netns.shaping import LinkShape, NodeShaper; "
              "NodeShaper(sys.argv[1], sys.argv[2], Path(sys.argv[3])).apply({sys.argv[4]: LinkShape(delay_s=0.005)})")
    try:
        # The owner applies a delay and exits without close(), as a crash would.
        subprocess.run([sys.executable, "-c", script, pair.ns_a, pair.dev_a, str(pair.work / "a"), pair.ip_b],
                       check=True, timeout=30)
        assert _wait_gone(pair.ns_a) == []
        a = NodeShaper(pair.ns_a, pair.dev_a, pair.work / "a")
        a.close()  # a later cleanup removes what the dead owner left
        assert _leftovers(pair.ns_a, pair.dev_a) == []
        # The owner is alive but the namespace goes (a cleanup that deletes namespaces).
        b = NodeShaper(pair.ns_b, pair.dev_b, pair.work / "b")
        b.apply({pair.ip_a: LinkShape(delay_s=0.005)})
        assert _delayer_pids(pair.ns_b)
        subprocess.run(["ip", "netns", "del", pair.ns_b], check=True, timeout=20)
        assert _wait_gone(pair.ns_b) == []
        b.close()
    finally:
        for ns in (pair.ns_a, pair.ns_b):
            NodeShaper(ns, "unused", pair.work / "x").close()



@needs_netns
def test_the_netem_probe_removes_a_namespace_a_killed_probe_left() -> None:
    """A probe killed by SIGKILL cannot remove its scratch namespace; the next probe removes it (its pid is gone),
    and never another live process's."""
    dead = next(pid for pid in range(4_000_000, 4_100_000) if not Path(f"/proc/{pid}").exists())
    stale, live = f"{host.PROBE_PREFIX}{dead}", f"{host.PROBE_PREFIX}1"  # pid 1 is alive
    for name in (stale, live):
        host.run(["ip", "netns", "add", name])
    try:
        host.netem_available.cache_clear()
        host.netem_available()
        assert stale not in host.netns_names() and live in host.netns_names()
    finally:
        for name in (stale, live):
            host.run(["ip", "netns", "del", name], check=False)
