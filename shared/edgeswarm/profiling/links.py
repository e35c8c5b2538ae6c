"""Link measurement over the real MQTT data path, profiler to profiler.

Tensors travel exactly as training tensors do: ``Bus.send_tensor`` to the peer's advertised data-plane
broker, chunked, at QoS 1, through this node's emulated link to the peer when one is configured. So an
emulated device on a shaped 100 Mbps link measures about 12.5e6 bytes per second, and a real device
measures its real network.

Links are priced net of the brokers' processing: what a message costs at the brokers and in the services
(encoding, the broker's routing, decoding, dispatch) is the platform's, the same on any link, and is measured
on its own as the **per-hop cost** (``hop_s``, seconds): half the round trip of a ``ping`` this profiler sends to
itself through its own data broker, no link crossed (two hops, as a ping and its pong to a peer are).

- **Latency** (``latency_s``, seconds): the link's round trip, net of the hops: the median over the pings of a
  small ``ping`` tensor's round trip to the peer's profiler (which sends it straight back as a ``pong`` over its
  own data path: both directions' links) less the round trip of the ``ping`` to itself sent right after it.
- **Bandwidth** (bytes per second): a 1 MiB warm-up transfer estimates the rate; then ``bulks`` bulk tensors,
  each sized to take about ``target_s / bulks`` at that rate (at most 16 MiB in all, at least 1 MiB each), are
  sent and the peer confirms each with a tiny ``bulk_ack`` tensor. A bulk's rate is its bytes over the elapsed
  time minus one ping round trip (the confirmation's own travel, hops included); the link's is the best of them,
  since whatever else runs on the hosts (another transfer, another program) only ever slows a transfer down.
- **Per message** (``message_s``, seconds): what one tensor message costs on the link beyond its bytes over the
  bandwidth, one way: half the net round trip less the ping's own bytes. The brokers' and services' share of a
  message is the per-hop cost (``hop_s``, in the profile beside it: the planners price a message at both).
- **Per request** (``request_s``, seconds): the median round trip of a small control request and its
  reply through the hub, from this node: a ``Probe`` to its own profiler, which crosses the hub broker
  both ways and is handled by a service's dispatch thread, as a coordinator's request to a device's
  worker is (a node may always address its own services; the ACL lets only the hub and clients ask
  another node's profiler). It is this node's figure, whichever peer the link goes to.

A link is measured alone where it can be: ``profiling.gather`` gives each host one link measurement at a time,
since a node that also sends or receives another bulk transfer (or a host whose CPU its other nodes are using)
measures its CPU, not the link.

The measuring side and the answering side are the same object: every profiler attaches a LinkProber
to its data topic. Answers go out from a thread of their own through a short queue, and only to a peer
whose status is already known: a probe from an unknown sender is dropped at once, so no stranger can hold
the data topic's dispatch thread (eight such pings used to stall a real measurement for 80 s).
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import BusError, InvalidMessageError, LinkMeasurementError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages import LinkProbe, Probe
from edgeswarm.values.profiles import LinkProfile
from edgeswarm.wire.schema import new_id

log = logging.getLogger(__name__)

MIB = 1024 * 1024
PING_BYTES = 64
MAX_PING_BYTES = 64 * 1024  # a larger "ping" is refused: the echo must stay cheap for the answering side
DEFAULT_PINGS = 7
DEFAULT_REQUESTS = 5
DEFAULT_TARGET_S = 0.5
DEFAULT_BULKS = 2
MIN_BULK_BYTES = 1 * MIB
MAX_BULK_BYTES = 16 * MIB
PEER_WAIT_S = 2.0  # how long a peer's status may take to show up before the peer counts as unknown
ANSWER_QUEUE = 16  # answers waiting to be sent; beyond it probes are dropped (their sender retries or times out)

_limited = RateLimitedLog(log)


@dataclass(frozen=True)
class LinkMeasurement:
    """One link measurement: the profile the planner reads (net of the brokers' processing, its ``hop_s`` beside)
    and what it was derived from: ``gross_round_trip_s``, the median ping round trip to the peer, hops included;
    ``bulk_rates``, each bulk transfer's rate (bytes per second) of ``bulk_bytes`` bytes."""

    profile: LinkProfile
    gross_round_trip_s: float
    bulk_rates: tuple[float, ...]
    bulk_bytes: int


@dataclass
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    arrived_at: float = 0.0
    received_bytes: int = 0


class LinkProber:
    """Measures links from this bus's node to the same service on peers, and answers their probes.

    Call ``attach()`` once (it subscribes to this service's data topic); ``measure()`` may then run on
    any thread, including concurrently for different peers.
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.node = bus.sender.node
        self.service = bus.sender.service
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()
        self._answers: queue.Queue[tuple[str, str, LinkProbe, np.ndarray]] = queue.Queue(maxsize=ANSWER_QUEUE)

    def attach(self) -> None:
        """Subscribe to ``edgeswarm/node/{node}/{service}/data`` on this node's data-plane broker and start the
        thread that sends answers."""
        threading.Thread(target=self._send_answers, name="link-answers", daemon=True).start()
        self.bus.subscribe(topics.data(self.node, self.service), self._on_probe, schemas=(LinkProbe,), plane="data")

    # --- measuring ----------------------------------------------------------------------------------

    def measure(self, peer: str, *, pings: int = DEFAULT_PINGS, target_s: float = DEFAULT_TARGET_S,
                min_bulk_bytes: int = MIN_BULK_BYTES, max_bulk_bytes: int = MAX_BULK_BYTES,
                requests: int = DEFAULT_REQUESTS, timeout_s: float = 60.0, bulks: int = DEFAULT_BULKS) -> LinkProfile:
        """The link from this node to ``peer``: bandwidth (bytes/s), round-trip latency (s) and seconds per
        message, both net of the brokers' processing, and this node's seconds per request round trip through the
        hub (``requests`` of them timed; 0 leaves ``request_s`` at 0). ``measure_link`` says how it was measured.

        Takes about ``target_s`` plus a few round trips. Raises LinkMeasurementError if the peer's
        profiler is unknown, offline or does not answer a probe or a request within ``timeout_s`` seconds.
        """
        return self.measure_link(peer, pings=pings, target_s=target_s, min_bulk_bytes=min_bulk_bytes,
                                 max_bulk_bytes=max_bulk_bytes, requests=requests, timeout_s=timeout_s,
                                 bulks=bulks).profile

    def measure_link(self, peer: str, *, pings: int = DEFAULT_PINGS, target_s: float = DEFAULT_TARGET_S,
                     min_bulk_bytes: int = MIN_BULK_BYTES, max_bulk_bytes: int = MAX_BULK_BYTES,
                     requests: int = DEFAULT_REQUESTS, timeout_s: float = 60.0,
                     bulks: int = DEFAULT_BULKS) -> LinkMeasurement:
        """``measure``, with the figures it was derived from (the per-hop cost among them). Same errors."""
        if peer == self.node:
            raise LinkMeasurementError(f"cannot measure a link from {peer} to itself")
        self._check_peer(peer, min(timeout_s, PEER_WAIT_S))
        ping = np.zeros(PING_BYTES, dtype=np.uint8)
        # Warm-up, both ways a ping goes: connections, peer lookups, handler threads.
        self.round_trip(peer, "ping", ping, timeout_s)
        self.round_trip(self.node, "ping", ping, timeout_s)
        gross, own = [], []
        for _ in range(max(1, pings)):
            # Each ping to the peer is followed by one to this node itself, so the two see the same moment's load
            # and their difference is the link's.
            gross.append(self.round_trip(peer, "ping", ping, timeout_s)[0])
            own.append(self.round_trip(self.node, "ping", ping, timeout_s)[0])
        rtt = statistics.median(gross)
        hop = statistics.median(own) / 2
        net_rtt = max(0.0, statistics.median([g - o for g, o in zip(gross, own, strict=True)]))
        warm = self._rate(min_bulk_bytes, self.round_trip(peer, "bulk", _payload(min_bulk_bytes), timeout_s)[0], rtt)
        count = max(1, bulks)
        size = int(max(min_bulk_bytes, min(max_bulk_bytes, warm * target_s) / count))
        rates = []
        for _ in range(count):
            elapsed, received = self.round_trip(peer, "bulk", _payload(size), timeout_s)
            if received != size:
                raise LinkMeasurementError(f"{peer}'s profiler confirmed {received} bytes of a {size}-byte transfer")
            rates.append(self._rate(size, elapsed, rtt))
        bandwidth = max(rates)
        message = max(0.0, net_rtt - 2 * PING_BYTES / bandwidth) / 2
        request = self.request_round_trip(requests, timeout_s) if requests > 0 else 0.0
        log.info("link %s -> %s: %.3g bytes/s (%.1f Mbps), the best of %s from %d bytes each; round trip %.2f ms net "
                 "of %.2f ms per hop (%.2f ms gross, medians of %d); %.2f ms per message, %.2f ms per request",
                 self.node, peer, bandwidth, bandwidth * 8 / 1e6, "/".join(f"{r * 8 / 1e6:.1f}" for r in rates), size,
                 net_rtt * 1e3, hop * 1e3, rtt * 1e3, len(gross), message * 1e3, request * 1e3)
        profile = LinkProfile(src=self.node, dst=peer, bandwidth_bps=bandwidth, latency_s=net_rtt, message_s=message,
                              request_s=request, hop_s=hop)
        return LinkMeasurement(profile=profile, gross_round_trip_s=rtt, bulk_rates=tuple(rates),
                               bulk_bytes=size)

    def request_round_trip(self, count: int, timeout_s: float) -> float:
        """Median seconds of ``count`` small requests (after one warm-up) from this node to its own service of this
        prober's name and their replies, through the hub. Raises LinkMeasurementError when one is not answered
        within ``timeout_s`` seconds."""
        times = []
        for _ in range(count + 1):
            start = time.perf_counter()
            try:
                self.bus.request(topics.request(self.node, self.service), Probe(), timeout_s=timeout_s)
            except BusError as exc:
                raise LinkMeasurementError(f"cannot time a request from {self.node} through the hub: {exc}") from exc
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    def _check_peer(self, peer: str, wait_s: float) -> None:
        try:
            status = self.bus.peers.wait_for(peer, self.service, timeout_s=wait_s)
        except BusError as exc:
            raise LinkMeasurementError(f"cannot measure the link {self.node} -> {peer}: {exc}") from exc
        if status.state != "online":
            raise LinkMeasurementError(f"cannot measure the link {self.node} -> {peer}: its {self.service} is "
                                       f"{status.state} ({status.reason or 'no reason given'})")

    @staticmethod
    def _rate(nbytes: int, elapsed_s: float, rtt_s: float) -> float:
        # The confirmation's travel is not transfer time; never let it claim more than half the elapsed time.
        return nbytes / max(elapsed_s - rtt_s, elapsed_s / 2, 1e-9)

    def round_trip(self, peer: str, kind: Literal["ping", "bulk"], value: np.ndarray,
                   timeout_s: float) -> tuple[float, int]:
        """Send ``value`` to ``peer``'s profiler as a ``ping`` or ``bulk`` and wait for its answer (``peer`` may be
        this node: through its own data broker, no link crossed).

        Returns (seconds from the start of sending to the answer's arrival, bytes the peer confirmed).
        """
        probe_id = new_id()
        waiter = _Waiter()
        with self._lock:
            self._waiters[probe_id] = waiter
        try:
            start = time.perf_counter()
            try:
                self.bus.send_tensor(peer, self.service, LinkProbe(probe_id=probe_id, kind=kind), value,
                                     timeout_s=timeout_s)
            except BusError as exc:
                raise LinkMeasurementError(f"cannot measure the link {self.node} -> {peer}: {exc}") from exc
            remaining = timeout_s - (time.perf_counter() - start)
            if not waiter.event.wait(max(0.0, remaining)):
                raise LinkMeasurementError(
                    f"the {self.service} on {peer} did not answer a {kind} of {value.nbytes} bytes within "
                    f"{timeout_s:.0f} s; is it running and reachable? (`edgeswarm status`)")
            return waiter.arrived_at - start, waiter.received_bytes
        finally:
            with self._lock:
                self._waiters.pop(probe_id, None)

    # --- answering ----------------------------------------------------------------------------------

    def _on_probe(self, msg: Inbound) -> None:
        arrived = time.perf_counter()
        body = msg.body
        assert isinstance(body, LinkProbe)  # guaranteed by the subscription's schema filter
        if msg.tensor is None:
            raise InvalidMessageError(f"link probe {body.probe_id} from {msg.sender} carries no tensor")
        env = msg.envelope
        if body.kind == "ping":
            if msg.tensor.nbytes > MAX_PING_BYTES:
                raise InvalidMessageError(f"ping {body.probe_id} from {msg.sender} is {msg.tensor.nbytes} bytes; "
                                          f"at most {MAX_PING_BYTES} are echoed")
            echo = np.ascontiguousarray(msg.tensor.array).reshape(-1).view(np.uint8)
            self._answer(env.sender_node, env.sender_service, LinkProbe(probe_id=body.probe_id, kind="pong"), echo)
        elif body.kind == "bulk":
            ack = LinkProbe(probe_id=body.probe_id, kind="bulk_ack", received_bytes=msg.tensor.nbytes)
            self._answer(env.sender_node, env.sender_service, ack, np.zeros(1, dtype=np.uint8))
        else:
            with self._lock:
                waiter = self._waiters.get(body.probe_id)
            if waiter is None:
                self.bus.metrics.count("late_link_probes")
                log.debug("a %s for probe %s from %s arrived after its wait ended", body.kind, body.probe_id,
                          msg.sender)
                return
            waiter.arrived_at = arrived
            waiter.received_bytes = body.received_bytes if body.kind == "bulk_ack" else msg.tensor.nbytes
            waiter.event.set()

    def _answer(self, node: str, service: str, message: LinkProbe, value: np.ndarray) -> None:
        if self.bus.peers.get(node, service) is None:
            self.bus.metrics.count("link_probes_unknown_sender")
            _limited.warning("unknown", "dropped a link %s from %s/%s: no status of it is known", message.kind, node,
                             service)
            return
        try:
            self._answers.put_nowait((node, service, message, value))
        except queue.Full:
            self.bus.metrics.count("link_probes_dropped")
            _limited.warning("full", "dropped a link %s from %s/%s: %d answers are already waiting", message.kind,
                             node, service, ANSWER_QUEUE)

    def _send_answers(self) -> None:
        while True:
            node, service, message, value = self._answers.get()
            try:
                self.bus.send_tensor(node, service, message, value, peer_wait_s=0.0)
            except BusError as exc:
                self.bus.metrics.count("link_probe_answer_errors")
                _limited.warning("answer", "could not answer a link probe from %s/%s: %s", node, service, exc)
            except Exception:  # noqa: BLE001 - one bad answer must not end the answering thread
                self.bus.metrics.count("link_probe_answer_errors")
                log.exception("answering a link probe from %s/%s failed", node, service)


def _payload(nbytes: int) -> np.ndarray:
    return np.zeros(nbytes, dtype=np.uint8)
