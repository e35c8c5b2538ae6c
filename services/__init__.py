"""The services. Each runs as its own process: ``edgeswarm service NAME`` (the entry point of every container).

``SERVICES`` is the one registry of them: a new service is a package here and one entry below. The local launcher
starts each on the nodes of its role, the package is installed by folder (``setup.py``), and the suite checks that
``compose.yaml`` runs exactly these.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Literal

from edgeswarm.errors import ConfigError

if TYPE_CHECKING:
    from edgeswarm.runtime.service import Service


@dataclass(frozen=True)
class ServiceEntry:
    """A service: its ``Service`` subclass as "module:class" (imported only when it is started) and the nodes it
    runs on (``hub``: the hub node only; ``device``: every device)."""

    target: str
    role: Literal["hub", "device"]


SERVICES: dict[str, ServiceEntry] = {
    "coordinator": ServiceEntry("edgeswarm.services.coordinator.service:CoordinatorService", "hub"),
    "planner": ServiceEntry("edgeswarm.services.planner.service:PlannerService", "hub"),
    "checkpoint-store": ServiceEntry("edgeswarm.services.checkpoint_store.service:CheckpointStoreService", "hub"),
    "node-agent": ServiceEntry("edgeswarm.services.node_agent.service:NodeAgentService", "device"),
    "profiler": ServiceEntry("edgeswarm.services.profiler.service:ProfilerService", "device"),
    "stage-worker": ServiceEntry("edgeswarm.services.stage_worker.service:StageWorkerService", "device"),
}


def services_of(role: Literal["hub", "device"]) -> tuple[str, ...]:
    """The names of the services that run on the nodes of ``role``, in registry order."""
    return tuple(name for name, entry in SERVICES.items() if entry.role == role)


def service_class(name: str) -> type[Service]:
    """The Service subclass called ``name``. Raises ConfigError listing the services that exist."""
    try:
        module, cls = SERVICES[name].target.split(":")
    except KeyError:
        raise ConfigError(f"unknown service {name!r}; available: {', '.join(sorted(SERVICES))}") from None
    return getattr(import_module(module), cls)  # type: ignore[no-any-return]
