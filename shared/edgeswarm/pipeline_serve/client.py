"""A caller's side of a serving job: send inputs, get outputs, with a bounded number of requests in flight.

Any MQTT client can do the same from the wire format alone: an ``edgeswarm.infer.request`` tensor on the
coordinator's data topic with ``reply_to`` and a correlation id, answered on that reply topic.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgeswarm.bus import Bus, Expectation
from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages.liveness import RequestRejected
from edgeswarm.messages.serving import InferError, InferReply, InferRequest
from edgeswarm.stats import percentile
from edgeswarm.wire.schema import new_id

if TYPE_CHECKING:
    import torch

COORDINATOR_NODE = "hub"
BUSY_PAUSE_S = 0.05  # how long a caller whose request was answered ``busy`` waits before sending it again
MAX_BUSY_RETRIES = 200


class InferRefusedError(EdgeswarmError):
    """The serving job answered a request with an error (its reason and detail), or not at all."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class InferResult:
    """One request's answer: ``outputs`` (a torch tensor, [rows, ...]), the caller's round trip ``latency_s`` and
    the coordinator's ``server_latency_s`` (seconds), the plan ``epoch`` that computed it, and whether it was
    ``replayed`` after a device was lost. ``error`` is set instead of ``outputs`` for a refused request."""

    index: int
    request_id: str
    latency_s: float
    outputs: torch.Tensor | None = None
    server_latency_s: float = 0.0
    epoch: int = 0
    replayed: bool = False
    error: str | None = None
    reason: str | None = None


@dataclass
class StreamReport:
    """Every answer of a stream (by input index), the wall time of the whole stream in seconds, and how often a
    full queue made the caller send again (``busy_retries``)."""

    results: list[InferResult] = field(default_factory=list)
    wall_s: float = 0.0
    busy_retries: int = 0

    @property
    def answered(self) -> list[InferResult]:
        return [r for r in self.results if r.outputs is not None]

    @property
    def samples(self) -> int:
        return sum(int(r.outputs.shape[0]) for r in self.answered if r.outputs is not None)

    def latency_s(self) -> tuple[float, float] | None:
        """The answered requests' round trips in seconds: the median and the 99th percentile (nearest rank); None
        when none was answered."""
        latencies = sorted(r.latency_s for r in self.answered)
        p99 = percentile(latencies, 0.99)
        return None if p99 is None else (statistics.median(latencies), p99)


@dataclass
class _Pending:
    index: int
    inputs: torch.Tensor
    request_id: str
    expectation: Expectation
    sent_at: float
    busy: int = 0


def _send(bus: Bus, job_id: str, index: int, inputs: torch.Tensor, coordinator: str, busy: int = 0) -> _Pending:
    request_id = new_id()
    expectation = bus.expect()
    bus.send_tensor(coordinator, "coordinator", InferRequest(job_id=job_id, request_id=request_id), inputs,
                    expectation=expectation)
    return _Pending(index, inputs, request_id, expectation, time.monotonic(), busy)


def infer_stream(bus: Bus, job_id: str, inputs: Iterable[torch.Tensor], *, window: int = 8,
                 timeout_s: float = 60.0, coordinator: str = COORDINATOR_NODE,
                 on_result: Callable[[InferResult], None] | None = None) -> StreamReport:
    """Send every tensor of ``inputs`` ([rows, *sample shape] each) to serving job ``job_id`` with at most
    ``window`` unanswered at once, and collect the answers. A request answered ``busy`` is sent again after a short
    pause; any other refusal, and a request not answered within ``timeout_s`` seconds, is recorded as an error
    result. Results are in input order."""
    report = StreamReport()
    results: dict[int, InferResult] = {}
    pending: deque[_Pending] = deque()
    source = iter(enumerate(inputs))
    started = time.monotonic()
    exhausted = False
    while pending or not exhausted:
        while not exhausted and len(pending) < window:
            nxt = next(source, None)
            if nxt is None:
                exhausted = True
                break
            pending.append(_send(bus, job_id, nxt[0], nxt[1], coordinator))
        if not pending:
            break
        head = pending.popleft()
        left = max(0.0, timeout_s - (time.monotonic() - head.sent_at))
        reply = head.expectation.wait(left)
        latency = time.monotonic() - head.sent_at
        body = reply.body if reply is not None else None
        if isinstance(body, InferError) and body.reason == "busy" and head.busy < MAX_BUSY_RETRIES:
            report.busy_retries += 1
            time.sleep(BUSY_PAUSE_S)
            pending.appendleft(_send(bus, job_id, head.index, head.inputs, coordinator, head.busy + 1))
            continue
        if isinstance(body, InferReply) and reply is not None and reply.tensor is not None:
            result = InferResult(head.index, head.request_id, latency, reply.tensor.to_torch(), body.latency_s,
                                 body.epoch, body.replayed)
        elif isinstance(body, InferError):
            result = InferResult(head.index, head.request_id, latency, error=body.detail, reason=body.reason)
        elif isinstance(body, RequestRejected):
            result = InferResult(head.index, head.request_id, latency, error=body.detail, reason=body.reason)
        else:
            result = InferResult(head.index, head.request_id, latency, reason="timeout",
                                 error=f"no answer from job {job_id} within {timeout_s:.0f} s")
        results[head.index] = result
        if on_result is not None:
            on_result(result)
    report.wall_s = time.monotonic() - started
    report.results = [results[k] for k in sorted(results)]
    return report


def infer(bus: Bus, job_id: str, inputs: torch.Tensor, *, timeout_s: float = 60.0,
          coordinator: str = COORDINATOR_NODE) -> InferResult:
    """The outputs of serving job ``job_id`` for ``inputs`` ([rows, *sample shape]). Raises InferRefusedError with
    the job's reason when it refuses the request or does not answer within ``timeout_s`` seconds."""
    result = infer_stream(bus, job_id, [inputs], window=1, timeout_s=timeout_s, coordinator=coordinator).results[0]
    if result.outputs is None:
        raise InferRefusedError(f"job {job_id} refused the request ({result.reason}): {result.error}",
                                result.reason or "failed")
    return result
