"""What the central manager is told about the devices and the MECs before a round: each one's speed, its link to its
MEC, its memory budget now, its data and the MEC's estimates of its skew and utility.

Speeds and links are measured, never read from a device's class (an emulated device is measured like a real one):
each node's profiler times the model's units at the job's batch size (``profiling.gather``), and a node's speed is
a training iteration's FLOPs over those seconds; each device's profiler measures its link to its MEC (its bandwidth
and what a message costs on it). ``measure`` asks for what a round needs and was not measured yet (a new device, a
new MEC, a device moved to another MEC).
Budgets are the node's memory budget less what its ledger holds for other jobs (the view's reserved bytes), capped
by the job's own cap."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeswarm.bus import Bus
from edgeswarm.errors import ProfileError
from edgeswarm.messages.cluster import ClusterView, NodeView
from edgeswarm.planning.splitfed.types import ModelCost, SplitDevice, SplitMec
from edgeswarm.profiling.gather import profile_cluster
from edgeswarm.values.profiles import ClusterProfile, DeviceProfileEntry, LinkProfile, ModelProfile, ModelSpec


@dataclass(frozen=True)
class Estimates:
    """The MEC's latest estimates of a device: label skew (nats) and statistical utility."""

    dis: float
    stat: float


@dataclass
class Measured:
    """What the profilers measured of a job's parties: each node's training speed (FLOP/s) and its units' shares of
    it (``unit_shares``), each device's link to its MEC ((device, MEC) -> its profile), and each node's profile
    (``cluster``: what its measured speed is saved against)."""

    speeds: dict[str, float] = field(default_factory=dict)
    shares: dict[str, tuple[float, ...]] = field(default_factory=dict)
    links: dict[tuple[str, str], LinkProfile] = field(default_factory=dict)
    profiles: dict[str, DeviceProfileEntry] = field(default_factory=dict)
    model: ModelProfile | None = None

    def cluster(self, nodes: list[str]) -> ClusterProfile | None:
        """The profiles of ``nodes`` measured so far, as a cluster profile (no links); None before any."""
        entries = [self.profiles[n] for n in nodes if n in self.profiles]
        return ClusterProfile(model=self.model, devices=entries) if self.model is not None and entries else None

    def missing(self, devices: list[str], mecs: list[str], mec_of: dict[str, str]) -> tuple[list[str],
                                                                                           list[tuple[str, str]]]:
        """The nodes of a round with no speed yet, and its (device, MEC) pairs with no link."""
        return ([n for n in [*devices, *mecs] if n not in self.speeds],
                [(d, mec_of[d]) for d in devices if (d, mec_of[d]) not in self.links])


def training_flops_per_s(cost: ModelCost, entry: DeviceProfileEntry) -> float:
    """A node's training speed: the FLOPs of one forward and backward of every unit at ``cost``'s batch size over
    the seconds its profile measured for them. Raises ProfileError when the profile is of another model's units or
    lacks that batch size."""
    seconds = sum(_unit_seconds(cost, entry))
    return sum(u.flops_fwd + u.flops_bwd for u in cost.units) / max(seconds, 1e-9)


def unit_shares(cost: ModelCost, entry: DeviceProfileEntry) -> tuple[float, ...]:
    """Each unit's share of a training iteration's seconds (forward and backward at ``cost``'s batch size) in the
    node's profile ``entry``, which the planner prices its part by (``planning.splitfed.cost.unit_work``); empty
    (the FLOPs' shares) when the profile timed nothing. Raises ProfileError as ``training_flops_per_s`` does."""
    seconds = _unit_seconds(cost, entry)
    total = sum(seconds)
    return tuple(x / total for x in seconds) if total > 0 else ()


