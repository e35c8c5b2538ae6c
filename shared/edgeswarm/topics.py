"""The topic tree: one builder per topic, who may write and read each, and the table ``edgeswarm topics`` prints.

Every topic starts with ``edgeswarm/`` so ``mosquitto_sub -v -t 'edgeswarm/#'`` shows all traffic.

Every topic names the node allowed to write it, or is written by one role only, so a broker ACL generated from
this tree (``edgeswarm.security.acl``) lets a node write only what is its own, and every receiver checks that
the envelope's ``sender_node`` is the node the topic names. Topics owned by a node (``status``, ``heartbeat``,
``metrics``, a service's own ``events``, the profiler's reports) carry it at their ``{node}`` level; topics
addressed *to* a service (``request``, ``data``, ``reply``) end with the sender's node: a request from node
``pi-1`` to the planner on ``hub`` goes to ``edgeswarm/node/hub/planner/request/pi-1``. Code names such a topic
by its *address* (without the sender level: ``request(node, service)``); the bus appends its own node when it
publishes and subscribes with ``/+``.

``topic_tree()`` is the whole tree. Who may send requests and tensors to each service is its entry in the service
registry (``edgeswarm.service_registry``, plug-ins' included); the roles are ``edgeswarm.roles``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# The roles are written once, in edgeswarm.roles; they stay importable from here.
from edgeswarm.roles import NODE_ROLES, ROLES, NodeRole, Role  # noqa: F401

ROOT = "edgeswarm"

ADDRESSED_LEAVES = ("request", "data")  # node topics addressed to a service: the sender's node follows
# Node topics written by the node itself.
OWNED_LEAVES = ("status", "heartbeat", "metrics", "progress", "events", "spans")


def status(node: str, service: str) -> str:
    return f"{ROOT}/node/{node}/{service}/status"


def heartbeat(node: str, service: str) -> str:
    return f"{ROOT}/node/{node}/{service}/heartbeat"


def metrics(node: str, service: str) -> str:
    return f"{ROOT}/node/{node}/{service}/metrics"


def spans(node: str, service: str) -> str:
    """Measured spans (``edgeswarm.spans``) a service's worker programs recorded on ``node``."""
    return f"{ROOT}/node/{node}/{service}/spans"


def service_events(node: str, service: str) -> str:
    """ClusterEvents a service reports about its own node (a second live instance with its node id)."""
    return f"{ROOT}/node/{node}/{service}/events"


def request(node: str, service: str) -> str:
    """The address of ``service``'s requests on ``node`` (the bus appends the sender's node)."""
    return f"{ROOT}/node/{node}/{service}/request"


def data(node: str, service: str) -> str:
    """The address of ``service``'s tensors on ``node`` (the bus appends the sender's node)."""
    return f"{ROOT}/node/{node}/{service}/data"


def reply(node: str, service: str, instance: str) -> str:
    """The address of one service instance's replies (the bus appends the replier's node)."""
    return f"{ROOT}/reply/{node}/{service}/{instance}"


def is_address(topic: str) -> bool:
    """Whether ``topic`` is an address (request, data or reply topic without its sender level)."""
    parts = topic.split("/")
    return len(parts) == 5 and parts[0] == ROOT and (
        parts[1] == "reply" or (parts[1] == "node" and parts[4] in ADDRESSED_LEAVES))


def from_sender(address: str, sender_node: str) -> str:
    """The topic a message from ``sender_node`` to ``address`` is published on."""
    return f"{address}/{sender_node}"


def owner_of(topic: str) -> str | None:
    """The node that owns concrete ``topic`` (its status, heartbeat, metrics, profiler progress and profiles: the
    ``{node}`` level), or None for a topic no node owns."""
    parts = topic.split("/")
    if len(parts) < 5 or parts[0] != ROOT or parts[1] != "node":
        return None
    if (len(parts) == 5 and parts[4] in OWNED_LEAVES) or (len(parts) == 6 and parts[3:5] == ["profiler", "profile"]):
        return parts[2]
    return None


