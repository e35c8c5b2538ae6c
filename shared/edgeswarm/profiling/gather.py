"""Ask every node's profiler for its profile and links, and assemble the ClusterProfile the planner reads.

Two phases:

1. compute: each node profiles the model on itself, with no link traffic to disturb the timings. Nodes
   on different hosts (the ``host`` of their profiler's status) work at the same time; nodes that share
   a host (emulated devices of one machine) take turns, because co-located processes competing for the
   CPU would distort each other's timings. Sharing a host also means sharing its profile cache, so the
   host's native timings are measured once and the later devices only measure their speed ratio.
2. links: every node measures its link to every other node (the compute part is a cache hit now), in
   turns in which each host takes part in one measurement at most (``link_turns``): a node that sends or
   receives another bulk transfer meanwhile, or shares its host's CPU with nodes that do, measures the CPU
   and not the link (three nodes of one 2-core machine measuring at once read a 50 Mbit/s link as 23%
   slower). Nodes of different hosts measure at the same time.

A pair measured in both directions gets the slower bandwidth in both directions, and the smaller of its round
trips and per-message seconds (both directions time the same round trip, a ping one way and its pong back; the
larger one was the more disturbed), so the result is symmetric; a link's per-request seconds stay its source node's own.
A node that does not answer in time, answers with a failure, or profiled a different model makes the whole call
fail with an error naming it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.bus.bus import Expectation
from edgeswarm.errors import ProfilerError, ProfileTimeoutError, UnknownNodeError
from edgeswarm.messages import ProfileFailed, ProfileProgress, ProfileReport, ProfileRequest
from edgeswarm.messages.profiling import ProfileMethod
from edgeswarm.runtime.client import ClusterWatcher, client_bus, online_device_ids, wait_for_service
from edgeswarm.settings import Settings
from edgeswarm.values.profiles import ClusterProfile, LinkProfile, ModelSpec
from edgeswarm.wire.schema import new_id

PROFILER = "profiler"
# progress(node, fraction in [0, 1] of that node's current round, message)
GatherProgress = Callable[[str, float, str], None]


class _ProgressRouter:
    """One subscription to every profiler's progress per bus, dispatched by request id."""

    def __init__(self, bus: Bus) -> None:
        self._listeners: dict[str, GatherProgress] = {}
        self._lock = threading.Lock()
        bus.subscribe(topics.ALL_PROFILE_PROGRESS, self._on_progress, schemas=(ProfileProgress,), qos=0)

    def listen(self, request_id: str, callback: GatherProgress) -> None:
        with self._lock:
            self._listeners[request_id] = callback

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._listeners.pop(request_id, None)

    def _on_progress(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, ProfileProgress)
        with self._lock:
            callback = self._listeners.get(body.request_id)
        if callback is not None:
            callback(body.node, body.fraction, body.message)


_routers: weakref.WeakKeyDictionary[Bus, _ProgressRouter] = weakref.WeakKeyDictionary()
_routers_lock = threading.Lock()


def _router(bus: Bus) -> _ProgressRouter:
    with _routers_lock:
        router = _routers.get(bus)
        if router is None:
            router = _routers[bus] = _ProgressRouter(bus)
        return router


def request_profiles(bus: Bus, requests: dict[str, ProfileRequest], *, timeout_s: float,
                     progress: GatherProgress | None = None) -> dict[str, ProfileReport]:
    """Send ``requests`` (node -> request) to the nodes' profilers at once; their reports by node.

    Raises ProfileTimeoutError naming every node whose profiler did not answer within ``timeout_s``
    seconds (or is not known to be running), ProfilerError naming a node that answered with a failure.
    """
    router = _router(bus) if progress is not None else None
    pending: dict[str, tuple[ProfileRequest, Expectation]] = {}
    try:
        for node, request in requests.items():
            if router is not None and progress is not None:
                router.listen(request.request_id, progress)
            exp = bus.expect()
            pending[node] = (request, exp)
            bus.publish(topics.request(node, PROFILER), request, ttl_s=timeout_s, correlation_id=exp.correlation_id,
                        reply_to=bus.reply_topic)
        deadline = time.monotonic() + timeout_s
        replies: dict[str, Inbound] = {}
        missing: list[str] = []
        for node, (_request, exp) in pending.items():
            reply = exp.wait(max(0.0, deadline - time.monotonic()))
            if reply is None:
                missing.append(node)
            else:
                replies[node] = reply
        if missing:
            raise ProfileTimeoutError(_timeout_message(bus, missing, timeout_s))
        reports: dict[str, ProfileReport] = {}
        for node, reply in replies.items():
            body = reply.body
            if isinstance(body, ProfileFailed):
                raise ProfilerError(f"the profiler on {node} could not profile ({body.reason}): {body.detail}")
            if not isinstance(body, ProfileReport) or body.node != node:
                raise ProfilerError(f"the profiler on {node} answered with {reply.envelope.schema_name} "
                                    f"from {reply.sender}, not a profile report")
            reports[node] = body
        return reports
    finally:
        for request, exp in pending.values():
            exp.wait(0)  # ends the expectation if it was never waited for (an error on the way)
            if router is not None:
                router.forget(request.request_id)