def _unit_seconds(cost: ModelCost, entry: DeviceProfileEntry) -> list[float]:
    """Each unit's forward and backward seconds at ``cost``'s batch size in the profile ``entry``. Raises
    ProfileError when the profile is of another model's units or lacks that batch size."""
    compute = entry.compute
    if len(compute.forward_s) != len(cost.units) or cost.batch_size not in compute.batch_sizes:
        raise ProfileError(f"the profile of {entry.device.node} has {len(compute.forward_s)} units at batch sizes "
                           f"{compute.batch_sizes}, not {cost.name}'s {len(cost.units)} at {cost.batch_size}")
    k = compute.batch_sizes.index(cost.batch_size)
    return [f[k] + b[k] for f, b in zip(compute.forward_s, compute.backward_s, strict=True)]


def measure(bus: Bus, spec: ModelSpec, cost: ModelCost, measured: Measured, nodes: list[str],
            pairs: list[tuple[str, str]], timeout_s: float) -> None:
    """Profile ``nodes`` (their speeds) and ``pairs`` ((device, MEC): the device's link to it) into ``measured``,
    waiting at most ``timeout_s`` seconds for the profilers to come up and for each turn. Raises what
    ``profiling.gather.profile_cluster`` raises (ProfilerError naming a node whose profiler failed or is
    missing) and ProfileError."""
    chosen = sorted(set(nodes) | {n for pair in pairs for n in pair})
    cluster = profile_cluster(bus, spec, [cost.batch_size], nodes=chosen, links=bool(pairs), link_pairs=pairs,
                              timeout_s=timeout_s, ready_timeout_s=timeout_s)
    measured.speeds.update({e.device.node: training_flops_per_s(cost, e) for e in cluster.devices})
    measured.shares.update({e.device.node: unit_shares(cost, e) for e in cluster.devices})
    measured.profiles.update({e.device.node: e for e in cluster.devices})
    measured.model = cluster.model
    wanted = set(pairs)
    measured.links.update({(x.src, x.dst): x for x in cluster.links if (x.src, x.dst) in wanted})


def budget_bytes(view: NodeView, cap: int) -> int:
    """The training memory ``view``'s node has for a new job now: its budget less what its ledger holds, at most
    ``cap`` bytes when ``cap`` is set."""
    room = max(view.memory_budget_bytes - view.reserved_memory_bytes, 0)
    return min(room, cap) if cap else room


def split_devices(view: ClusterView, devices: list[str], mec_of: dict[str, str], samples: dict[str, int],
                  estimates: dict[str, Estimates], measured: Measured, cap: int,
                  setups: dict[str, float] | None = None) -> list[SplitDevice]:
    """The central manager's view of ``devices`` (online nodes of ``view``, each measured), each under
    ``mec_of[device]`` (measured too), with its measured seconds before a round's first step (``setups``; 0 where
    none)."""
    out = []
    for node in devices:
        nv, link = view.node(node), measured.links.get((node, mec_of[node]))
        if nv is None or link is None or node not in measured.speeds or mec_of[node] not in measured.speeds:
            continue
        est = estimates.get(node)
        out.append(SplitDevice(node=node, mec=mec_of[node], speed_flops=measured.speeds[node],
                               link_bytes_s=link.bandwidth_bps, link_message_s=link.per_message_s,
                               budget_bytes=budget_bytes(nv, cap), samples=samples.get(node, 0),
                               dis=est.dis if est else 0.0, stat=est.stat if est else float(samples.get(node, 0)),
                               setup_s=(setups or {}).get(node, 0.0), unit_share=measured.shares.get(node, ())))
    return out


def split_mecs(mecs: list[str], measured: Measured) -> list[SplitMec]:
    """The central manager's view of the edge servers ``mecs`` (each measured)."""
    return [SplitMec(node=m, speed_flops=measured.speeds[m], unit_share=measured.shares.get(m, ()))
            for m in mecs if m in measured.speeds]


def assign_mecs(devices: list[str], mecs: list[str]) -> dict[str, str]:
    """Each device's MEC, its jurisdiction: round robin over the MECs in name order, so a device keeps its MEC from
    round to round while the MECs stay the same."""
    ordered = sorted(mecs)
    return {d: ordered[i % len(ordered)] for i, d in enumerate(sorted(devices))}
