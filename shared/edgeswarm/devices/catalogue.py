"""The catalogue of device classes an emulated node can be.

Compute slow-downs are relative to the host running the emulation (the fastest class, edge-server, is
1.0, so no class is faster than the host). They follow the relative speeds the Asteroid paper's
measurements imply (spec section 7.1: Nano 1x, TX2 about 2.5x a Nano, NX about 2x a TX2). Memory is
the device's physical memory and the budget edgeswarm may use after the OS and runtime (spec
section 2: usable memory minus overhead, minus about 10 percent). A class's link is the default for
links touching it; a link between two classes runs at the slower end's bandwidth and latency unless
a cluster file overrides it. tests/test_readme.py keeps the README's table equal to this one.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.errors import ConfigError
from edgeswarm.settings import LinkSpec

GIB = 1024**3
MBPS = 1e6 / 8  # bytes per second in one megabit per second


class DeviceClass(BaseModel):
    """One kind of device. Bytes for memory, bytes per second and seconds for the default link."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    compute_slowdown: float = Field(ge=1.0)
    memory_bytes: int = Field(gt=0)
    memory_budget_bytes: int = Field(gt=0)
    link: LinkSpec
    emulated: bool = True


def _cls(name: str, description: str, slowdown: float, memory_gib: float, budget_gib: float,
         mbps: float, latency_ms: float) -> DeviceClass:
    return DeviceClass(
        name=name,
        description=description,
        compute_slowdown=slowdown,
        memory_bytes=int(memory_gib * GIB),
        memory_budget_bytes=int(budget_gib * GIB),
        link=LinkSpec(bandwidth_bps=mbps * MBPS, latency_s=latency_ms / 1000),
    )


CATALOGUE: dict[str, DeviceClass] = {
    c.name: c
    for c in (
        _cls("jetson-nano", "Jetson Nano-like: 128-core Maxwell, 4 GB unified memory", 10.0, 4, 3.0, 1000, 0.5),
        _cls("jetson-tx2", "Jetson TX2-like: 256-core Pascal, 8 GB unified memory", 4.0, 8, 6.5, 1000, 0.5),
        _cls("jetson-nx", "Jetson Xavier NX-like: 384-core Volta, 8 GB unified memory", 2.0, 8, 6.5, 1000, 0.5),
        # The Galaxy paper's Jetson Nano CPU at three clock settings (1.47 GHz, 825 MHz, 403 MHz: its Table II),
        # slowed in proportion to the clock, with the paper's heterogeneous budgets (1.5, 1.2, 0.7 GB).
        _cls("jetson-nano-l", "Jetson Nano CPU at 1.47 GHz (Galaxy's Nano-L), 4 GB", 6.0, 4, 1.5e9 / GIB, 1000, 0.5),
        _cls("jetson-nano-m", "Jetson Nano CPU at 825 MHz (Galaxy's Nano-M), 4 GB", round(6.0 * 1.47 / 0.825, 1), 4,
             1.2e9 / GIB, 1000, 0.5),
        _cls("jetson-nano-s", "Jetson Nano CPU at 403 MHz (Galaxy's Nano-S), 4 GB", round(6.0 * 1.47 / 0.403, 1), 4,
             0.7e9 / GIB, 1000, 0.5),
        # SmartSplit's five phones (its Table I), slowed in proportion to their big cores' clock against a 3.5 GHz
        # host core (and twice more for the Redmi 2's in-order A53s), each with a quarter of its RAM as its training
        # budget (the paper draws 10 to 40 percent per round) and a Wi-Fi link to the edge server.
        _cls("redmi-2", "Redmi 2-like phone: Snapdragon 410, 4x 1.2 GHz, 2 GB", 6.0, 2, 0.5, 50, 5.0),
        _cls("honor-8", "Honor 8-like phone: Kirin 950, 4x 2.3 GHz big cores, 4 GB", 1.5, 4, 1.0, 50, 5.0),
        _cls("redmi-note-10", "Redmi Note 10-like phone: Snapdragon 678, 2x 2.2 GHz big cores, 6 GB", 1.6, 6, 1.5,
             50, 5.0),
        _cls("pixel-6", "Google Pixel 6-like phone: Google Tensor, 2x 2.8 GHz big cores, 8 GB", 1.25, 8, 2.0, 50,
             5.0),
        _cls("oneplus-9", "OnePlus 9-like phone: Snapdragon 888, 1x 2.84 GHz prime core, 12 GB", 1.25, 12, 3.0, 50,
             5.0),
        _cls("rpi4", "Raspberry Pi 4-like: 4x Cortex-A72 CPU only, 4 GB, Wi-Fi", 20.0, 4, 3.0, 300, 2.0),
        _cls("laptop", "Laptop-like: mobile CPU, 16 GB, Wi-Fi", 1.5, 16, 12.0, 400, 2.0),
        _cls("edge-server", "Edge server-like: server CPU/GPU, 64 GB, 10 GbE", 1.0, 64, 56.0, 10000, 0.2),
    )
}

# `edgeswarm up --local --devices N` cycles through these classes so a small cluster is heterogeneous.
DEFAULT_MIX = ("jetson-tx2", "jetson-nano", "jetson-nx", "rpi4", "laptop", "edge-server")


def native_class() -> DeviceClass:
    """This machine as it is: no slow-down, its own memory, no link emulation."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceClass(
        name="native",
        description="this machine as it is (no emulation)",
        compute_slowdown=1.0,
        memory_bytes=total,
        memory_budget_bytes=int(total * 0.9),
        link=LinkSpec(bandwidth_bps=10000 * MBPS, latency_s=0.0),
        emulated=False,
    )


def device_class(name: str) -> DeviceClass:
    """The class called ``name`` (``native`` included). Raises ConfigError listing the known classes."""
    if name == "native":
        return native_class()
    try:
        return CATALOGUE[name]
    except KeyError:
        raise ConfigError(f"unknown device class {name!r}; known: native, {', '.join(CATALOGUE)}") from None


def link_between(a: DeviceClass, b: DeviceClass) -> LinkSpec:
    """The default link between two classes: the slower end's bandwidth and latency."""
    return LinkSpec(bandwidth_bps=min(a.link.bandwidth_bps, b.link.bandwidth_bps),
                    latency_s=max(a.link.latency_s, b.link.latency_s))
