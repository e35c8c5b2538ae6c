"""What the central manager is told about the devices and the MECs before a round: each one's speed, its link to its
MEC, its memory budget now, its data and the MEC's estimates of its skew and utility.

Speeds are the host's measured FLOP/s (``profiling.compute.host_flops``, on the profiler's calibration step) divided
by the node's emulated slow-down (an emulated cluster shares the host); links are the device classes' links between
a device and its MEC; budgets are the node's memory budget less what its ledger holds for other jobs (the view's
reserved bytes), capped by the job's own cap."""

from __future__ import annotations

from dataclasses import dataclass

from edgeswarm.devices.catalogue import device_class, link_between
from edgeswarm.errors import ConfigError
from edgeswarm.messages.cluster import ClusterView, NodeView
from edgeswarm.planning.splitfed.types import SplitDevice, SplitMec


def _slowdown(view: NodeView) -> float:
    try:
        return device_class(view.device_class).compute_slowdown
    except ConfigError:
        return 1.0  # a class this build does not know: taken at the host's speed


def _link_bytes_s(device: NodeView, mec: NodeView) -> float:
    try:
        link = link_between(device_class(device.device_class), device_class(mec.device_class))
    except ConfigError:
        return 1e9 / 8
    return link.bandwidth_bps / 8


@dataclass(frozen=True)
class Estimates:
    """The MEC's latest estimates of a device: label skew (nats) and statistical utility."""

    dis: float
    stat: float


def budget_bytes(view: NodeView, cap: int) -> int:
    """The training memory ``view``'s node has for a new job now: its budget less what its ledger holds, at most
    ``cap`` bytes when ``cap`` is set."""
    room = max(view.memory_budget_bytes - view.reserved_memory_bytes, 0)
    return min(room, cap) if cap else room


def split_devices(view: ClusterView, devices: list[str], mec_of: dict[str, str], samples: dict[str, int],
                  estimates: dict[str, Estimates], flops: float, cap: int) -> list[SplitDevice]:
    """The central manager's view of ``devices`` (online nodes of ``view``), each under ``mec_of[device]``."""
    out = []
    for node in devices:
        nv, mv = view.node(node), view.node(mec_of[node])
        if nv is None or mv is None:
            continue
        est = estimates.get(node)
        out.append(SplitDevice(node=node, mec=mec_of[node], speed_flops=flops / _slowdown(nv),
                               link_bytes_s=_link_bytes_s(nv, mv), budget_bytes=budget_bytes(nv, cap),
                               samples=samples.get(node, 0), dis=est.dis if est else 0.0,
                               stat=est.stat if est else float(samples.get(node, 0))))
    return out


def split_mecs(view: ClusterView, mecs: list[str], flops: float) -> list[SplitMec]:
    """The central manager's view of the edge servers ``mecs``."""
    return [SplitMec(node=m, speed_flops=flops / _slowdown(nv)) for m in mecs if (nv := view.node(m)) is not None]


def assign_mecs(devices: list[str], mecs: list[str]) -> dict[str, str]:
    """Each device's MEC, its jurisdiction: round robin over the MECs in name order, so a device keeps its MEC from
    round to round while the MECs stay the same."""
    ordered = sorted(mecs)
    return {d: ordered[i % len(ordered)] for i, d in enumerate(sorted(devices))}