def _timeout_message(bus: Bus, nodes: list[str], timeout_s: float) -> str:
    reasons = []
    for node in nodes:
        status = bus.peers.get(node, PROFILER)
        if status is None:
            reasons.append(f"{node} (no profiler has ever announced itself there)")
        elif status.state != "online":
            reasons.append(f"{node} (its profiler is {status.state}: {status.reason or 'no reason given'})")
        else:
            reasons.append(f"{node} (online but silent)")
    return (f"no profile from {', '.join(reasons)} within {timeout_s:.0f} s; check `edgeswarm status`, or allow "
            f"more time for slow devices or large models")


def gather_cluster_profile(bus: Bus, spec: ModelSpec, nodes: Sequence[str], batch_sizes: Sequence[int], *,
                           method: ProfileMethod = "calibrated", timeout_s: float = 600.0, links: bool = True,
                           link_pairs: Sequence[tuple[str, str]] | None = None,
                           progress: GatherProgress | None = None) -> ClusterProfile:
    """The ClusterProfile of ``spec`` on ``nodes``: every node's timings and memory budget, and (with
    ``links``) the measured link between every pair of them, or only between the (source, destination) pairs of
    ``link_pairs`` (nodes of ``nodes``), measured from the source.

    ``timeout_s`` bounds each turn of the compute phase and the link phase (seconds). Raises
    ProfileTimeoutError naming the nodes that did not answer, ProfilerError for a failed or inconsistent
    node, ValueError for no nodes.
    """
    nodes = list(dict.fromkeys(nodes))
    if not nodes:
        raise ValueError("gather_cluster_profile needs at least one node")
    sizes = list(batch_sizes)

    def request(peers: list[str]) -> ProfileRequest:
        return ProfileRequest(request_id=new_id(), model=spec, batch_sizes=sizes, method=method, peers=peers)

    hosts = node_hosts(bus, nodes)
    turns = compute_turns(hosts)
    offline = [f"{n} ({s.reason or 'no reason given'})" for n in nodes
               for s in [bus.peers.get(n, PROFILER)] if s is not None and s.state != "online"]
    if offline:
        raise ProfilerError(f"the profiler is offline on {', '.join(offline)}; start it or leave the node out")
    reports: dict[str, ProfileReport] = {}
    for turn in turns:
        reports.update(request_profiles(bus, {n: request([]) for n in turn}, timeout_s=timeout_s, progress=progress))
    fingerprints = {r.model.fingerprint for r in reports.values()}
    if len(fingerprints) != 1:
        by_node = ", ".join(f"{n}: {r.model.fingerprint[:12]}" for n, r in reports.items())
        raise ProfilerError(f"the nodes profiled different models ({by_node}); run the same edgeswarm version "
                            "everywhere")
    measured: list[LinkProfile] = []
    if links and len(nodes) > 1:
        for pairs in link_turns(hosts, link_pairs):
            link_reports = request_profiles(bus, {src: request([dst]) for src, dst in pairs}, timeout_s=timeout_s,
                                            progress=progress)
            measured.extend(link for r in link_reports.values() for link in r.links)
    first = reports[nodes[0]]
    return ClusterProfile(model=first.model, devices=[reports[n].entry for n in nodes],
                          links=symmetric_links(measured))


def node_hosts(bus: Bus, nodes: Sequence[str], wait_s: float = 2.0) -> dict[str, str]:
    """Each of ``nodes``' host: the one in its profiler's status (waited for up to ``wait_s`` seconds in all); a
    node whose status is unknown counts as a host of its own."""
    hosts: dict[str, str] = {}
    deadline = time.monotonic() + wait_s
    for node in nodes:
        try:
            hosts[node] = bus.peers.wait_for(node, PROFILER, timeout_s=max(0.0, deadline - time.monotonic())).host
        except UnknownNodeError:
            hosts[node] = f"unknown:{node}"
    return hosts


def compute_turns(hosts: Mapping[str, str]) -> list[list[str]]:
    """The nodes of ``hosts`` (node -> its host) in turns: turn k holds the k-th node of every host, so no two
    nodes of one host share a turn."""
    by_host: dict[str, list[str]] = {}
    for node, host in hosts.items():
        by_host.setdefault(host, []).append(node)
    depth = max((len(group) for group in by_host.values()), default=0)
    return [[group[k] for group in by_host.values() if k < len(group)] for k in range(depth)]


