"""The base every edgeswarm service runs on.

It reads settings, stamps logs with node and service, connects the bus with a retained Last Will,
refuses to start when another live instance holds the same node id and service, publishes a retained
status and a periodic heartbeat (on the main thread, independent of the handler threads, so a busy
handler never silences it), answers probes, publishes metrics, reports a second live instance that
appears later, and shuts down cleanly on SIGTERM or SIGINT.

It also refuses to run as a node other than the one its credentials name, without credentials on a
broker beyond this machine (unless EDGESWARM_ALLOW_ANONYMOUS), or advertising a data-plane address other nodes
cannot reach (edgeswarm.runtime.reachability). It stamps every heartbeat on disk for container healthchecks
(edgeswarm.runtime.health). It watches its broker connections: a service
whose network thread has died would look alive while it received nothing, so it exits at once (status
``EXIT_NETWORK_DEAD``) and its Last Will tells the cluster, and its supervisor restarts it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from edgeswarm import __version__, topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import ConfigError, DuplicateNodeError, RequestTimeoutError
from edgeswarm.messages import ClusterEvent, Heartbeat, MetricsReport, Probe, ProbeReply, Status
from edgeswarm.metrics import Metrics
from edgeswarm.runtime.health import HealthStamp, remove_stamp, stamp_path, write_stamp
from edgeswarm.runtime.reachability import check_advertised_data_url
from edgeswarm.runtime.signals import stop_on_signals
from edgeswarm.settings import Settings, is_loopback, parse_broker_url
from edgeswarm.wire import Sender

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# How long to wait for a retained status of another instance after subscribing (seconds).
_RETAINED_SETTLE_S = 0.3
EXIT_NETWORK_DEAD = 70  # EX_SOFTWARE: the process ends so that its Last Will fires and it is restarted


class _Periodic:
    def __init__(self, name: str, interval_s: float, fn: Callable[[], None]) -> None:
        self.name = name
        self.interval_s = interval_s
        self.fn = fn
        self.due = time.monotonic()


class Service:
    """Subclass, set ``name``, register handlers in ``setup()`` and periodic work with ``every()``.

    A service made with ``member=False`` is an observer (``edgeswarm dashboard --hub``, a page beside a cluster):
    it connects, listens and runs its periodic work, but never announces itself (no status, heartbeat, Last Will,
    metrics report or probe answers), so it appears nowhere among the cluster's nodes and needs no node's rights
    on the brokers."""

    name: ClassVar[str] = ""
    # A service that computes (a worker, the profiler) resolves EDGESWARM_COMPUTE when it is made, so a device it
    # cannot use stops it before it connects; the others never import torch for it.
    computes: ClassVar[bool] = False

    def __init__(self, settings: Settings, *, member: bool = True) -> None:
        self.settings = settings
        self.member = member
        self.node = settings.node_id
        self.instance = uuid.uuid4().hex[:12]
        self.sender = Sender(node=self.node, service=self.name, instance=self.instance)
        self.device = DeviceProfile.from_settings(settings)
        self.compute_name: str | None = None  # the torch device's name ("cpu", "cuda:0"); None: computes nothing
        self.compute_description = ""
        if self.computes:
            from edgeswarm.devices.allocator import keep_freed_memory
            from edgeswarm.devices.compute import compute_name, describe, with_accelerator_budget

            keep_freed_memory()  # served forwards as fast as the profiler's timings (devices.allocator)
            self.compute_name = compute_name(settings.compute, self.device)
            self.device = with_accelerator_budget(self.device, self.compute_name,
                                                  settings.memory_budget_bytes is not None)
            self.compute_description = describe(self.compute_name)
        self.metrics = Metrics()
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self._stop = threading.Event()
        self._periodic: list[_Periodic] = []
        self._heartbeat_seq = 0
        self._foreign: set[str] = set()
        self._announced = False
        self._claimed_by: Status | None = None
        self._health_file = stamp_path(settings.health_dir, self.node, self.name)
        self._health_warned = False
        self.bus = Bus(settings, self.sender, self.metrics,
                       will=self.status_message("offline", "connection lost") if member else None,
                       will_topic=topics.status(self.node, self.name) if member else None)

    # --- for subclasses -----------------------------------------------------------------------------

    def setup(self) -> None:
        """Subscribe handlers and register periodic work. Runs after the bus is connected."""

    def teardown(self) -> None:
        """Release resources. Runs after the offline status has been published."""

    def every(self, interval_s: float, fn: Callable[[], None], name: str = "") -> None:
        """Run ``fn`` every ``interval_s`` seconds on the main thread; a failure is logged and counted."""
        self._periodic.append(_Periodic(name or getattr(fn, "__name__", "task"), interval_s, fn))

    @property
    def compute(self) -> torch.device | None:
        """The torch device this service computes on (EDGESWARM_COMPUTE, resolved when it was made), None when it
        computes nothing. torch is imported on first use."""
        if self.compute_name is None:
            return None
        import torch

        return torch.device(self.compute_name)

    # --- lifecycle ----------------------------------------------------------------------------------

    def run(self, *, install_signals: bool = True) -> int:
        """Run until ``stop()`` (or SIGTERM/SIGINT when ``install_signals``); returns the exit status.

        Raises DuplicateNodeError before announcing itself if another live instance holds this node
        id and service, and BrokerUnavailableError if the hub cannot be reached.
        """
        check_identity(self.settings)
        if self.member:  # an observer advertises no data plane
            check_advertised_data_url(self.settings)
        if install_signals:
            stop_on_signals(self._stop)
        self.bus.start(timeout_s=self.settings.request_timeout_s)
        try:
            if self.member:
                self._refuse_duplicate()
                self.bus.subscribe(topics.request(self.node, self.name), self._on_probe, schemas=(Probe,))
                self.bus.subscribe(topics.heartbeat(self.node, self.name), self._on_own_topic, schemas=(Heartbeat,))
            self.setup()
            if self.member:
                self.every(self.settings.heartbeat_interval_s, self._heartbeat, "heartbeat")
                self.every(self.settings.metrics_interval_s, self._publish_metrics, "metrics")
                self._announce()
                self.bus.on_reconnect(self._announce)
            creds = self.bus.credentials
            log.info("%s %s started as instance %s (device class %s%s, hub %s, data plane %s, %s)", self.name,
                     __version__, self.instance, self.device.device_class,
                     f", computing on {self.compute_description}" if self.compute_description else "",
                     self.bus.hub.url,
                     parse_broker_url(self.settings.data_plane_url).url,
                     f"user {creds.username}" if creds.username else
                     "client certificate" if creds.cert_file else "anonymous")
            self._loop()
        finally:
            self._shutdown()
        return 0

    def stop(self) -> None:
        """Ask the service to shut down; ``run()`` returns soon after."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def uptime_s(self) -> float:
        return time.monotonic() - self._started_mono

    # --- status -------------------------------------------------------------------------------------

    def status_message(self, state: str, reason: str | None = None) -> Status:
        """This instance's Status with current memory figures."""
        return Status(
            state=state,  # type: ignore[arg-type]
            node=self.node,
            service=self.name,
            instance=self.instance,
            version=__version__,
            host=socket.gethostname(),
            pid=os.getpid(),
            device_class=self.device.device_class,
            memory_budget_bytes=self.device.memory_budget_bytes,
            free_memory_bytes=self.device.free_memory_bytes(),
            data_url=self.settings.data_plane_url,
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
            started_at=self.started_at,
            reason=reason,
            compute=self.compute_description,
            reserved_memory_bytes=self._reserved_now() if state == "online" else 0,
        )

    def reserved_memory_bytes(self) -> int:
        """The bytes reserved in this node's memory ledger (``runtime.ledger``) that the status reports: 0 for a
        service that does not look at the ledger."""
        return 0

    def watch_reserved_memory(self) -> None:
        """Re-announce the status whenever the bytes reserved on the node change (looked at every heartbeat), so
        ``edgeswarm status`` shows them: for the services that report them."""
        self._reserved_announced = self._reserved_now()
        self.every(self.settings.heartbeat_interval_s, self._reserved_changed, "reserved-memory")

    def _reserved_now(self) -> int:
        try:
            return self.reserved_memory_bytes()
        except OSError as exc:
            log.error("cannot read the node's memory ledger: %s", exc)
            return 0

    def _reserved_changed(self) -> None:
        reserved = self._reserved_now()
        if reserved != self._reserved_announced:
            self._reserved_announced = reserved
            self._announce()

    def _announce(self) -> None:
        self.bus.publish(topics.status(self.node, self.name), self.status_message("online"), retain=True)
        self._announced = True

    def _heartbeat(self) -> None:
        hb = Heartbeat(node=self.node, service=self.name, instance=self.instance, seq=self._heartbeat_seq,
                       interval_s=self.settings.heartbeat_interval_s, uptime_s=self.uptime_s(),
                       free_memory_bytes=self.device.free_memory_bytes(), inbox_depth=self.bus.inbox_depth)
        self._heartbeat_seq += 1
        self.bus.publish(topics.heartbeat(self.node, self.name), hb, qos=0, retain=True,
                         ttl_s=self.settings.heartbeat_timeout_s)
        self._stamp_health()

    def _stamp_health(self) -> None:
        # After the publish: a service that cannot heartbeat (its publish raised) lets its stamp go stale.
        stamp = HealthStamp(node=self.node, service=self.name, instance=self.instance, pid=os.getpid(), at=time.time(),
                            heartbeat_interval_s=self.settings.heartbeat_interval_s,
                            stale_after_s=self.settings.heartbeat_timeout_s)
        try:
            write_stamp(self._health_file, stamp)
        except OSError as exc:
            if not self._health_warned:  # once: the heartbeat itself goes on, only the healthcheck suffers
                self._health_warned = True
                log.warning("cannot write the health stamp %s (%s): `edgeswarm health %s` will report unhealthy; "
                            "point EDGESWARM_HEALTH_DIR at a writable folder", self._health_file,
                            exc.strerror or exc, self.name)

    def _publish_metrics(self) -> None:
        counters, gauges = self.metrics.snapshot()
        report = MetricsReport(node=self.node, service=self.name, instance=self.instance, uptime_s=self.uptime_s(),
                               counters=counters, gauges=gauges, histograms=self.metrics.histograms())
        self.bus.publish(topics.metrics(self.node, self.name), report, qos=0,
                         ttl_s=3 * self.settings.metrics_interval_s)

    # --- probes and duplicates ----------------------------------------------------------------------

    def _on_probe(self, msg: Inbound) -> None:
        saturated = self.bus.inbox_saturated
        self.bus.reply(msg, ProbeReply(
            node=self.node, service=self.name, instance=self.instance, healthy=not saturated,
            uptime_s=self.uptime_s(), inbox_depth=self.bus.inbox_depth,
            handler_errors=self.metrics.counter("handler_errors"), rejected=self.metrics.total("rejected."),
            detail="inbox saturated" if saturated else "ok"))

    def _refuse_duplicate(self) -> None:
        self.bus.subscribe(topics.status(self.node, self.name), self._on_own_topic, schemas=(Status,))
        time.sleep(_RETAINED_SETTLE_S)  # the retained status, if any, arrives right after the SUBACK
        other = self._claimed_by
        if other is None:
            return
        wait = max(2.0, 2 * other.heartbeat_interval_s)
        try:
            reply = self.bus.request(topics.request(self.node, self.name), Probe(), timeout_s=wait)
        except RequestTimeoutError:
            log.warning("taking over node id %s: instance %s (pid %d on %s) claims it but did not answer a "
                        "probe in %.1f s", self.node, other.instance, other.pid, other.host, wait)
            return
        raise DuplicateNodeError(
            f"node id {self.node!r} already runs {self.name} as live instance {reply.envelope.sender_instance} "
            f"(pid {other.pid} on host {other.host}); stop it or give this node another EDGESWARM_NODE_ID"
        )

    def _on_own_topic(self, msg: Inbound) -> None:
        """Status and heartbeats on this instance's own topics: another instance there is a duplicate."""
        body = msg.body
        instance = getattr(body, "instance", self.instance)
        if instance == self.instance or self.stopping:
            return
        if isinstance(body, Status) and body.state != "online":
            if self._announced:
                # A refused or departed duplicate overwrote the retained status (its shutdown or Last
                # Will): put ours back so late subscribers see the instance that is really running.
                self._announce()
            return
        if not self._announced:
            if isinstance(body, Status):
                self._claimed_by = body
            return
        if instance in self._foreign:
            return
        self._foreign.add(instance)
        self.metrics.count("duplicate_node")
        detail = (f"another live instance {instance} of {self.name} claims node id {self.node} "
                  f"(this one is {self.instance}); give one of them another EDGESWARM_NODE_ID")
        log.error("%s", detail)
        self.bus.publish(topics.service_events(self.node, self.name), ClusterEvent(
            kind="duplicate_node", node=self.node, service=self.name, instance=self.instance, detail=detail,
            at=time.time()))

    # --- main loop ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.bus.network_alive:
                self.network_dead()
                return
            now = time.monotonic()
            for task in self._periodic:
                if task.due <= now:
                    task.due = now + task.interval_s
                    try:
                        task.fn()
                    except Exception:
                        self.metrics.count("task_errors")
                        log.exception("periodic task %s failed", task.name)
            next_due = min((t.due for t in self._periodic), default=now + 1.0)
            self._stop.wait(max(0.0, next_due - time.monotonic()))

    def network_dead(self) -> None:
        """A broker connection's network thread has ended: log it and end the process without a clean disconnect,
        so the broker publishes the Last Will (offline) and the supervisor starts a fresh instance."""
        log.critical("%s instance %s: the MQTT network thread has stopped; nothing would be received any more. "
                     "Exiting (status %d) so the cluster sees this service go offline and its supervisor restarts it",
                     self.name, self.instance, EXIT_NETWORK_DEAD)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_NETWORK_DEAD)

    def _shutdown(self) -> None:
        try:
            if self._announced and self.bus.hub.connected:
                self.bus.publish(topics.status(self.node, self.name), self.status_message("offline", "shutdown"),
                                 retain=True, timeout_s=2.0)
                self.bus.hub.flush(timeout_s=2.0)  # the broker has the offline status before we disconnect
        except Exception:
            log.exception("could not publish the offline status")
        remove_stamp(self._health_file, self.instance)
        try:
            self.teardown()
        finally:
            self.bus.stop()
            log.info("%s instance %s stopped", self.name, self.instance)


