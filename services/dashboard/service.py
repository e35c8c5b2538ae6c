"""The dashboard: one live page of the whole cluster, its Prometheus metrics and its jobs' measured traces.

A thin adapter: it logs in to the broker like any service, feeds what it hears (the cluster view and events, every
job's state and events, the metrics reports, live heartbeats for the clocks, the profile reports' links) to an
``edgeswarm.dashboard.observer.Observer``, and at most every EDGESWARM_DASHBOARD_PUSH_INTERVAL_S, when something
changed, builds the snapshot (``edgeswarm.dashboard.snapshot``) and pushes it to the open pages
(``edgeswarm.dashboard.server``). It also runs the hub's ``TraceCollector`` (spans, answering trace requests on its
request topic) and ``PrometheusCollector`` (``/metrics``).

Listening: EDGESWARM_DASHBOARD_HOST (127.0.0.1) and EDGESWARM_DASHBOARD_PORT; a host beyond loopback needs
EDGESWARM_DASHBOARD_TOKEN_FILE, or the service refuses to start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from edgeswarm import topics
from edgeswarm.dashboard.auth import check_exposure, read_token
from edgeswarm.dashboard.observer import Observer
from edgeswarm.dashboard.prometheus import CONTENT_TYPE, STALE_INTERVALS, PrometheusCollector
from edgeswarm.dashboard.server import DashboardServer
from edgeswarm.dashboard.snapshot import build_snapshot
from edgeswarm.dashboard.trace_collector import TraceCollector
from edgeswarm.runtime.service import Service
from edgeswarm.settings import Settings

log = logging.getLogger(__name__)

# A snapshot is built at least this often even when nothing changed, so the page's ages and "last updated" move.
REFRESH_S = 5.0


class DashboardService(Service):
    name = "dashboard"

    def __init__(self, settings: Settings, on_listening: Callable[[str], None] | None = None, *,
                 member: bool = True) -> None:
        # Refused before it connects: a dashboard exposed without a token, or a token file it cannot read.
        self.token = read_token(settings.dashboard_token_file, create=settings.dashboard_token_create)
        check_exposure(settings.dashboard_host, self.token)
        super().__init__(settings, member=member)
        self.on_listening = on_listening
        # The address is taken before the service connects, so a port in use is said before anything else happens.
        self.server = DashboardServer(settings.dashboard_host, settings.dashboard_port, self.token,
                                      metrics=lambda: self.prometheus.exposition(), metrics_type=CONTENT_TYPE,
                                      trace=lambda job: self.traces.chrome_trace_json(job))
        self.server.bind()

    def setup(self) -> None:
        self.traces = TraceCollector(self.bus, self.metrics)
        self.traces.start(topics.request(self.node, self.name))
        self.observer = Observer(self.bus.hub.url)
        self.observer.subscribe(self.bus)
        self.prometheus = PrometheusCollector(self.observer, STALE_INTERVALS * self.settings.metrics_interval_s)
        self._seq = 0
        self._built_at = 0.0
        self._drawn: dict[str, int] = {}  # the span batches of each job its drawn schedule was made from
        self._push()  # before it listens: a page never gets the empty snapshot it could not draw
        self.server.start()
        log.info("dashboard at %s%s", self.server.url,
                 f" (it asks for the token in {self.settings.dashboard_token_file})" if self.token else "")
        if self.on_listening is not None:
            self.on_listening(self.server.url)
        self.every(self.settings.dashboard_push_interval_s, self._push, "dashboard-push")

    def _push(self) -> None:
        """Build and push a snapshot when something changed (or ``REFRESH_S`` passed): the pages are throttled to
        one every push interval, however fast the cluster talks."""
        now = time.monotonic()
        # A job's schedule is drawn again when its spans moved, a finished job's too: its last round's spans come
        # after the state that ends it.
        arrivals = self.traces.arrivals()
        moved = [s for s in self.observer.jobs() if arrivals.get(s.job_id, 0) != self._drawn.get(s.job_id, 0)]
        if not moved and not self.observer.changed.is_set() and now - self._built_at < REFRESH_S:
            return
        self.observer.changed.clear()
        self._built_at = now
        for state in moved:
            self._drawn[state.job_id] = arrivals.get(state.job_id, 0)
            try:
                self.observer.set_schedule(state.job_id, self.traces.round_schedule(state))
            except Exception:
                log.exception("the trace collector could not give job %s's schedule", state.job_id)
        for gone in set(self._drawn) - set(arrivals):
            del self._drawn[gone]
        self._seq += 1
        snapshot = build_snapshot(self.observer.observed(), time.time(), self._seq)
        self.server.publish(snapshot.model_dump_json().encode())

    def teardown(self) -> None:
        self.server.stop()