def writer_of(topic: str) -> str | None:
    """The node a message on concrete ``topic`` must come from, or None for topics written by a role (cluster
    view and events, job state and events) or not in the tree."""
    parts = topic.split("/")
    if len(parts) == 6 and parts[0] == ROOT and (parts[1] == "reply" or
                                                  (parts[1] == "node" and parts[4] in ADDRESSED_LEAVES)):
        return parts[5]
    return owner_of(topic)


# A node id, service name or instance id (edgeswarm.wire.schema.NAME_PATTERN, not imported: this module stays light).
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def reply_owner(topic: str) -> str | None:
    """The node an address ``edgeswarm/reply/{node}/{service}/{instance}`` belongs to, None for anything else.

    Every level must be a name: a reply_to arrives in a request's envelope, and a level holding a wildcard or a
    control character would make the broker drop the connection that publishes the reply (again after every
    reconnect, as the QoS 1 message is sent again)."""
    parts = topic.split("/")
    if len(parts) == 5 and parts[0] == ROOT and parts[1] == "reply" and all(_NAME.fullmatch(p) for p in parts[2:]):
        return parts[2]
    return None


def profile_progress(node: str) -> str:
    """Progress events of the profiler on ``node`` (not retained)."""
    return f"{ROOT}/node/{node}/profiler/progress"


def profile_report(node: str, model_fingerprint: str) -> str:
    """The retained profile of one model on ``node``. Raises ValueError for a fingerprint that is no topic level."""
    if not model_fingerprint or any(c in model_fingerprint for c in "/+#"):
        raise ValueError(f"model fingerprint {model_fingerprint!r} cannot be a topic level")
    return f"{ROOT}/node/{node}/profiler/profile/{model_fingerprint}"


CLUSTER_VIEW = f"{ROOT}/cluster/view"
CLUSTER_EVENTS = f"{ROOT}/cluster/events"
ALL_SERVICE_EVENTS = service_events("+", "+")
ALL_STATUS = f"{ROOT}/node/+/+/status"
ALL_HEARTBEATS = f"{ROOT}/node/+/+/heartbeat"
ALL_PROFILE_PROGRESS = profile_progress("+")
ALL_PROFILE_REPORTS = f"{ROOT}/node/+/profiler/profile/+"
ALL_SPANS = spans("+", "+")


Binding = Literal["node", "sender", "self", "none"]


class TopicSpec(BaseModel):
    """One entry of the topic tree. ``broker`` says which broker carries it: the hub or the node's own.

    ``writers`` are the roles that may publish on it and ``bound`` which level must be the writer's own node id:
    ``node`` the ``{node}`` level, ``sender`` the ``{sender}`` level, ``self`` both, ``none`` neither (a topic
    of one role). ``readers`` is ``all`` (every member of the cluster) or ``node`` (only the node the topic is
    addressed to). Placeholders are ``{node}``, ``{service}``, ``{sender}``, ``{instance}``, ``{job}`` and
    ``{model_fingerprint}``.
    """

    model_config = ConfigDict(frozen=True)

    pattern: str
    schemas: str
    retained: bool
    qos: int
    broker: Literal["hub", "node data"]
    purpose: str
    writers: tuple[Role, ...]
    bound: Binding
    readers: Literal["all", "node"]

    @property
    def who_writes(self) -> str:
        """The writers in words, for the table."""
        roles = ", ".join(self.writers)
        return {"node": f"{roles}: its own {{node}} only", "sender": f"{roles}: as {{sender}} only",
                "self": "the node itself, to its own services", "none": roles}[self.bound]


def job_state(job_id: str) -> str:
    """Retained: the latest JobState of job ``job_id``."""
    return f"{ROOT}/job/{job_id}/state"


