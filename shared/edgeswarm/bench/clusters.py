"""The local clusters the benchmarks run on: one of Asteroid's environments at 100 Mbps, ready to take jobs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edgeswarm.bus import Bus
from edgeswarm.devices.cluster import load_cluster
from edgeswarm.errors import EdgeswarmError
from edgeswarm.local.launcher import HUB_NODE, HUB_SERVICES, LocalCluster
from edgeswarm.netns.cluster import NetnsCluster
from edgeswarm.runtime.client import ClusterWatcher, client_bus, settings_from_env, wait_for_service
from edgeswarm.service_registry import STAGE_WORKER, TENSOR_SHARD_WORKER


@contextmanager
def asteroid_cluster(env: str, profile_dir: Path, *, netns: bool = False
                     ) -> Iterator[tuple[LocalCluster | NetnsCluster, Bus]]:
    """Asteroid's environment ``env`` (a, b, c or d) at 100 Mbps as a local cluster (with ``netns``: every node a
    namespace with its own broker, the links shaped by the kernel), with a client bus on it, once every device's
    stage-worker and the hub's services are online; profiles are cached in ``profile_dir``. Raises EdgeswarmError
    when the cluster does not come up within two minutes."""
    spec = load_cluster(f"asteroid-env-{env}-100mbps")
    nodes = [d.id for d in spec.devices]
    # Pipelines only: no tensor-shard-worker competes for the host's cores.
    env_vars = {"EDGESWARM_PROFILE_DIR": str(profile_dir)}
    cluster = (NetnsCluster(spec, extra_env=env_vars, skip_services=(TENSOR_SHARD_WORKER,)) if netns else
               LocalCluster(spec, extra_env=env_vars, skip_services=(TENSOR_SHARD_WORKER,)))
    with cluster as local:
        client = local.client_env()
        bus = client_bus(settings_from_env(client))
        try:
            watcher = ClusterWatcher(bus)
            watcher.wait(settle_s=0.5, devices=len(nodes), timeout_s=120)
            missing = [f"{STAGE_WORKER} on {n}" for n in wait_for_service(watcher, STAGE_WORKER, nodes, 120)]
            missing += [f"{s} on {HUB_NODE}" for s in HUB_SERVICES if wait_for_service(watcher, s, [HUB_NODE], 120)]
            if missing:
                raise EdgeswarmError(f"env {env}: the cluster did not come up: {', '.join(missing)} not online")
            yield local, bus
        finally:
            bus.stop()

