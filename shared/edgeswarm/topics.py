"""The topic tree: one builder per topic, and the table ``edgeswarm topics`` prints.

Every topic starts with ``edgeswarm/`` so ``mosquitto_sub -v -t 'edgeswarm/#'`` shows all traffic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

ROOT = "edgeswarm"


def status(node: str, service: str) -> str:
    return f"{ROOT}/node/{node}/{service}/status"


def heartbeat(node: str, service: str) -> str:
    return f"{ROOT}/node/{node}/{service}/heartbeat"


def metrics(node: str, service: str) -> str:
    return f"{ROOT}/node/{node}/{service}/metrics"


def request(node: str, service: str) -> str:
    return f"{ROOT}/node/{node}/{service}/request"


def data(node: str, service: str) -> str:
    return f"{ROOT}/node/{node}/{service}/data"


def reply(node: str, service: str, instance: str) -> str:
    return f"{ROOT}/reply/{node}/{service}/{instance}"


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
ALL_STATUS = f"{ROOT}/node/+/+/status"
ALL_HEARTBEATS = f"{ROOT}/node/+/+/heartbeat"
ALL_PROFILE_PROGRESS = profile_progress("+")


def parse_node_topic(topic: str) -> tuple[str, str, str] | None:
    """(node, service, leaf) of an ``edgeswarm/node/{node}/{service}/{leaf}`` topic, else None."""
    parts = topic.split("/")
    if len(parts) == 5 and parts[0] == ROOT and parts[1] == "node":
        return parts[2], parts[3], parts[4]
    return None


class TopicSpec(BaseModel):
    """One entry of the topic tree. ``broker`` says which broker carries it: the hub or the node's own."""

    model_config = ConfigDict(frozen=True)

    pattern: str
    schemas: str
    retained: bool
    qos: int
    broker: Literal["hub", "node data"]
    purpose: str


def job_state(job_id: str) -> str:
    """Retained: the latest JobState of job ``job_id``."""
    return f"{ROOT}/job/{job_id}/state"


def job_events(job_id: str) -> str:
    """Every JobEvent of job ``job_id``, in order."""
    return f"{ROOT}/job/{job_id}/events"


ALL_JOB_STATES = job_state("+")


TOPIC_TREE: tuple[TopicSpec, ...] = (
    TopicSpec(pattern=status("{node}", "{service}"), schemas="edgeswarm.status v1", retained=True, qos=1,
              broker="hub", purpose="online/offline, version, data-plane URL, memory; the Last Will sets offline"),
    TopicSpec(pattern=heartbeat("{node}", "{service}"), schemas="edgeswarm.heartbeat v1", retained=True, qos=0,
              broker="hub", purpose="periodic liveness; MQTT 5 message expiry of timeout-factor x interval"),
    TopicSpec(pattern=metrics("{node}", "{service}"), schemas="edgeswarm.metrics v1", retained=False, qos=0,
              broker="hub", purpose="counters (messages, rejections by reason, errors, bytes) and gauges"),
    TopicSpec(pattern=request("{node}", "{service}"),
              schemas="edgeswarm.probe v1, edgeswarm.bench.* v1, edgeswarm.profile.request v1, ...", retained=False,
              qos=1, broker="hub", purpose="requests to one service; replies go to reply_to"),
    TopicSpec(pattern=reply("{node}", "{service}", "{instance}"), schemas="any reply schema", retained=False,
              qos=1, broker="hub", purpose="replies to the requests of one service instance"),
    TopicSpec(pattern=data("{node}", "{service}"),
              schemas="tensor-carrying schemas (edgeswarm.bench.data v1, edgeswarm.profile.link_probe v1, ...)",
              retained=False, qos=1, broker="node data",
              purpose="tensors for the service, chunked; published to the node's advertised data_url"),
    TopicSpec(pattern=profile_progress("{node}"), schemas="edgeswarm.profile.progress v1", retained=False, qos=0,
              broker="hub", purpose="how far the node's profiler is with a request: fraction done and what it does"),
    TopicSpec(pattern=profile_report("{node}", "{model_fingerprint}"), schemas="edgeswarm.profile.report v1",
              retained=True, qos=1, broker="hub",
              purpose="the node's latest profile of one model: layer sequence, timings, memory budget, links"),
    TopicSpec(pattern=CLUSTER_VIEW, schemas="edgeswarm.cluster_view v1", retained=True, qos=1, broker="hub",
              purpose="the coordinator's membership view: nodes, services, states, heartbeat ages"),
    TopicSpec(pattern=CLUSTER_EVENTS, schemas="edgeswarm.cluster_event v1", retained=False, qos=1, broker="hub",
              purpose="membership changes: online, suspect, offline, duplicate node id"),
    TopicSpec(pattern=job_state("{job}"), schemas="edgeswarm.job.state v1", retained=True, qos=1, broker="hub",
              purpose="a training job's latest state: status, rounds done, loss, measured and predicted round time"),
    TopicSpec(pattern=job_events("{job}"), schemas="edgeswarm.job.event v1", retained=False, qos=1, broker="hub",
              purpose="a training job's events: submitted, planned, each round and checkpoint, how it ended"),
)


