"""Clusters the benchmarks run on, the kinds' included (``workloads.commands.CommandTools.cluster``): a cluster spec
started on this machine, with a client bus on it once every service it started is online."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from edgeswarm.bus import Bus
from edgeswarm.devices.cluster import ClusterSpec
from edgeswarm.errors import EdgeswarmError
from edgeswarm.local.launcher import HUB_NODE, LocalCluster
from edgeswarm.netns.cluster import NetnsCluster
from edgeswarm.runtime.client import ClusterWatcher, client_bus, settings_from_env, wait_for_service


@contextmanager
def running_cluster(spec: ClusterSpec, *, workdir: Path | None = None, extra_env: Mapping[str, str] | None = None,
                    skip_services: Sequence[str] = (), netns: bool = False, timeout_s: float = 120.0,
                    as_hub: bool = False) -> Iterator[tuple[LocalCluster | NetnsCluster, Bus]]:
    """``spec`` as a local cluster (with ``netns``: every node a namespace with its own broker, the links shaped by
    the kernel) with a client bus on it, once every service it started is online; with ``as_hub`` the bus logs in as
    the hub member rather than the operator. Raises EdgeswarmError when they are not all online within
    ``timeout_s`` seconds."""
    env = dict(extra_env or {})
    skip = tuple(skip_services)
    cluster = (NetnsCluster(spec, workdir=workdir, extra_env=env, skip_services=skip) if netns else
               LocalCluster(spec, workdir=workdir, extra_env=env, skip_services=skip))
    with cluster as running:
        env = running.client_env()
        if as_hub:
            env.update(running.identity_env(HUB_NODE))
        bus = client_bus(settings_from_env(env))
        try:
            watcher = ClusterWatcher(bus)
            started: dict[str, list[str]] = {}
            for child in running.children:
                started.setdefault(child.service, []).append(child.node)
            deadline = time.monotonic() + timeout_s
            missing = [f"{service} on {node}" for service, nodes in started.items()
                       for node in wait_for_service(watcher, service, nodes, max(0.0, deadline - time.monotonic()))]
            if missing:
                raise EdgeswarmError(f"{spec.name}: the cluster did not come up within {timeout_s:.0f} s: "
                                     f"{', '.join(missing)} not online")
            yield running, bus
        finally:
            bus.stop()
