"""The services, one entry each: how a service starts, which nodes run it, and who may write to it.

A ``ServiceEntry`` is everything edgeswarm needs to know about a service beside its code:

* ``target``: its ``runtime.service.Service`` subclass as ``"module:Class"``, imported only when it is started;
* ``roles``: the nodes that run it (``hub``, ``device``, ``edge``: ``edgeswarm.roles``). The local launcher starts
  it on every node of those roles, and compose runs it in the profile of each (``tests/test_deploy.py`` checks);
* ``request_writers``: the roles that may send it requests (default: the hub only; a node's own services may always
  address each other);
* ``data_writers``: the roles that may send it tensors on its data-plane topic (default: every role; the topic's
  sender level still names who sent them);
* ``data_purpose``: one line on what its tensors are, for ``edgeswarm topics``.

The topic tree (``edgeswarm.topics.topic_tree``), and so ``edgeswarm topics`` and the brokers' ACL
(``edgeswarm.security.acl``), is built from the writers here.

The registry is the built-in entries below plus the entries other installed packages declare under the
``edgeswarm.services`` entry-point group (``edgeswarm.plugins``; ``docs/adding-a-service.md``): name = the service,
value = ``"module:attr"`` of its ``ServiceEntry``. A plug-in cannot take a built-in's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from edgeswarm.errors import ConfigError
from edgeswarm.plugins import SERVICE_GROUP, discovered, load_target
from edgeswarm.roles import NODE_ROLES, ROLES, NodeRole, Role

if TYPE_CHECKING:
    from edgeswarm.runtime.service import Service

# The worker service that hosts pipeline stages (training's and pipelined serving's): its one spelling, read by
# its registration below, by the workloads it hosts and by their coordinator programs that address it.
STAGE_WORKER = "stage-worker"
# The worker service that hosts tensor-parallel shards (Galaxy's serve-hmp): every device holds a share of every layer.
TENSOR_SHARD_WORKER = "tensor-shard-worker"
# The worker service of an edge server (an MEC): split learning's server halves (SmartSplit's train-splitfed).
MEC_MANAGER = "mec-manager"


@dataclass(frozen=True)
class ServiceEntry:
    """One service (see the module docstring). Raises ConfigError when made with a role that does not exist or
    without a ``"module:Class"`` target, so a plug-in's mistake is reported where it is made."""

    target: str
    roles: tuple[NodeRole, ...]
    request_writers: tuple[Role, ...] = ("hub",)
    data_writers: tuple[Role, ...] = ROLES
    data_purpose: str = ""

    def __post_init__(self) -> None:
        module, _, attr = self.target.partition(":")
        if not module or not attr:
            raise ConfigError(f"a service's target is 'module:Class', not {self.target!r}")
        if not isinstance(self.roles, tuple) or not self.roles or not set(self.roles) <= set(NODE_ROLES):
            raise ConfigError(f"a service runs on a non-empty tuple of the node roles {', '.join(NODE_ROLES)}, "
                              f"not {self.roles!r}")
        for what, writers in (("request_writers", self.request_writers), ("data_writers", self.data_writers)):
            if not isinstance(writers, tuple) or not set(writers) <= set(ROLES):
                raise ConfigError(f"a service's {what} are a tuple of the roles {', '.join(ROLES)}, not {writers!r}")

    def runs_on(self, role: str) -> bool:
        """Whether nodes of ``role`` run this service."""
        return role in self.roles


_TARGET = "edgeswarm.services.{}.service:{}"

