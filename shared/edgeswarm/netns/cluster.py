"""``edgeswarm up --netns``: a whole cluster on this machine as real hosts.

Every node of the cluster file (the hub first, then the devices and edge servers) gets its own network namespace
with its own address on a shared bridge, its own Mosquitto with the deployment's configuration (TLS, a password per
member, the ACL generated from the topic tree), and its services started as ``edgeswarm service NAME`` with the
environment ``compose.yaml`` gives them. Tensors for a node go to its own broker (principle 3), control traffic to
the hub's. Links are shaped by the kernel from the same device-class and cluster files the in-process emulation
reads; the bus's own shaping is not used here. Services are forked into their node's namespace from one fork server
(``local.forkserver``: edgeswarm and torch imported once, so a device's first round does not pay the imports), except
on a node whose clock can be skewed: libfaketime must be preloaded, so those start as fresh processes.

Everything made is recorded first (``netns.state``) and removed by ``stop()``; a launcher that dies without
stopping leaves its state file, and the next start removes what it names.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from edgeswarm.compose_env import services_for
from edgeswarm.devices.cluster import ClusterSpec
from edgeswarm.devices.compute import sharing_cores
from edgeswarm.errors import ConfigError
from edgeswarm.local.forkserver import ForkedProcess, ForkServer
from edgeswarm.local.launcher import (
    CHECKPOINT_DIR_ENV,
    HUB_NODE,
    OPERATOR,
    STOP_GRACE_S,
    ChildProcess,
    power_cut,
    stop_children,
)
from edgeswarm.netns import brokers, faults, host, network
from edgeswarm.netns.clock import find_libfaketime, skewable_env
from edgeswarm.netns.shaping import LinkShape, NodeShaper
from edgeswarm.netns.state import (
    NetnsNode,
    NetnsState,
    allocation_lock,
    clock_file,
    free_subnet,
    new_run_id,
    process_start_ticks,
)
from edgeswarm.roles import NodeRole, Role
from edgeswarm.security.certs import CertsDir
from edgeswarm.security.credentials import CredentialsDir
from edgeswarm.service_registry import services_of

log = logging.getLogger(__name__)


class NetnsCluster:
    """A cluster of namespaces. Use as a context manager or call ``start()`` and ``stop()``; the attributes that
    ``LocalCluster`` has (``children``, ``hub_url``, ``client_env()``, ``restart()``) mean the same here."""

    def __init__(self, spec: ClusterSpec, *, workdir: Path | None = None, heartbeat_interval_s: float | None = None,
                 extra_env: dict[str, str] | None = None, skip_services: tuple[str, ...] = (),
                 shape_links: bool = True, skewable: tuple[str, ...] = ()) -> None:
        self.spec = spec
        # Nodes whose wall clock `edgeswarm chaos skew` can move: their processes run under libfaketime, which costs
        # (measured here: a message's round trip 2.3 ms -> 42 ms), so only the nodes asked for.
        self.skewable = skewable
        self.skip_services = skip_services
        self.shape_links = shape_links
        self.secure = True
        self._heartbeat = heartbeat_interval_s
        self._extra_env = extra_env or {}
        self.workdir = (workdir or Path(tempfile.mkdtemp(prefix="edgeswarm-netns-"))).resolve()
        self.state: NetnsState | None = None
        self.children: list[ChildProcess] = []
        self.brokers: dict[str, subprocess.Popen[bytes]] = {}
        self._forks: ForkServer | None = None
        # Every child is started from this one thread: a child that dies with its parent (PR_SET_PDEATHSIG) dies
        # with the *thread* that forked it, and a restart asked for from a short-lived timer thread must not.
        self._spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="netns-spawn")

    # --- what callers read -------------------------------------------------------------------------------------

    @property
    def started(self) -> NetnsState:
        """What the running cluster made. Raises RuntimeError before ``start()``."""
        if self.state is None:
            raise RuntimeError("the cluster is not started")
        return self.state

    @property
    def nodes(self) -> list[NetnsNode]:
        return self.started.nodes

    def node(self, name: str) -> NetnsNode:
        try:
            return self.started.node(name)
        except KeyError:
            raise ConfigError(f"no node {name!r} in this cluster; nodes: "
                              f"{', '.join(n.node for n in self.nodes)}") from None

    @property
    def bridge(self) -> str:
        return self.started.bridge

    @property
    def run_id(self) -> str:
        """The id everything of this cluster is named with (``edgeswarm chaos --cluster``)."""
        return self.started.run_id

    @property
    def hub_url(self) -> str:
        return self.node(HUB_NODE).broker_url

    @property
    def secrets(self) -> Path:
        return self.workdir / "secrets"

    @property
    def checkpoint_dir(self) -> Path:
        chosen = self._extra_env.get(CHECKPOINT_DIR_ENV)
        return Path(chosen) if chosen else self.workdir / "checkpoints"

    def identity_env(self, member: str) -> dict[str, str]:
        return {"EDGESWARM_MQTT_USERNAME": member,
                "EDGESWARM_MQTT_PASSWORD_FILE": str(CredentialsDir(self.secrets).password_file(member)),
                "EDGESWARM_TLS_CA_FILE": str(CertsDir(self.secrets).ca_cert)}

    def client_env(self) -> dict[str, str]:
        """What a command line in the root namespace needs to reach this cluster, as the ``operator`` member."""
        return {"EDGESWARM_HUB_URL": self.hub_url, **self.identity_env(OPERATOR)}

    # --- start and stop ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Check this machine can run it, remove what dead launchers left, then make the network, the brokers and
        the services. If anything fails, whatever was made is removed before the error is raised."""
        host.preflight()
        unknown = sorted(set(self.skewable) - {HUB_NODE, *(d.id for d in self.spec.nodes)})
        if unknown:
            raise ConfigError(f"--skewable {', '.join(unknown)}: not a node of cluster {self.spec.name}")
        if self.skewable:
            find_libfaketime()  # raises ClockSkewUnavailableError naming the package
        network.clean_stale()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _roles(self) -> list[tuple[str, NodeRole]]:
        return [(HUB_NODE, "hub"), *((d.id, "device") for d in self.spec.devices),
                *((e.id, "edge") for e in self.spec.edges)]

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Started by the spawner thread: it dies with the thread that started it (as every child here does). Started
        # first, so that its imports (seconds of CPU) overlap the namespaces, brokers and links being made.
        forks = self._spawner.submit(ForkServer, self.workdir / "logs" / "forkserver.log")
        try:
            self._make_network()
        finally:
            self._forks = forks.result()
        assert self.state is not None
        for node in self.state.nodes:
            for service in services_of(node.role):
                if node.role == "hub" or service not in self.skip_services:
                    self._spawn(node, service)

    def _make_network(self) -> None:
        """The cluster's namespaces, bridge, secrets, brokers and shaped links (its state saved before any of them)."""
        with allocation_lock():
            run_id = new_run_id()
            subnet = free_subnet(network.addresses_in_use())
            me = os.getpid()
            self.state = NetnsState(run_id=run_id, owner_pid=me, owner_started=process_start_ticks(me),
                                    subnet=subnet, bridge=f"es{run_id}br",
                                    workdir=str(self.workdir), nodes=network.layout(run_id, subnet, self._roles()))
            self.state.save()  # before anything exists, so that a crash from here on is cleaned up
        network.create(self.state)
        self._write_secrets()
        for node in self.state.nodes:
            self.start_broker(node.node)
        if self.shape_links:
            self._shape()

    def _write_secrets(self) -> None:
        assert self.state is not None
        members: dict[str, Role] = {n.node: n.role for n in self.state.nodes}
        members[OPERATOR] = "client"
        CredentialsDir(self.secrets).update(add=members)
        certs = CertsDir(self.secrets)
        certs.ensure_ca()
        for node in self.state.nodes:
            certs.issue_broker(node.node, [node.address])

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every service (devices first), wait, SIGKILL stragglers, then remove the namespaces (and every
        process still in them: brokers, helpers), the bridge and the state file."""
        stop_children(self.children, timeout_s)
        if self._forks is not None:
            self._forks.close()
            self._forks = None
        for proc in self.brokers.values():
            brokers.stop(proc)
        if self.state is not None:
            for node in self.state.nodes:
                self.shaper(node.node).close()
            network.destroy(self.state)
        self._spawner.shutdown(wait=False)

    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # --- brokers -----------------------------------------------------------------------------------------------

    def start_broker(self, name: str) -> None:
        """Start (or start again) ``name``'s broker with the deployment's configuration; its retained messages
        persist in the node's folder across restarts."""
        node = self.node(name)
        certs, creds = CertsDir(self.secrets), CredentialsDir(self.secrets)
        cert, key = certs.broker(name)
        folder = self.workdir / "brokers" / name
        (folder / "data").mkdir(parents=True, exist_ok=True)
        conf = folder / "mosquitto.conf"
        conf.write_text(brokers.deployment_config(cert=cert, key=key, ca=certs.ca_cert, passwd=creds.mosquitto_passwd,
                                                  acl=creds.mosquitto_acl, data_dir=folder / "data"))
        self.brokers[name] = self._spawner.submit(brokers.start, node, conf, folder / "mosquitto.log").result()

    def restart_broker(self, name: str, *, down_s: float = 1.0, kill: bool = False) -> float:
        """Stop ``name``'s broker (SIGTERM, or SIGKILL as a crash), wait ``down_s`` seconds, start it again; returns
        the seconds it was unreachable."""
        node = self.node(name).node
        # Kept, so that stop() ends and reaps it like the first one.
        self.brokers[node], down = faults.restart_broker(self.started, node, down_s=down_s, kill=kill)
        return down

    # --- services ----------------------------------------------------------------------------------------------

    def service_env(self, node: NetnsNode, service: str) -> dict[str, str]:
        """The environment compose.yaml gives ``service`` on ``node`` (its role's profile, interpolated with the
        node's ``.env`` values), with the container's paths and its ``broker`` host name replaced by this cluster's
        files, folders and the node's address. The test and benchmark settings (``extra_env``) come last."""
        assert self.state is not None
        entry = next((d for d in self.spec.nodes if d.id == node.node), None)
        variables = {"EDGESWARM_NODE_ID": node.node, "EDGESWARM_HUB_URL": self.state.hub.broker_url,
                     "EDGESWARM_DATA_URL": node.broker_url, "EDGESWARM_SECRETS": str(self.secrets),
                     "EDGESWARM_DEVICE_CLASS": entry.device_class if entry else "native"}
        if self._heartbeat is not None:
            variables["EDGESWARM_HEARTBEAT_INTERVAL_S"] = str(self._heartbeat)
        composed = {s.name: s for s in services_for(node.role, variables)}
        if service not in composed:
            raise ConfigError(f"compose.yaml runs no {service} in profile {node.role}")
        folder = self.workdir / "nodes" / node.node
        env = sharing_cores(os.environ)  # the nodes' namespaces share this host's cores
        env.pop("EDGESWARM_LINKS", None)  # the kernel shapes these links, not the bus
        env.update(composed[service].environment_on_host())
        env.update({
            "EDGESWARM_DATA_CONNECT_URL": node.broker_url,
            "EDGESWARM_HEALTH_DIR": str(folder / "health"),
            "EDGESWARM_PROFILE_DIR": str(folder / "profiles"),
            CHECKPOINT_DIR_ENV: str(self.checkpoint_dir),
            "EDGESWARM_DIE_WITH_PARENT": str(os.getpid()),
            **(entry.budget_env() if entry else {}),
        })
        if node.node in self.skewable:  # every service of the node reads one clock file: `chaos skew` moves it
            env.update(skewable_env(clock_file(self.workdir, node.node)))
        env.update(self._extra_env)
        return env

    def _spawn(self, node: NetnsNode, service: str) -> ChildProcess:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{node.node}.{service}.log"
        env = self.service_env(node, service)

        def launch() -> subprocess.Popen[bytes] | ForkedProcess:
            if self._forks is not None and node.node not in self.skewable:
                return self._forks.spawn(service, env, log_path, netns=node.netns)
            with open(log_path, "ab") as out:
                return subprocess.Popen(["ip", "netns", "exec", node.netns, sys.executable, "-m", "edgeswarm",
                                         "service", service], env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)

        child = ChildProcess(node.node, service, self._spawner.submit(launch).result(), log_path, env)
        self.children.append(child)
        log.debug("started %s on %s (pid %d) in %s", service, node.node, child.pid, node.netns)
        return child

    def address(self, node: str) -> str:
        """``node``'s address on the cluster's network."""
        return self.node(node).address

    def interface(self, node: str) -> str:
        """The network interface ``node``'s processes reach the others through (inside its namespace)."""
        return "eth0"

    def spawn(self, node: str, argv: list[str], *, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``node``'s namespace (its traffic crosses the node's shaped link), its output to
        ``log_path``; the caller stops it."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.node(node).netns, *argv], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def link_bytes(self, node: str) -> int | None:
        """Bytes through ``node``'s link so far, both ways (the kernel's counters of its veth's host side)."""
        stats = Path("/sys/class/net") / self.node(node).veth / "statistics"
        return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())

    def restart(self, node: str, service: str) -> ChildProcess:
        """Start ``service`` on ``node`` again after it died or was killed. Raises ConfigError when the cluster
        never ran it, or it still runs."""
        old = next((c for c in reversed(self.children) if (c.node, c.service) == (node, service)), None)
        if old is None:
            raise ConfigError(f"{service} on {node} is not a service of this cluster")
        if old.alive():
            raise ConfigError(f"{service} on {node} is still running (pid {old.pid})")
        return self._spawn(self.node(node), service)

    def failed_children(self) -> list[ChildProcess]:
        return [c for c in self.children if not c.alive()]

    def power_cut(self, node: str) -> None:
        """SIGKILL every process of ``node``."""
        power_cut(self.children, node)

    # --- faults ------------------------------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Cut ``name`` off the network (its link goes down, as a Wi-Fi link drops): its processes keep running."""
        network.set_link(self.node(name), up=False)

    def heal(self, name: str) -> None:
        network.set_link(self.node(name), up=True)

    def partition(self, groups: list[list[str]]) -> None:
        """Split the cluster: no packet passes between nodes of different ``groups`` (each node drops what it would
        send to the other side). The root namespace (command lines) still reaches every node."""
        faults.partition(self.nodes, [[self.node(n) for n in group] for group in groups])

    def heal_partition(self) -> None:
        faults.heal_partition(self.nodes)

    def pause(self, name: str) -> int:
        """SIGSTOP every process of ``name`` (its services and its broker); returns how many."""
        return faults.signal_node(self.node(name), signal.SIGSTOP)

    def resume(self, name: str) -> int:
        return faults.signal_node(self.node(name), signal.SIGCONT)

    # --- links -------------------------------------------------------------------------------------------------

    def shaper(self, name: str) -> NodeShaper:
        """The kernel shaper of ``name``'s links (its state in the node's folder, so any process can change it; this
        cluster's process owns it, whoever changes it)."""
        return faults.shaper_of(self.started, name)

    def _shape(self) -> None:
        """Shape every device's and edge server's links to the others as the cluster file says (rate, latency);
        the hub's links (control traffic, and the host's command lines) stay as they are."""
        assert self.state is not None
        nodes = [n for n in self.state.nodes if n.role != "hub"]
        for node in nodes:
            self.shaper(node.node).apply({peer.address: LinkShape.from_link(self.spec.link(node.node, peer.node))
                                          for peer in nodes if peer is not node})

    def set_link(self, a: str, b: str, shape: LinkShape) -> dict[str, LinkShape]:
        """Give the link between ``a`` and ``b`` ``shape`` in both directions (the whole shape: what it leaves at
        its default is unshaped); returns the shapes it had (by node), for ``restore_link``."""
        return faults.set_link(self.started, a, b, shape)

    def change_link(self, a: str, b: str, **changes: float | None) -> dict[str, LinkShape]:
        """Change only the named ``LinkShape`` properties of the link between ``a`` and ``b`` (e.g. ``loss=0.01``;
        its rate and delay stay); returns the shapes it had (by node), for ``restore_link``."""
        return faults.change_link(self.started, a, b, **changes)

    def restore_link(self, a: str, b: str, before: dict[str, LinkShape]) -> None:
        faults.restore_link(self.started, a, b, before)
