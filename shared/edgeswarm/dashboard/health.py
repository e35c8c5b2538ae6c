"""Health warnings a user can act on, each with its fix: pure functions over what the dashboard observed.

* a device whose data URL others cannot reach: loopback (or a compose-internal name) on a cluster of several hosts;
* a broker without TLS beyond loopback (the hub's, or a node's advertised data-plane broker);
* a clock far off: a node's heartbeats arrive earlier or later than their ``sent_at`` says, by more than
  ``CLOCK_SKEW_S`` (message TTLs and the measured spans then lie);
* a device slower than its profile: a job's measured round (or a lane of its measured schedule) over
  ``SLOW_RATIO`` times the plan's prediction;
* memory near the budget: a node's reserved or used bytes at ``MEMORY_RATIO`` of its budget or more.
"""

from __future__ import annotations

from collections.abc import Mapping

from edgeswarm.dashboard.model import HealthWarning
from edgeswarm.errors import ConfigError
from edgeswarm.messages.cluster import ClusterView
from edgeswarm.messages.jobs import FINISHED, JobState
from edgeswarm.settings import is_loopback, parse_broker_url
from edgeswarm.values.schedule import ScheduleView

CLOCK_SKEW_S = 2.0
SLOW_RATIO = 1.5
MEMORY_RATIO = 0.9
_MIB = 1 << 20
# Host names that resolve only inside one compose stack (its own broker service).
_STACK_ONLY_HOSTS = frozenset({"broker"})


def _host_tls(url: str) -> tuple[str, bool] | None:
    try:
        addr = parse_broker_url(url)
    except ConfigError:
        return None
    return addr.host, addr.tls


def data_url_warnings(view: ClusterView | None) -> list[HealthWarning]:
    """Nodes advertising a data-plane broker the other hosts cannot reach: loopback or a stack-only name while the
    cluster spans several hosts (hosts as the services' statuses name them)."""
    if view is None:
        return []
    hosts = {s.host for n in view.nodes for s in n.services if s.state != "offline"}
    if len(hosts) < 2:
        return []  # one machine: loopback reaches every node
    out = []
    for node in view.nodes:
        urls = {s.data_url for s in node.services if s.state != "offline" and s.data_url}
        for url in sorted(urls):
            parsed = _host_tls(url)
            if parsed is None:
                continue
            host = parsed[0]
            if is_loopback(host) or host in _STACK_ONLY_HOSTS:
                out.append(HealthWarning(
                    check="data_url", severity="error", subject=node.node,
                    problem=f"advertises its data-plane broker as {url}, which the cluster's other hosts cannot "
                            "reach: tensors for it are never delivered",
                    fix=f"set EDGESWARM_DATA_URL on {node.node} to its broker's LAN address, e.g. "
                        "mqtts://192.168.1.21:8883, and restart its services"))
    return out


def tls_warnings(view: ClusterView | None, hub_url: str) -> list[HealthWarning]:
    """Brokers reached without TLS on an address beyond this machine: the hub's and every advertised data URL."""
    out = []
    seen: set[str] = set()
    brokers = [("the hub broker", hub_url)]
    if view is not None:
        brokers += [(n.node, s.data_url) for n in view.nodes for s in n.services if s.state != "offline" and s.data_url]
    for subject, url in brokers:
        parsed = _host_tls(url)
        if parsed is None or url in seen:
            continue
        seen.add(url)
        host, tls = parsed
        if not tls and not is_loopback(host):
            out.append(HealthWarning(
                check="tls", subject=subject,
                problem=f"the broker {url} is reached without TLS beyond this machine: anyone on the network reads "
                        "and can forge the cluster's messages",
                fix="run the brokers with TLS (compose.yaml does; `edgeswarm certs` makes the files) and use "
                    "mqtts:// URLs (deploy/README.md)"))
    return out


