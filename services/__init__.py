"""The services. Each runs as its own process: ``edgeswarm service NAME`` (the entry point of every container)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from edgeswarm.errors import ConfigError

if TYPE_CHECKING:
    from edgeswarm.runtime.service import Service

# Service name -> "module:class", imported only when that service is started.
SERVICES: dict[str, str] = {
    "checkpoint-store": "edgeswarm.services.checkpoint_store.service:CheckpointStoreService",
    "coordinator": "edgeswarm.services.coordinator.service:CoordinatorService",
    "node-agent": "edgeswarm.services.node_agent.service:NodeAgentService",
    "planner": "edgeswarm.services.planner.service:PlannerService",
    "profiler": "edgeswarm.services.profiler.service:ProfilerService",
    "stage-worker": "edgeswarm.services.stage_worker.service:StageWorkerService",
}


def service_class(name: str) -> type[Service]:
    """The Service subclass called ``name``. Raises ConfigError listing the services that exist."""
    try:
        module, cls = SERVICES[name].split(":")
    except KeyError:
        raise ConfigError(f"unknown service {name!r}; available: {', '.join(sorted(SERVICES))}") from None
    return getattr(import_module(module), cls)  # type: ignore[no-any-return]
