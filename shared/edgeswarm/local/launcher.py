"""``edgeswarm up --local``: a broker, the coordinator and N emulated devices as separate processes.

Each node runs the services of its role (``edgeswarm.service_registry``): the hub node the hub's, every device of
the cluster spec the device role's, and every edge server (the spec's ``edges``) the edge role's.

Every child is an ``edgeswarm service NAME`` process configured only through ``EDGESWARM_*``
environment variables, exactly as a container would be, forked by the cluster's fork server
(``edgeswarm.local.forkserver``: edgeswarm and torch are imported once, not once per service). Children die with
the launcher (Linux parent-death signal), and ``stop()`` ends each of them by PID. Logs, broker files and (unless
``EDGESWARM_CHECKPOINT_DIR`` is set) the checkpoint store's files go to the working folder.

A local cluster binds only to 127.0.0.1 and is anonymous by default. ``secure=True`` runs it as a deployment
runs: a credentials folder in the working folder (``edgeswarm credentials``: the hub, each device, each edge
server, and a client member ``operator`` for command lines), a CA and a broker certificate (``edgeswarm certs``),
and a broker that speaks only TLS to those users under the ACL generated from the topic tree.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from edgeswarm.devices.cluster import ClusterSpec
from edgeswarm.devices.compute import sharing_cores
from edgeswarm.errors import ConfigError
from edgeswarm.local.broker import BrokerProcess, BrokerSecurity, free_port, start_broker
from edgeswarm.local.forkserver import ForkedProcess, ForkServer
from edgeswarm.roles import NodeRole, Role
from edgeswarm.security.certs import CertsDir
from edgeswarm.security.credentials import CredentialsDir
from edgeswarm.service_registry import services_of

log = logging.getLogger(__name__)

HUB_NODE = "hub"
HUB_SERVICES = services_of("hub")
# The hub services that listen on a port of their own: the cluster's attribute holding it, and their settings' prefix.
LISTENERS = {"dashboard": ("dashboard_port", "EDGESWARM_DASHBOARD"), "gateway": ("gateway_port", "EDGESWARM_GATEWAY")}
DEVICE_SERVICES = services_of("device")
EDGE_SERVICES = services_of("edge")
CHECKPOINT_DIR_ENV = "EDGESWARM_CHECKPOINT_DIR"
OPERATOR = "operator"  # the client member of a secure local cluster: command lines log in as it


@dataclass
class ChildProcess:
    """One service process started by the launcher."""

    node: str
    service: str
    process: subprocess.Popen[bytes] | ForkedProcess
    log_path: Path
    env: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None


def power_cut(children: list[ChildProcess], node: str) -> None:
    """SIGKILL every live process of ``node`` among ``children``, as a power cut would: nothing is flushed, no
    offline status is sent (the broker's Last Will says so)."""
    for child in children:
        if child.node == node and child.alive():
            child.process.kill()


# How long the services of a cluster have, in all, to finish a SIGTERM before they are killed: a service's own shutdown
# is bounded by about 10 s (its programs stop within 5 s, its offline status is flushed within 4 s), and on a loaded
# 2-core machine the interpreters' own exits add seconds.
STOP_GRACE_S = 25.0


def stop_children(children: list[ChildProcess], timeout_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every child, the last started first (devices before the hub), wait up to ``timeout_s`` seconds in all,
    then SIGKILL those that did not stop."""
    for child in reversed(children):
        if child.alive():
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s on %s (pid %d) did not stop within %.0f s of SIGTERM; killing it", child.service,
                        child.node, child.pid, timeout_s)
            child.process.kill()
            child.process.wait(5)


def service_env(node: str, hub_url: str, *, device_class: str, links: dict[str, object] | None = None,
                heartbeat_interval_s: float | None = None, mqtt_protocol: str = "auto",
                extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one service process: ours (for a process sharing this host's cores) plus its
    ``EDGESWARM_*`` settings."""
    env = sharing_cores(os.environ)
    env.update({
        "EDGESWARM_NODE_ID": node,
        "EDGESWARM_HUB_URL": hub_url,
        "EDGESWARM_DEVICE_CLASS": device_class,
        "EDGESWARM_MQTT_PROTOCOL": mqtt_protocol,
        "EDGESWARM_DIE_WITH_PARENT": str(os.getpid()),
    })
    if links:
        env["EDGESWARM_LINKS"] = json.dumps(links)
    if heartbeat_interval_s is not None:
        env["EDGESWARM_HEARTBEAT_INTERVAL_S"] = str(heartbeat_interval_s)
    env.update(extra or {})
    return env


class LocalCluster:
    """A whole cluster on this machine. Use as a context manager or call ``start()`` and ``stop()``. Its services are
    forked by ``forks``, a fork server the caller started and ends, or else by one of the cluster's own."""

    def __init__(self, spec: ClusterSpec, *, broker: str = "auto", port: int = 0,
                 heartbeat_interval_s: float | None = None, workdir: Path | None = None,
                 extra_env: dict[str, str] | None = None, secure: bool = False,
                 skip_services: tuple[str, ...] = (), dashboard_port: int | None = 0,
                 gateway_port: int | None = None, forks: ForkServer | None = None) -> None:
        self.spec = spec
        # The hub's dashboard listens on 127.0.0.1 at this port (0: a free one, chosen at start, so clusters started
        # side by side never collide); None: no dashboard (a cluster that only runs jobs, or a test's, saves its
        # process). Likewise the gateway's OpenAI-compatible API, which only language models need (None: none).
        self.dashboard_port = dashboard_port
        self.gateway_port = gateway_port
        self.skip_services = skip_services  # services not started on the devices and edges (what a run needs not)
        self.secure = secure
        self._broker_kind = broker
        self._port = port
        self._heartbeat = heartbeat_interval_s
        self.workdir = (workdir or Path(tempfile.mkdtemp(prefix="edgeswarm-local-"))).resolve()
        self._extra_env = extra_env or {}
        self.broker: BrokerProcess | None = None
        self.children: list[ChildProcess] = []
        self._given_forks = forks
        self._forks: ForkServer | None = None

    @property
    def dashboard_url(self) -> str | None:
        """The dashboard's page, once started; None for a cluster without one."""
        if self.dashboard_port is None or self.dashboard_port == 0:
            return None
        return f"http://127.0.0.1:{self.dashboard_port}/"

    @property
    def gateway_url(self) -> str | None:
        """The OpenAI-compatible API's base address (``.../v1``), once started; None for a cluster without one."""
        if self.gateway_port is None or self.gateway_port == 0:
            return None
        return f"http://127.0.0.1:{self.gateway_port}/v1"

    @property
    def hub_url(self) -> str:
        if self.broker is None:
            raise RuntimeError("the cluster is not started")
        return self.broker.url

    def start(self) -> None:
        """Start the broker, the coordinator on the hub node and every device's services.

        If any of them cannot be started, whatever was started is stopped again before the error is raised.
        """
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    @property
    def secrets(self) -> Path:
        """The credentials and certificates folder of a secure cluster."""
        return self.workdir / "secrets"

    def identity_env(self, member: str) -> dict[str, str]:
        """The ``EDGESWARM_*`` settings that let ``member`` log in (empty for an anonymous cluster)."""
        if not self.secure:
            return {}
        return {"EDGESWARM_MQTT_USERNAME": member,
                "EDGESWARM_MQTT_PASSWORD_FILE": str(CredentialsDir(self.secrets).password_file(member)),
                "EDGESWARM_TLS_CA_FILE": str(CertsDir(self.secrets).ca_cert)}

    def client_env(self) -> dict[str, str]:
        """What a command line needs to reach this cluster (``EDGESWARM_HUB_URL`` and, when secure, the
        ``operator`` member's identity)."""
        protocol = {"EDGESWARM_MQTT_PROTOCOL": "3.1.1"} if self.broker and self.broker.kind == "amqtt" else {}
        return {"EDGESWARM_HUB_URL": self.hub_url, **protocol, **self.identity_env(OPERATOR)}

    def _secure_broker(self) -> BrokerSecurity:
        members: dict[str, Role] = {HUB_NODE: "hub", OPERATOR: "client"}
        members.update({d.id: "device" for d in self.spec.devices})
        members.update({e.id: "edge" for e in self.spec.edges})
        creds = CredentialsDir(self.secrets)
        creds.update(add=members)
        certs = CertsDir(self.secrets)
        certs.ensure_ca()
        cert, key = certs.issue_broker(HUB_NODE, ["127.0.0.1", "localhost"])
        return BrokerSecurity(mosquitto_passwd=creds.mosquitto_passwd, mosquitto_acl=creds.mosquitto_acl,
                              amqtt_passwd=creds.amqtt_passwd, amqtt_acl=creds.amqtt_acl, ca_file=certs.ca_cert,
                              cert_file=cert, key_file=key)

    @property
    def checkpoint_dir(self) -> Path:
        """Where this cluster's checkpoint store keeps its files: ``EDGESWARM_CHECKPOINT_DIR`` when the caller (or the
        environment) sets it, else the working folder's ``checkpoints``, so clusters do not share their checkpoints
        (a job name reused in another cluster would find the first one's versions)."""
        chosen = self._extra_env.get(CHECKPOINT_DIR_ENV) or os.environ.get(CHECKPOINT_DIR_ENV)
        return Path(chosen).expanduser() if chosen else self.workdir / "checkpoints"

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # First, so that its imports (seconds of CPU) overlap the secrets and the broker being made.
        self._forks = self._given_forks or ForkServer(self.workdir / "logs" / "forkserver.log")
        security = self._secure_broker() if self.secure else None
        self.broker = start_broker(self._broker_kind, port=self._port, workdir=self.workdir / "broker",
                                   security=security)
        protocol = "3.1.1" if self.broker.kind == "amqtt" else "auto"
        extra = {CHECKPOINT_DIR_ENV: str(self.checkpoint_dir), **self._extra_env}
        hub_env = service_env(HUB_NODE, self.broker.url, device_class="native", heartbeat_interval_s=self._heartbeat,
                              mqtt_protocol=protocol, extra={**extra, **self.identity_env(HUB_NODE)})
        for service in HUB_SERVICES:
            if service in LISTENERS:  # the dashboard and the gateway: on 127.0.0.1, a free port unless one is given
                attr, setting = LISTENERS[service]
                if getattr(self, attr) is None:
                    continue
                setattr(self, attr, getattr(self, attr) or free_port())
                self._spawn(HUB_NODE, service, {**hub_env, f"{setting}_HOST": "127.0.0.1",
                                                f"{setting}_PORT": str(getattr(self, attr))})
                continue
            self._spawn(HUB_NODE, service, hub_env)
        roles: tuple[tuple[NodeRole, tuple[str, ...]], ...] = (("device", DEVICE_SERVICES), ("edge", EDGE_SERVICES))
        for role, services in roles:
            for node in self.spec.devices if role == "device" else self.spec.edges:
                links = {peer: spec.model_dump() for peer, spec in self.spec.links_from(node.id).items()}
                env = service_env(node.id, self.broker.url, device_class=node.device_class, links=links,
                                  heartbeat_interval_s=self._heartbeat, mqtt_protocol=protocol,
                                  extra={**extra, **node.budget_env(), **self.identity_env(node.id)})
                for service in services:
                    if service not in self.skip_services:
                        self._spawn(node.id, service, env)

    def _spawn(self, node: str, service: str, env: dict[str, str]) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{node}.{service}.log"
        if self._forks is None:
            raise RuntimeError("the cluster is not started")
        proc = self._forks.spawn(service, env, log_path)
        self.children.append(ChildProcess(node, service, proc, log_path, env))
        log.debug("started %s on %s (pid %d)", service, node, proc.pid)

    def restart(self, node: str, service: str) -> ChildProcess:
        """Start ``service`` on ``node`` again, as it was started (after a crash, or after it was killed), and return
        the new process. Raises ConfigError when the cluster never ran it, or it is still running."""
        old = next((c for c in reversed(self.children) if (c.node, c.service) == (node, service)), None)
        if old is None:
            raise ConfigError(f"{service} on {node} is not a service of this cluster")
        if old.alive():
            raise ConfigError(f"{service} on {node} is still running (pid {old.pid})")
        self._spawn(node, service, old.env)
        return self.children[-1]

    def address(self, node: str) -> str:
        """``node``'s address: every node of a local cluster is this host."""
        return "127.0.0.1"

    def interface(self, node: str) -> str:
        """The network interface ``node``'s processes reach the others through: loopback."""
        return "lo"

    def spawn(self, node: str, argv: list[str], *, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` as a process of ``node`` (on this host; its links are not shaped: only the bus shapes a
        local cluster's), its output to ``log_path``; the caller stops it."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def link_bytes(self, node: str) -> int | None:
        """None: a local cluster's nodes share loopback, so no link is one node's."""
        return None

    def failed_children(self) -> list[ChildProcess]:
        """Children that have exited."""
        return [c for c in self.children if not c.alive()]

    def power_cut(self, node: str) -> None:
        """SIGKILL every process of ``node``."""
        power_cut(self.children, node)

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every child (devices first, coordinator last), wait, SIGKILL stragglers, stop the broker."""
        stop_children(self.children, timeout_s)
        if self._forks is not None and self._forks is not self._given_forks:
            self._forks.close()
        self._forks = None
        if self.broker is not None:
            self.broker.stop()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
