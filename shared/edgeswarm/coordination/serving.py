"""What every serving kind's coordinator program does the same way: refuse a request with a reason the caller can
act on, and release the parts a job deployed."""

from __future__ import annotations

import logging

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import EdgeswarmError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.jobs import JobState
from edgeswarm.messages.serving import InferError, InferErrorReason
from edgeswarm.wire import Message

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)


def refuse_request(bus: Bus, msg: Inbound, job_id: str, request_id: str, reason: InferErrorReason,
                   detail: str) -> None:
    """Answer the request ``msg`` (``request_id`` of job ``job_id``) with InferError ``reason`` and ``detail``,
    counted as ``infer_refused.{reason}`` and logged (rate-limited: callers can send many). Never raises."""
    bus.metrics.count(f"infer_refused.{reason}")
    _limited.warning(reason, "job %s: refused a request from %s (%s): %s", job_id, msg.sender, reason, detail)
    try:
        bus.reply(msg, InferError(job_id=job_id, request_id=request_id, reason=reason, detail=detail[:1024]))
    except EdgeswarmError as exc:
        log.debug("could not answer a refused request: %s", exc)


def refuse_unserved(bus: Bus, msg: Inbound, job_id: str, request_id: str, state: JobState | None) -> None:
    """Answer a request for a job that is not serving: ``unknown_job`` when the coordinator has no state of it
    (``state`` None), else ``not_serving`` with its status."""
    if state is None:
        refuse_request(bus, msg, job_id, request_id, "unknown_job",
                       f"the coordinator has no job {job_id}: see edgeswarm jobs")
    else:
        refuse_request(bus, msg, job_id, request_id, "not_serving", f"job {job_id} is {state.status}, not serving")


def release(bus: Bus, devices: list[str], service: str, message: Message, what: str) -> None:
    """Publish ``message`` (a job's release command, no answer expected) to ``service`` on each of ``devices``;
    ``what`` names the part released, for the log line of a device that could not be told."""
    for device in devices:
        try:
            bus.publish(topics.request(device, service), message)
        except EdgeswarmError as exc:
            log.warning("could not release the %s on %s: %s", what, device, exc)
