"""The profiler: one per device. It profiles models on this device and measures its links, on request.

A ProfileRequest on ``edgeswarm/node/{node}/profiler/request`` is queued (at most ``MAX_QUEUED``;
beyond that it is answered ``busy``) and served in order by one profiling thread, so the request
topic, and with it probes, stays responsive while a profile runs. While it works the service
publishes ProfileProgress on ``edgeswarm/node/{node}/profiler/progress``; when done it publishes the
ProfileReport retained on ``edgeswarm/node/{node}/profiler/profile/{model_fingerprint}`` and replies
with it. A request it cannot serve gets a ProfileFailed reply; the service goes on.

It also answers other profilers' link probes on its data topic (edgeswarm.profiling.links). Units are timed on
the device's compute device (EDGESWARM_COMPUTE, resolved at start: a device it cannot use stops the service
there), and on CUDA the memory budget it reports is the accelerator's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.errors import EdgeswarmError, LinkMeasurementError, ProfileRequestError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages import ProfileFailed, ProfileProgress, ProfileReport, ProfileRequest
from edgeswarm.messages.profiling import ProfileFailureReason
from edgeswarm.profiling.cache import ProfileCache
from edgeswarm.profiling.device import run_device_profile
from edgeswarm.profiling.links import LinkProber
from edgeswarm.queue_worker import QueueWorker
from edgeswarm.runtime.service import Service
from edgeswarm.values.profiles import DeviceProfileEntry
from edgeswarm.wire import Message

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log, what="refusals")

MAX_QUEUED = 8
PROGRESS_INTERVAL_S = 0.25  # at most this often per request, plus the first and the last event


class _Cancelled(Exception):
    """Raised through the profiling core when the service stops."""


@dataclass(frozen=True)
class _Job:
    msg: Inbound
    request: ProfileRequest


class ProfilerService(Service):
    name = "profiler"
    computes = True

    def setup(self) -> None:
        self.cache = ProfileCache(self.settings.profile_dir)
        self.links = LinkProber(self.bus)
        self.links.attach()
        self._jobs: QueueWorker[_Job] = QueueWorker("profiler-worker", MAX_QUEUED, self._serve, self.metrics)
        self.bus.subscribe(topics.request(self.node, self.name), self._on_request, schemas=(ProfileRequest,))
        log.info("profile cache in %s", self.cache.directory)

    def teardown(self) -> None:
        self._jobs.stop()

    # --- requests -----------------------------------------------------------------------------------

    def _on_request(self, msg: Inbound) -> None:
        request = msg.body
        assert isinstance(request, ProfileRequest)
        if not self._jobs.offer(_Job(msg, request)):
            self.metrics.count("profile_requests_refused")
            _limited.warning("busy", "refusing profile request %s from %s: %d requests already queued",
                             request.request_id, msg.sender, MAX_QUEUED)
            self._answer(msg, ProfileFailed(request_id=request.request_id, node=self.node, reason="busy",
                                            detail=f"{MAX_QUEUED} profile requests are already queued on "
                                                   f"{self.node}; try again later"))
            return
        log.info("queued profile request %s from %s: %s at batch sizes %s (%s), links to %s", request.request_id,
                 msg.sender, request.model.name, request.batch_sizes, request.method, request.peers or "none")

    def _serve(self, job: _Job) -> None:
        request, msg = job.request, job.msg
        expires_at = msg.envelope.expires_at
        if expires_at is not None and time.time() > expires_at:
            self.metrics.count("expired")
            log.warning("dropping profile request %s from %s: it expired while queued", request.request_id,
                        msg.sender)
            return
        start = time.monotonic()
        progress = _ProgressPublisher(self, request.request_id)
        try:
            result = run_device_profile(request.model, self.device, request.batch_sizes, cache=self.cache,
                                        method=request.method, node=self.node, compute=self.compute,
                                        progress=lambda f, m: progress(0.9 * f if request.peers else f, m))
            links = []
            peers = [p for p in dict.fromkeys(request.peers) if p != self.node]
            for i, peer in enumerate(peers):
                progress(0.9 + 0.1 * i / len(peers), f"measuring the link to {peer}")
                links.append(self.links.measure(peer, timeout_s=max(10.0, self.settings.request_timeout_s)))
            progress(1.0, "done", force=True)
        except _Cancelled:
            log.info("profile request %s abandoned: the service is stopping", request.request_id)
            return
        except ProfileRequestError as exc:
            self._fail(msg, request, "bad_request", str(exc))
            return
        except LinkMeasurementError as exc:
            self._fail(msg, request, "link", str(exc))
            return
        except Exception as exc:  # a model that fails to run, out of memory, ...: answer, log, go on
            log.exception("profile request %s failed", request.request_id)
            self._fail(msg, request, "error", f"{type(exc).__name__}: {exc}")
            return
        report = ProfileReport(
            request_id=request.request_id, node=self.node,
            entry=DeviceProfileEntry(device=result.device, compute=result.compute), model=result.model,
            links=links, cache_hit=result.cache_hit, elapsed_s=time.monotonic() - start)
        try:
            self.bus.publish(topics.profile_report(self.node, result.model.fingerprint), report, retain=True)
        except EdgeswarmError as exc:
            log.warning("could not publish the retained report of request %s: %s", request.request_id, exc)
        self._answer(msg, report)
        self.metrics.count("profiles_served")
        log.info("profile request %s done in %.1f s (%s%s, %d link(s))", request.request_id, report.elapsed_s,
                 request.method, ", cached" if result.cache_hit else "", len(links))

    def _fail(self, msg: Inbound, request: ProfileRequest, reason: ProfileFailureReason, detail: str) -> None:
        self.metrics.count(f"profile_failures.{reason}")
        log.warning("profile request %s from %s failed (%s): %s", request.request_id, msg.sender, reason, detail)
        self._answer(msg, ProfileFailed(request_id=request.request_id, node=self.node, reason=reason,
                                        detail=detail[:4096]))

    def _answer(self, msg: Inbound, answer: Message) -> None:
        try:
            self.bus.reply(msg, answer)
        except EdgeswarmError as exc:
            log.warning("could not answer %s: %s", msg.sender, exc)


class _ProgressPublisher:
    """Publishes ProfileProgress for one request, at most every PROGRESS_INTERVAL_S; raises _Cancelled
    once the service is stopping, which aborts the profiling core."""

    def __init__(self, service: ProfilerService, request_id: str) -> None:
        self._service = service
        self._request_id = request_id
        self._last = 0.0

    def __call__(self, fraction: float, message: str, *, force: bool = False) -> None:
        service = self._service
        if service.stopping:
            raise _Cancelled
        now = time.monotonic()
        if not force and self._last and now - self._last < PROGRESS_INTERVAL_S:
            return
        self._last = now
        event = ProfileProgress(request_id=self._request_id, node=service.node,
                                fraction=min(1.0, max(0.0, fraction)), message=message[:512])
        try:
            service.bus.publish(topics.profile_progress(service.node), event, qos=0, ttl_s=60)
        except EdgeswarmError as exc:  # progress is best effort
            log.debug("progress event not published: %s", exc)