def job_events(job_id: str) -> str:
    """Every JobEvent of job ``job_id``, in order."""
    return f"{ROOT}/job/{job_id}/events"


ALL_JOB_STATES = job_state("+")


def job_of(topic: str) -> str | None:
    """The job id of an ``edgeswarm/job/{job}/...`` topic, else None."""
    parts = topic.split("/")
    return parts[2] if len(parts) == 4 and parts[0] == ROOT and parts[1] == "job" else None


# Who may write to a service that no registry entry lists (one of another cluster's plug-ins, say): the hub only.
DEFAULT_REQUEST_WRITERS: tuple[Role, ...] = ("hub",)
DEFAULT_DATA_WRITERS: tuple[Role, ...] = ("hub",)
_REQUEST_SCHEMAS = "edgeswarm.probe v1 and the service's requests"
_SENDER = "{sender}"


def _request_spec(service: str, writers: tuple[Role, ...], purpose: str) -> TopicSpec:
    return TopicSpec(pattern=from_sender(request("{node}", service), _SENDER), schemas=_REQUEST_SCHEMAS,
                     retained=False, qos=1, broker="hub", purpose=purpose, writers=writers, bound="sender",
                     readers="node")


def _data_spec(service: str, writers: tuple[Role, ...], purpose: str) -> TopicSpec:
    return TopicSpec(pattern=from_sender(data("{node}", service), _SENDER),
                     schemas="tensor-carrying schemas (edgeswarm.stage.tensor v1, edgeswarm.checkpoint.tensor v1, ...)",
                     retained=False, qos=1, broker="node data", purpose=purpose, writers=writers, bound="sender",
                     readers="node")


def service_topics(service: str) -> tuple[TopicSpec, TopicSpec]:
    """The request and data topics of ``service`` (a name in ``edgeswarm.service_registry``) with their writers as
    its registry entry says, whether they are the defaults or its own."""
    from edgeswarm.service_registry import service_entry

    entry = service_entry(service)
    return (_request_spec(service, entry.request_writers, f"requests to the {service}"),
            _data_spec(service, entry.data_writers, entry.data_purpose or f"tensors for the {service}"))


def _node_roles(service: str) -> tuple[Role, ...]:
    """The roles whose nodes may run ``service``: its own, and the hub's, which may run any service beside its own
    (a hub that also computes)."""
    from edgeswarm.service_registry import service_entry

    roles = service_entry(service).roles
    return tuple(r for r in NODE_ROLES if r == "hub" or r in roles)


