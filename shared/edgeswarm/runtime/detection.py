"""Heartbeat-guided failure detection of a job's stage-workers (spec 5.2).

A device is confirmed failed when its stage-worker's status goes offline (its Last Will, the fast path, or a
shutdown), or when its heartbeats stop for ``timeout_factor`` heartbeat intervals and a probe, retried once,
gets no answer. Heartbeats come from the service's main thread, apart from its compute threads, so a device busy
with a long backward pass keeps beating; a hung one (SIGSTOP) neither beats nor answers the probe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages import Heartbeat, Probe, Status
from edgeswarm.service_registry import STAGE_WORKER

log = logging.getLogger(__name__)

# After this side's connection to the broker comes back (a broker restart), every peer gets this long to reconnect
# too before its silence counts: paho's reconnect backoff is at most 4 s.
RECONNECT_GRACE_S = 8.0
# A broker that shuts down publishes every client's Last Will as it goes, so an offline status counts only once this
# side has stayed connected this long after it (a shutting-down broker drops this side too within milliseconds).
WILL_SETTLE_S = 0.3

How = Literal["last_will", "shutdown", "probe"]


@dataclass(frozen=True)
class Detection:
    """A confirmed failure: how it was confirmed, when the device was last heard from and when the failure was
    confirmed (Unix seconds)."""

    node: str
    how: How
    last_heard_at: float
    confirmed_at: float
    detail: str

    @property
    def detection_s(self) -> float:
        """Seconds from the last sign of life to the confirmation."""
        return max(0.0, self.confirmed_at - self.last_heard_at)


@dataclass
class _Peer:
    heard_at: float
    interval_s: float
    instance: str | None = None
    offline: Status | None = None
    offline_at: float = 0.0  # when the offline status arrived
    offline_connection: int = 0  # this side's connection count then
    probing: bool = False


class FailureDetector:
    """Watches the ``service`` of the nodes given to ``watch``. Confirmed failures stay confirmed until the node's
    service comes back as a new instance (then it is a new device that may join)."""

    def __init__(self, bus: Bus, service: str = STAGE_WORKER, *, timeout_factor: float = 3.0,
                 probe_timeout_s: float = 2.0, probe_retries: int = 1, poll_s: float = 0.05) -> None:
        self.bus = bus
        self.service = service
        self.timeout_factor = timeout_factor
        self.probe_timeout_s = probe_timeout_s
        self.probe_retries = probe_retries
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._watched: set[str] = set()
        self._failed: dict[str, Detection] = {}
        self._stop = threading.Event()
        bus.subscribe(topics.ALL_HEARTBEATS, self._on_heartbeat, schemas=(Heartbeat,))
        bus.subscribe(topics.ALL_STATUS, self._on_status, schemas=(Status,))
        bus.on_reconnect(self._reconnected)
        self._thread = threading.Thread(target=self._run, name="failure-detector", daemon=True)
        self._thread.start()

    def watch(self, nodes: Iterable[str]) -> None:
        """Watch exactly ``nodes`` from now on (a node not heard from yet gets one timeout from now)."""
        now = time.time()
        with self._lock:
            self._watched = set(nodes)
            for node in self._watched:
                self._peers.setdefault(node, _Peer(heard_at=now, interval_s=1.0))

    def failures(self) -> dict[str, Detection]:
        """The confirmed failures among the watched nodes."""
        with self._lock:
            return {n: d for n, d in self._failed.items() if n in self._watched}

    def instance(self, node: str) -> str | None:
        """The instance of ``node``'s service last heard from (a heartbeat or an online status), None before any: a
        new one is a restart, even one too quick for the failure to be confirmed in between."""
        with self._lock:
            peer = self._peers.get(node)
            return None if peer is None else peer.instance

    def failed(self, node: str) -> bool:
        with self._lock:
            return node in self._failed

    def confirm(self, nodes: Iterable[str]) -> dict[str, Detection]:
        """Probe ``nodes`` now, in parallel (the probe timeout, one retry), and return every confirmed failure
        among them: what a caller does when a round fails and it must know whether a device is gone."""
        threads = [threading.Thread(target=self._probe, args=(n,), daemon=True) for n in nodes
                   if not self.failed(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self._lock:
            return {n: d for n, d in self._failed.items() if n in set(nodes)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    # --- inputs -------------------------------------------------------------------------------------

    def _on_heartbeat(self, msg: Inbound) -> None:
        hb = msg.body
        assert isinstance(hb, Heartbeat)
        if hb.service != self.service:
            return
        at = msg.envelope.sent_at if msg.retained else time.time()
        with self._lock:
            peer = self._peers.setdefault(hb.node, _Peer(heard_at=at, interval_s=hb.interval_s))
            if hb.instance != peer.instance and hb.node in self._failed:
                if msg.retained:
                    return  # a dead instance's retained heartbeat is no sign of life
                log.info("%s/%s is back as instance %s", hb.node, self.service, hb.instance)
                del self._failed[hb.node]
                peer.offline = None
            peer.instance = hb.instance
            peer.interval_s = hb.interval_s
            peer.heard_at = max(peer.heard_at, at)

    def _on_status(self, msg: Inbound) -> None:
        st = msg.body
        assert isinstance(st, Status)
        if st.service != self.service:
            return
        with self._lock:
            peer = self._peers.setdefault(st.node, _Peer(heard_at=st.started_at, interval_s=st.heartbeat_interval_s))
            if st.state == "offline":
                if peer.instance in (None, st.instance):
                    peer.offline, peer.offline_at, peer.offline_connection = st, time.time(), self.bus.hub.connects
            elif not msg.retained or peer.instance is None:
                if st.instance != peer.instance and st.node in self._failed:
                    del self._failed[st.node]
                peer.instance = st.instance
                peer.offline = None
                peer.interval_s = st.heartbeat_interval_s

    def _reconnected(self) -> None:
        # While this side was cut off nobody was heard; that is no one else's failure.
        grace = time.time() + RECONNECT_GRACE_S
        with self._lock:
            for peer in self._peers.values():
                peer.heard_at = max(peer.heard_at, grace)
                peer.offline = None  # wills the broker published as it shut down

    # --- the watch loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            now = time.time()
            to_probe = []
            if not self.bus.hub.connected:
                continue  # silence while this side is cut off from the broker says nothing about the peers
            with self._lock:
                for node in self._watched:
                    peer = self._peers.get(node)
                    if peer is None or node in self._failed or peer.probing:
                        continue
                    if peer.offline is not None and peer.offline_connection != self.bus.hub.connects:
                        peer.offline = None  # it came with the broker's shutdown, not with the device's death
                    elif peer.offline is not None and now - peer.offline_at < WILL_SETTLE_S:
                        continue
                    elif peer.offline is not None:
                        reason = peer.offline.reason or "offline"
                        how: How = "last_will" if "connection lost" in reason else "shutdown"
                        self._confirm(node, how, peer.heard_at, f"{node}/{self.service} went offline ({reason})")
                    elif now - peer.heard_at > self.timeout_factor * peer.interval_s:
                        peer.probing = True
                        to_probe.append(node)
            for node in to_probe:
                threading.Thread(target=self._probe, args=(node,), name=f"probe-{node}", daemon=True).start()

    def _probe(self, node: str) -> None:
        with self._lock:
            peer = self._peers.setdefault(node, _Peer(heard_at=time.time(), interval_s=1.0))
            peer.probing = True
            silent_since = peer.heard_at
        try:
            for _attempt in range(1 + self.probe_retries):
                try:
                    self.bus.request(topics.request(node, self.service), Probe(), timeout_s=self.probe_timeout_s)
                except EdgeswarmError:
                    continue
                with self._lock:
                    peer.heard_at = max(peer.heard_at, time.time())
                return
            if not self.bus.hub.connected:
                return  # the probes went nowhere: judge again once reconnected
            with self._lock:
                self._confirm(node, "probe", silent_since,
                              f"{node}/{self.service} sent no heartbeat for {time.time() - silent_since:.1f} s and "
                              f"did not answer {1 + self.probe_retries} probes of {self.probe_timeout_s:.1f} s")
        finally:
            with self._lock:
                peer.probing = False

    def _confirm(self, node: str, how: How, heard_at: float, detail: str) -> None:
        if node in self._failed:
            return
        detection = Detection(node, how, heard_at, time.time(), detail)
        self._failed[node] = detection
        log.warning("device %s failed (%s, %.1f s after it was last heard): %s", node, how, detection.detection_s,
                    detail)
