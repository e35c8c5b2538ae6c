"""Cluster files: which devices a local cluster has, their classes, and link overrides.

A cluster file is YAML::

    name: asteroid-env-d-100mbps
    description: Asteroid Env D (1 TX2 + 3 Nano) at 100 Mbps
    network: {bandwidth_mbps: 100, latency_ms: 0.5}   # optional: every link unless overridden
    devices:
      - {id: tx2-0, class: jetson-tx2}
      - {id: nano-0, class: jetson-nano}
    links:                                            # optional, symmetric unless directed: true
      - {between: [tx2-0, nano-0], bandwidth_mbps: 50, latency_ms: 5}

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
    """One device of a cluster: its node id and device class."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    id: Name
    device_class: str = Field(alias="class")


class NetworkDefaults(BaseModel):
    """Bandwidth (megabits per second) and one-way latency (milliseconds) of every link not overridden."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_mbps: float = Field(gt=0)
    latency_ms: float = Field(default=0.0, ge=0)

    def spec(self) -> LinkSpec:
        return LinkSpec(bandwidth_bps=self.bandwidth_mbps * MBPS, latency_s=self.latency_ms / 1000)


class LinkOverride(NetworkDefaults):
    """A link between two devices with its own bandwidth and latency."""

    between: tuple[Name, Name]
    directed: bool = False


class ClusterSpec(BaseModel):
    """A validated cluster: unique device ids, known classes, links between existing devices."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    network: NetworkDefaults | None = None
    devices: tuple[DeviceEntry, ...] = Field(min_length=1)
    links: tuple[LinkOverride, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSpec:
        ids = [d.id for d in self.devices]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"device ids must be unique; repeated: {dupes}")
        for d in self.devices:
            device_class(d.device_class)
        for link in self.links:
            missing = [e for e in link.between if e not in ids]
            if missing:
                raise ValueError(f"link {list(link.between)} names unknown device(s) {missing}")
        return self

    def device_class_of(self, node: str) -> DeviceClass:
        """The class of device ``node``."""
        entry = next((d for d in self.devices if d.id == node), None)
        if entry is None:
            raise ConfigError(f"no device {node!r} in cluster {self.name}")
        return device_class(entry.device_class)

    def link(self, src: str, dst: str) -> LinkSpec:
        """The emulated link from ``src`` to ``dst``: an override, else the network default, else the classes'."""
        for link in reversed(self.links):
            if link.between == (src, dst) or (not link.directed and link.between == (dst, src)):
                return link.spec()
        if self.network is not None:
            return self.network.spec()
        return link_between(self.device_class_of(src), self.device_class_of(dst))

    def links_from(self, src: str) -> dict[str, LinkSpec]:
        """Every outgoing link of ``src``, keyed by peer node id."""
        return {d.id: self.link(src, d.id) for d in self.devices if d.id != src}


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