@lru_cache(maxsize=1)
def topic_tree() -> tuple[TopicSpec, ...]:
    """Every topic of the cluster, the request and data topics of each service written as its registry entry says
    (``edgeswarm.service_registry``, plug-ins' included). Built once per process."""
    from edgeswarm.service_registry import services

    registry = services()
    profilers = _node_roles("profiler")
    return (
        TopicSpec(pattern=status("{node}", "{service}"), schemas="edgeswarm.status v1", retained=True, qos=1,
                  broker="hub", purpose="online/offline, version, data-plane URL, memory; the Last Will sets offline",
                  writers=ROLES, bound="node", readers="all"),
        TopicSpec(pattern=heartbeat("{node}", "{service}"), schemas="edgeswarm.heartbeat v1", retained=True, qos=0,
                  broker="hub", purpose="periodic liveness; MQTT 5 message expiry of timeout-factor x interval",
                  writers=ROLES, bound="node", readers="all"),
        TopicSpec(pattern=metrics("{node}", "{service}"), schemas="edgeswarm.metrics v1", retained=False, qos=0,
                  broker="hub", purpose="counters (messages, rejections by reason, errors, bytes) and gauges",
                  writers=ROLES, bound="node", readers="all"),
        TopicSpec(pattern=spans("{node}", "{service}"), schemas="edgeswarm.spans v1", retained=False, qos=1,
                  broker="hub", purpose="measured spans of a worker's jobs (forward, backward, transfers, collective "
                  "steps, waits), one batch per job about every 0.5 s", writers=NODE_ROLES, bound="node",
                  readers="all"),
        _request_spec("{service}", DEFAULT_REQUEST_WRITERS,
                      "requests to one service; replies go to reply_to (services not listed below: the hub only)"),
        *(service_topics(name)[0] for name, entry in registry.items()
          if entry.request_writers != DEFAULT_REQUEST_WRITERS),
        TopicSpec(pattern=from_sender(request("{node}", "{service}"), "{node}"), schemas=_REQUEST_SCHEMAS,
                  retained=False, qos=1, broker="hub", purpose="a node's services addressing each other (a starting "
                  "service probes its own node id for a live twin)", writers=ROLES, bound="self", readers="node"),
        TopicSpec(pattern=from_sender(reply("{node}", "{service}", "{instance}"), _SENDER),
                  schemas="any reply schema", retained=False, qos=1, broker="hub",
                  purpose="replies to the requests of one service instance", writers=ROLES, bound="sender",
                  readers="node"),
        _data_spec("{service}", DEFAULT_DATA_WRITERS, "tensors for the service, chunked; published to the node's "
                   "advertised data_url (services not listed below: from the hub only)"),
        *(service_topics(name)[1] for name, entry in registry.items() if entry.data_writers != DEFAULT_DATA_WRITERS),
        TopicSpec(pattern=profile_progress("{node}"), schemas="edgeswarm.profile.progress v1", retained=False, qos=0,
                  broker="hub", purpose="how far the node's profiler is with a request: fraction done and what it "
                  "does", writers=profilers, bound="node", readers="all"),
        TopicSpec(pattern=profile_report("{node}", "{model_fingerprint}"), schemas="edgeswarm.profile.report v1",
                  retained=True, qos=1, broker="hub",
                  purpose="the node's latest profile of one model: layer sequence, timings, memory budget, links",
                  writers=profilers, bound="node", readers="all"),
        TopicSpec(pattern=CLUSTER_VIEW, schemas="edgeswarm.cluster_view v1", retained=True, qos=1, broker="hub",
                  purpose="the coordinator's membership view: nodes, services, states, heartbeat ages",
                  writers=("hub",), bound="none", readers="all"),
        # The coordinator's view of membership changes: about any node, so the hub's alone (a member that could
        # write it could report any other node offline or duplicated).
        TopicSpec(pattern=CLUSTER_EVENTS, schemas="edgeswarm.cluster_event v1", retained=False, qos=1, broker="hub",
                  purpose="the coordinator's membership changes: online, suspect, offline, duplicate node id",
                  writers=("hub",), bound="none", readers="all"),
        # What a service sees of its own node: a second live instance with its node id (runtime.service).
        TopicSpec(pattern=service_events("{node}", "{service}"), schemas="edgeswarm.cluster_event v1",
                  retained=False, qos=1, broker="hub",
                  purpose="a service's report about its own node: another live instance claims its node id",
                  writers=NODE_ROLES, bound="node", readers="all"),
        TopicSpec(pattern=job_state("{job}"), schemas="edgeswarm.job.state v1", retained=True, qos=1, broker="hub",
                  purpose="a job's latest state: kind, status, plan, and its kind's progress (rounds and loss; "
                          "requests answered, throughput, latency)",
                  writers=("hub",), bound="none", readers="all"),
        TopicSpec(pattern=job_events("{job}"), schemas="edgeswarm.job.event v1", retained=False, qos=1, broker="hub",
                  purpose="a job's events: submitted, planned, each round and checkpoint, device lost, how it ended",
                  writers=("hub",), bound="none", readers="all"),
    )


def __getattr__(name: str) -> Any:
    # TOPIC_TREE, as it was read before the tree came from the service registry: built when first asked for.
    if name == "TOPIC_TREE":
        return topic_tree()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