def link_turns(hosts: Mapping[str, str],
               pairs: Sequence[tuple[str, str]] | None = None) -> list[list[tuple[str, str]]]:
    """Every ordered pair (source, destination) of the nodes of ``hosts`` (node -> its host), or ``pairs`` when
    given, in turns in which no host takes part in two measurements: its nodes share its CPU and its network, so a
    second transfer there would be measured along with the link. Nodes of distinct hosts pair up in the same turn;
    nodes of one host measure one link at a time. Pairs are taken in round-robin order (each node's next peer
    along), so the turns stay full."""
    nodes = list(hosts)
    pending = list(pairs) if pairs is not None else [
        (nodes[i], nodes[(i + step) % len(nodes)]) for step in range(1, len(nodes)) for i in range(len(nodes))]
    turns: list[list[tuple[str, str]]] = []
    while pending:
        busy: set[str] = set()
        turn: list[tuple[str, str]] = []
        later: list[tuple[str, str]] = []
        for src, dst in pending:
            if hosts[src] in busy or hosts[dst] in busy:
                later.append((src, dst))
                continue
            busy.update((hosts[src], hosts[dst]))
            turn.append((src, dst))
        turns.append(turn)
        pending = later
    return turns


def symmetric_links(links: Sequence[LinkProfile]) -> list[LinkProfile]:
    """Both directions of every measured pair, each with the pair's slowest bandwidth, smallest round trip,
    per-message and per-hop seconds, and its source's own per-request seconds (the other direction's when only that
    was measured).

    Sorted by (src, dst). Self-links are dropped.
    """
    pairs: dict[tuple[str, str], tuple[float, float, float, float]] = {}
    requests: dict[tuple[str, str], float] = {}  # (src, dst) -> src's own request round trip
    for link in links:
        if link.src == link.dst:
            continue
        key = (min(link.src, link.dst), max(link.src, link.dst))
        # Both directions' round trips and per-message figures time the same round trip (a ping one way, its pong
        # back); whatever else ran meanwhile only adds to one, so the smaller stands for the pair.
        bw, lat, msg, hop = pairs.get(key, (float("inf"), float("inf"), float("inf"), float("inf")))
        pairs[key] = (min(bw, link.bandwidth_bps), min(lat, link.latency_s), min(msg, link.message_s),
                      min(hop, link.hop_s))
        requests[(link.src, link.dst)] = link.request_s
    out = []
    for (a, b), (bw, lat, msg, hop) in pairs.items():
        for src, dst in ((a, b), (b, a)):
            # request_s is the measuring node's own figure; a direction nobody measured takes the other's.
            req = requests.get((src, dst), requests.get((dst, src), 0.0))
            out.append(LinkProfile(src=src, dst=dst, bandwidth_bps=bw, latency_s=lat, message_s=msg, request_s=req,
                                   hop_s=hop))
    return sorted(out, key=lambda link: (link.src, link.dst))


def profile_cluster(bus: Bus, spec: ModelSpec, batch_sizes: Sequence[int], *, method: str = "calibrated",
                    timeout_s: float = 600.0, nodes: Sequence[str] | None = None, links: bool = True,
                    link_pairs: Sequence[tuple[str, str]] | None = None, ready_timeout_s: float = 120.0,
                    progress: GatherProgress | None = None) -> ClusterProfile:
    """``gather_cluster_profile`` over ``bus`` once the profilers of ``nodes`` (default: every online device)
    are online (waiting up to ``ready_timeout_s``). Raises ProfilerError naming the devices whose profiler did
    not come up."""
    watcher = ClusterWatcher(bus)
    view, _ = watcher.wait(settle_s=0.5, devices=len(nodes) if nodes else 1, timeout_s=ready_timeout_s)
    chosen = list(nodes) if nodes else online_device_ids(view)
    missing = wait_for_service(watcher, PROFILER, chosen, ready_timeout_s)
    if missing or not chosen:
        raise ProfilerError(f"no profiler online after {ready_timeout_s:.0f} s on: "
                            f"{', '.join(missing) or 'any device'}")
    return gather_cluster_profile(bus, spec, chosen, batch_sizes, method=method, timeout_s=timeout_s,
                                  links=links, link_pairs=link_pairs, progress=progress)


def profile_at_hub(hub: str, spec: ModelSpec, batch_sizes: Sequence[int], **kwargs: Any) -> ClusterProfile:
    """``profile_cluster`` (same keyword arguments) from a fresh client of the cluster at ``hub``."""
    bus = client_bus(Settings(hub_url=hub))
    try:
        return profile_cluster(bus, spec, batch_sizes, **kwargs)
    finally:
        bus.stop()
