"""The profiler's link measurements on kernel-shaped links: a namespace cluster whose cluster file gives every link
50 Mbit/s and 5 ms one way, profiled like any cluster (``gather_cluster_profile``), each measured link within 15
percent of the bandwidth and 2 ms of the latency ``tc`` and the delayer enforce."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry, NetworkDefaults
from edgeswarm.values.profiles import ModelSpec
from helpers import FAST_ENV, netns_unavailable, wait_until

BANDWIDTH_MBPS, LATENCY_MS = 50, 5
TINY_MLP = ModelSpec(name="mlp", config={"hidden": 16, "layers": 1})


@pytest.mark.alone
@pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or "")
def test_profiled_links_match_the_kernel_shaping(tmp_path: Path) -> None:
    from edgeswarm.netns.cluster import NetnsCluster
    from edgeswarm.profiling.gather import gather_cluster_profile
    from edgeswarm.runtime.client import ClusterWatcher, client_bus, nodes_running, settings_from_env

    spec = ClusterSpec(name="shaped", network=NetworkDefaults(bandwidth_mbps=BANDWIDTH_MBPS, latency_ms=LATENCY_MS),
                       devices=tuple(DeviceEntry(id=f"dev-{i}", device_class="native") for i in range(3)))
    nodes = [d.id for d in spec.devices]
    with NetnsCluster(spec, workdir=tmp_path / "cluster", skip_services=("tensor-shard-worker", "stage-worker"),
                      extra_env={**FAST_ENV, "EDGESWARM_PROFILE_DIR": str(tmp_path / "profiles")}) as cluster:
        env = cluster.client_env()
        bus = client_bus(settings_from_env(env))
        try:
            watcher = ClusterWatcher(bus)
            wait_until(lambda: set(nodes) <= set(nodes_running(watcher.view()[0], "profiler")), 120,
                       message="every profiler online")
            profile = gather_cluster_profile(bus, TINY_MLP, nodes, [1], timeout_s=120)
        finally:
            bus.stop()
    links = {(link.src, link.dst): link for link in profile.links}
    assert set(links) == {(a, b) for a in nodes for b in nodes if a != b}
    for link in links.values():
        assert abs(link.bandwidth_bps / (BANDWIDTH_MBPS * 1e6 / 8) - 1) <= 0.15, link
        assert abs(link.message_s - LATENCY_MS / 1000) <= 0.003, link
    # message_s is the profiler's one-way figure: held to the kernel's delay within 2 ms, the median over the links
    # (Python's and the brokers' time is in it too, which another test's cluster on this machine stretches on one
    # link or another). latency_s is the round trip of a 64-byte message through the peer's broker and back: it
    # holds both directions' delay, and on top the processing at two brokers and the peer, which is the machine's
    # load, not the link's, so only the kernel's part is a bound.
    assert abs(statistics.median(link.message_s for link in links.values()) - LATENCY_MS / 1000) <= 0.002, links
    assert all(link.latency_s >= 2 * LATENCY_MS / 1000 * 0.95 for link in links.values()), links
