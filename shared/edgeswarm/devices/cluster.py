"""Cluster files: which devices (and edge servers) a local cluster has, their classes, and link overrides.

A cluster file is YAML::

    name: asteroid-env-d-100mbps
    description: Asteroid Env D (1 TX2 + 3 Nano) at 100 Mbps
    network: {bandwidth_mbps: 100, latency_ms: 0.5}   # optional: every link unless overridden
    devices:
      - {id: tx2-0, class: jetson-tx2}
      - {id: nano-0, class: jetson-nano}
    edges:                                            # optional: edge servers (MECs), the edge role
      - {id: mec-0, class: native}
    links:                                            # optional, symmetric unless directed: true
      - {between: [tx2-0, nano-0], bandwidth_mbps: 50, latency_ms: 5}

``devices`` run the device role's services and ``edges`` the edge role's (``edgeswarm.service_registry``); an edge
server is emulated like a device (its class) and linked like one, but it is not a device: plans place no stage on
it. ``up --local --edges N`` adds N edge servers of class ``native`` to any cluster.

Ready files for the Asteroid paper's environments ship in ``edgeswarm/devices/clusters/`` and can be
named without their path (``--devices asteroid-env-d-100mbps``).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edgeswarm.devices.catalogue import DEFAULT_MIX, MBPS, DeviceClass, device_class, link_between
from edgeswarm.errors import ConfigError
from edgeswarm.settings import LinkSpec
from edgeswarm.wire.schema import Name

CLUSTERS_DIR = Path(__file__).parent / "clusters"


class DeviceEntry(BaseModel):
    """One device (or edge server) of a cluster: its node id and device class, and optionally a memory budget other
    than the class's (``memory_budget_gb``, decimal gigabytes: the Galaxy paper gives one board class different
    budgets in different environments)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    id: Name
    device_class: str = Field(alias="class")
    memory_budget_gb: float | None = Field(default=None, gt=0, le=1e6)

    def budget_env(self) -> dict[str, str]:
        """The setting that gives the node its own memory budget (none: the class's)."""
        if self.memory_budget_gb is None:
            return {}
        return {"EDGESWARM_MEMORY_BUDGET_BYTES": str(int(self.memory_budget_gb * 1e9))}


class NetworkDefaults(BaseModel):
    """Bandwidth (megabits per second) and one-way latency (milliseconds) of every link not overridden."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_mbps: float = Field(gt=0)
    latency_ms: float = Field(default=0.0, ge=0)

    def spec(self) -> LinkSpec:
        return LinkSpec(bandwidth_bps=self.bandwidth_mbps * MBPS, latency_s=self.latency_ms / 1000)


class LinkOverride(NetworkDefaults):
    """A link between two nodes (devices or edge servers) with its own bandwidth and latency."""

    between: tuple[Name, Name]
    directed: bool = False


class ClusterSpec(BaseModel):
    """A validated cluster: unique node ids, known classes, links between existing nodes. ``devices`` are the nodes
    of the device role, ``edges`` those of the edge role; ``nodes`` both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    network: NetworkDefaults | None = None
    devices: tuple[DeviceEntry, ...] = Field(min_length=1)
    edges: tuple[DeviceEntry, ...] = ()
    links: tuple[LinkOverride, ...] = ()

    @property
    def nodes(self) -> tuple[DeviceEntry, ...]:
        """Every node beside the hub: the devices, then the edge servers."""
        return self.devices + self.edges

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSpec:
        ids = [d.id for d in self.nodes]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"node ids (devices and edges) must be unique; repeated: {dupes}")
        for d in self.nodes:
            device_class(d.device_class)
        for link in self.links:
            missing = [e for e in link.between if e not in ids]
            if missing:
                raise ValueError(f"link {list(link.between)} names unknown device(s) or edge(s) {missing}")
        return self

    def device_class_of(self, node: str) -> DeviceClass:
        """The class of device (or edge server) ``node``."""
        entry = next((d for d in self.nodes if d.id == node), None)
        if entry is None:
            raise ConfigError(f"no device or edge {node!r} in cluster {self.name}")
        dc = device_class(entry.device_class)
        if entry.memory_budget_gb is not None:
            dc = dc.model_copy(update={"memory_budget_bytes": int(entry.memory_budget_gb * 1e9)})
        return dc

    def link(self, src: str, dst: str) -> LinkSpec:
        """The emulated link from ``src`` to ``dst``: an override, else the network default, else the classes'."""
        for link in reversed(self.links):
            if link.between == (src, dst) or (not link.directed and link.between == (dst, src)):
                return link.spec()
        if self.network is not None:
            return self.network.spec()
        return link_between(self.device_class_of(src), self.device_class_of(dst))

    def links_from(self, src: str) -> dict[str, LinkSpec]:
        """Every outgoing link of ``src``, keyed by peer node id (devices and edge servers)."""
        return {d.id: self.link(src, d.id) for d in self.nodes if d.id != src}

    def with_edges(self, count: int, device_class_name: str = "native") -> ClusterSpec:
        """This cluster with ``count`` more edge servers of one class, ``edge-0``, ``edge-1``, ... (skipping ids
        taken)."""
        taken = {d.id for d in self.nodes}
        names = (f"edge-{i}" for i in range(len(taken) + count + 1))
        added = tuple(DeviceEntry(id=n, device_class=device_class_name) for n in names if n not in taken)[:count]
        try:  # validated again: the class must exist
            return ClusterSpec.model_validate({**self.model_dump(by_alias=True), "edges": self.edges + added})
        except ValidationError as exc:
            raise ConfigError(f"cannot add {count} edge servers of class {device_class_name!r}: {exc}") from None


def load_cluster(ref: str) -> ClusterSpec:
    """Load a cluster file by path, or by the name of a bundled file. Raises ConfigError."""
    path = Path(ref)
    if not path.exists():
        bundled = CLUSTERS_DIR / f"{ref.removesuffix('.yaml')}.yaml"
        if not bundled.exists():
            names = ", ".join(sorted(p.stem for p in CLUSTERS_DIR.glob("*.yaml")))
            raise ConfigError(f"no cluster file {ref!r}; give a path or one of: {names}")
        path = bundled
    try:
        data = yaml.safe_load(path.read_text())
        return ClusterSpec.model_validate(data)
    except (yaml.YAMLError, ValidationError, ConfigError) as exc:
        raise ConfigError(f"invalid cluster file {path}: {exc}") from None


def cluster_of(count: int, device_class: str | None = None) -> ClusterSpec:
    """``count`` devices of one class, or cycling through DEFAULT_MIX when ``device_class`` is None."""
    if count < 1:
        raise ConfigError("a cluster needs at least one device")
    classes = [device_class or DEFAULT_MIX[i % len(DEFAULT_MIX)] for i in range(count)]
    devices = [DeviceEntry(id=f"{c.removeprefix('jetson-')}-{i}", device_class=c) for i, c in enumerate(classes)]
    return ClusterSpec(name=f"local-{count}", description=f"{count} emulated devices", devices=tuple(devices))