def check_identity(settings: Settings) -> None:
    """Refuse (ConfigError) a service whose broker user name is not its node id (the ACL lets a node write only
    its own topics, so it could not even announce itself), or one without credentials on a broker that may be
    reachable beyond this machine, unless EDGESWARM_ALLOW_ANONYMOUS says the network is trusted."""
    creds = settings.credentials()
    if creds.username is not None and creds.username != settings.node_id:
        raise ConfigError(f"EDGESWARM_MQTT_USERNAME is {creds.username!r} but EDGESWARM_NODE_ID is "
                          f"{settings.node_id!r}: a node logs in as its own id (the brokers' ACL lets each node write "
                          "only its own topics); make them equal")
    if creds.anonymous and not settings.allow_anonymous:
        remote = [parse_broker_url(u) for u in (settings.hub_url, settings.data_plane_url,
                                                settings.data_connect_plane_url)]
        exposed = [a.url for a in remote if not is_loopback(a.host)]
        if exposed:
            raise ConfigError(
                f"no broker credentials, and {exposed[0]} may be reachable beyond this machine: on an anonymous "
                "broker anyone who reaches it is the cluster. Give this node an identity (EDGESWARM_MQTT_USERNAME "
                "and EDGESWARM_MQTT_PASSWORD_FILE, made with `edgeswarm credentials`; deploy/README.md), or set "
                "EDGESWARM_ALLOW_ANONYMOUS=true on an isolated development network")