BUILT_IN: dict[str, ServiceEntry] = {
    # Command lines submit, cancel and plan jobs; every role sends tensors: serving jobs' inference requests
    # (callers) and pipeline outputs (the devices' last stages).
    "coordinator": ServiceEntry(_TARGET.format("coordinator", "CoordinatorService"), ("hub",),
                                request_writers=("hub", "client"), data_writers=ROLES,
                                data_purpose="tensors for the coordinator: serving jobs' inference requests "
                                             "(callers) and pipeline outputs (last stages)"),
    "planner": ServiceEntry(_TARGET.format("planner", "PlannerService"), ("hub",),
                            request_writers=("hub", "client"), data_writers=("hub",)),
    # Every node saves and loads state (stages on devices, the server halves an edge server holds).
    "checkpoint-store": ServiceEntry(_TARGET.format("checkpoint_store", "CheckpointStoreService"), ("hub",),
                                     request_writers=("hub", "device", "edge", "client")),
    # The cluster on one live page, the hub's Prometheus metrics and the jobs' measured traces (edgeswarm.dashboard);
    # command lines ask it for a job's trace.
    "dashboard": ServiceEntry(_TARGET.format("dashboard", "DashboardService"), ("hub",),
                              request_writers=("hub", "client"), data_writers=("hub",)),
    # An OpenAI-compatible API over the serve-hmp jobs (edgeswarm.gateway): it asks the coordinator as a caller does,
    # and no one sends it requests or tensors but its own hub.
    "gateway": ServiceEntry(_TARGET.format("gateway", "GatewayService"), ("hub",), data_writers=("hub",)),
    # Every node is a node: it advertises itself and is profiled (its compute and its links to the others).
    "node-agent": ServiceEntry(_TARGET.format("node_agent", "NodeAgentService"), ("device", "edge"),
                               request_writers=("hub", "client")),
    "profiler": ServiceEntry(_TARGET.format("profiler", "ProfilerService"), ("device", "edge"),
                             request_writers=("hub", "client"), data_writers=("hub", "device", "edge")),
    # Only the coordinator deploys stages; tensors come from the stages' peers, and from the MECs that train split
    # learning's server halves (the activations and gradients back to a device's half, its round's weights).
    STAGE_WORKER: ServiceEntry(_TARGET.format("stage_worker", "StageWorkerService"), ("device",),
                                 data_writers=("hub", "device", "edge"),
                                 data_purpose="tensors for the stage-worker: activations and gradients from the "
                                              "stages' peers, split learning's from the device's MEC"),
    # Only the coordinator deploys shards; tensors come from the coordinator (tokens) and the ring's other devices.
    TENSOR_SHARD_WORKER: ServiceEntry(_TARGET.format("tensor_shard_worker", "TensorShardWorkerService"), ("device",),
                                      data_writers=("hub", "device"),
                                      data_purpose="tensors for the tensor-shard-worker: a request's tokens (the "
                                                   "coordinator) and the ring's collective slices (its devices)"),
    # An edge server trains split learning's server halves: the coordinator sends it each round (with the global
    # weights), its devices their halves' activations, gradients and round-end weights.
    MEC_MANAGER: ServiceEntry(_TARGET.format("mec_manager", "MecManagerService"), ("edge",),
                              data_writers=("hub", "device"),
                              data_purpose="tensors for the mec-manager: a round's global weights (the coordinator), "
                                           "its devices' activations, tail gradients and round-end weights"),
}


def _plugin_entry(name: str, target: str) -> ServiceEntry:
    """The entry plug-in service ``name``'s entry point ``target`` names. Raises ConfigError when it takes a built-in's
    name or leads to no ``ServiceEntry``."""
    if name in BUILT_IN:
        raise ConfigError(f"the installed plug-in service {name!r} ({target}) takes the name of a built-in "
                          "service; rename it in its package's edgeswarm.services entry points")
    entry = load_target(target, f"service {name!r}")
    if not isinstance(entry, ServiceEntry):
        raise ConfigError(f"service {name!r} comes from {target!r}, which is a {type(entry).__name__}, "
                          "not an edgeswarm.service_registry.ServiceEntry")
    return entry


@lru_cache(maxsize=1)
def services() -> dict[str, ServiceEntry]:
    """Every service: the built-ins, in their order, then the plug-ins', in name order. Read once per process.

    Raises ConfigError when a plug-in reuses a built-in's name or its entry point leads to no ``ServiceEntry``."""
    return {**BUILT_IN, **{name: _plugin_entry(name, target) for name, target in discovered(SERVICE_GROUP).items()}}


def service_names() -> tuple[str, ...]:
    """The names of every service, as ``services()`` orders them, read from the metadata alone: nothing of a plug-in
    is imported (for a command line's help)."""
    return (*BUILT_IN, *(name for name in discovered(SERVICE_GROUP) if name not in BUILT_IN))


def service_entry(name: str) -> ServiceEntry:
    """The entry of service ``name``; of the plug-ins, only its own is imported, so a broken plug-in does not stop
    another service. Raises ConfigError listing the services that exist."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    found = discovered(SERVICE_GROUP)
    if name in found:
        return _plugin_entry(name, found[name])
    raise ConfigError(f"unknown service {name!r}; available: {', '.join(sorted(service_names()))}")


def services_of(role: str) -> tuple[str, ...]:
    """The names of the services that run on the nodes of ``role``, in registry order (none for ``client``)."""
    return tuple(name for name, entry in services().items() if entry.runs_on(role))


def service_class(name: str) -> type[Service]:
    """The Service subclass called ``name``. Raises ConfigError listing the services that exist, or naming the
    target that cannot be imported."""
    return load_target(service_entry(name).target, f"service {name!r}")  # type: ignore[no-any-return]