def clock_warnings(clock_offsets: Mapping[str, float]) -> list[HealthWarning]:
    """Nodes whose clock is more than ``CLOCK_SKEW_S`` off the dashboard's (``clock_offsets``: seconds ahead)."""
    out = []
    for node, offset in sorted(clock_offsets.items()):
        if abs(offset) > CLOCK_SKEW_S:
            out.append(HealthWarning(
                check="clock", subject=node,
                problem=f"its clock is {abs(offset):.1f} s {'ahead of' if offset > 0 else 'behind'} the hub's: "
                        "messages expire early or late and measured traces misalign",
                fix=f"synchronise {node}'s clock (NTP: `timedatectl set-ntp true`, or chrony) and check its "
                    "time zone is not set into the hardware clock"))
    return out


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or predicted is None or predicted <= 0 or measured != measured:
        return None
    return measured / predicted


def _slow_lane(schedule: ScheduleView) -> tuple[str, float] | None:
    """The lane whose measured compute is the most over its planned compute, and by how much (a ratio)."""
    worst: tuple[str, float] | None = None
    for lane in schedule.lanes:
        planned = sum(b.dur_s for b in schedule.bars if b.lane == lane and b.cat == "compute" and
                      b.source == "planned")
        measured = sum(b.dur_s for b in schedule.bars if b.lane == lane and b.cat == "compute" and
                       b.source == "measured")
        r = _ratio(measured, planned)
        if r is not None and (worst is None or r > worst[1]):
            worst = (lane, r)
    return worst


def slow_warnings(jobs: list[JobState], schedules: Mapping[str, ScheduleView]) -> list[HealthWarning]:
    """Running jobs whose measured round is over ``SLOW_RATIO`` times the plan's: naming the slowest lane of the
    measured schedule when there is one."""
    out = []
    for state in jobs:
        if state.status in FINISHED:
            continue
        progress = state.progress
        measured = getattr(progress, "round_s", None)
        predicted = getattr(progress, "predicted_round_s", None)
        history = getattr(progress, "history", None)
        if measured is None and history:
            last = history[-1]
            measured, predicted = getattr(last, "round_s", None), getattr(last, "predicted_s", None)
        ratio = _ratio(measured, predicted)
        lane = None
        schedule = schedules.get(state.job_id)
        if schedule is not None:
            lane = _slow_lane(schedule)
            if lane is not None and lane[1] > SLOW_RATIO and (ratio is None or ratio <= SLOW_RATIO):
                ratio = lane[1]
        if ratio is None or ratio <= SLOW_RATIO:
            continue
        where = f"; the slowest is {lane[0]} ({lane[1]:.1f}x its planned compute)" if lane and lane[1] > 1 else ""
        out.append(HealthWarning(
            check="slow", subject=state.job_id,
            problem=f"its rounds take {ratio:.1f}x what the plan predicted from the profiles{where}",
            fix="check what else runs on that device (and its temperature: a throttled board is slower than "
                "profiled); if it stays slow, clear its profile cache (EDGESWARM_PROFILE_DIR) and submit the job "
                "again so it is re-profiled and re-planned"))
    return out


def memory_warnings(view: ClusterView | None) -> list[HealthWarning]:
    """Online nodes whose reserved or used memory is at ``MEMORY_RATIO`` of their budget or more."""
    out = []
    for node in view.nodes if view is not None else ():
        budget = node.memory_budget_bytes
        if node.state == "offline" or budget <= 0:
            continue
        used = max(0, budget - node.free_memory_bytes)
        for what, value in (("reserved for jobs", node.reserved_memory_bytes), ("in use", used)):
            if value >= MEMORY_RATIO * budget:
                out.append(HealthWarning(
                    check="memory", subject=node.node,
                    problem=f"{value / _MIB:.0f} MiB of its {budget / _MIB:.0f} MiB budget is {what} "
                            f"({value / budget:.0%}): the next stage or request placed there may not fit",
                    fix=f"cancel a job holding {node.node} (`edgeswarm jobs`, `edgeswarm cancel JOB`), raise its "
                        "EDGESWARM_MEMORY_BUDGET_BYTES if the device has the memory, or add a device"))
                break
    return out


def health_warnings(*, view: ClusterView | None, hub_url: str, clock_offsets: Mapping[str, float],
                    jobs: list[JobState], schedules: Mapping[str, ScheduleView]) -> list[HealthWarning]:
    """Every warning, errors first."""
    found = [*data_url_warnings(view), *tls_warnings(view, hub_url), *clock_warnings(clock_offsets),
             *slow_warnings(jobs, schedules), *memory_warnings(view)]
    return sorted(found, key=lambda w: w.severity != "error")
