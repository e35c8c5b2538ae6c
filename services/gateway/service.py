"""The gateway: an OpenAI-compatible API (``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``) over the
cluster's serve-hmp jobs, each decoder being served listed as a model named by its job.

A thin adapter: it follows the jobs' retained states (only a coordinator's, on its own job's topic) to know which
decoders are served, and asks a job's coordinator as any caller does (``edgeswarm.hmp.client.stream``: streamed,
cancelled when the HTTP client goes away). The coordinator counts the requests in the serving metrics; the gateway
counts its own answers and refusals (``gateway.*``).

Listening: EDGESWARM_GATEWAY_HOST (127.0.0.1) and EDGESWARM_GATEWAY_PORT (8000); a host beyond loopback needs
EDGESWARM_GATEWAY_TOKEN_FILE (every request then sends it as its bearer token: the OpenAI client's api_key), or the
service refuses to start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator
from typing import Any

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.dashboard.auth import check_exposure, read_token
from edgeswarm.gateway.server import GatewayServer
from edgeswarm.hmp.client import Answer, Prompt, stream
from edgeswarm.messages.hmp import HmpDelta
from edgeswarm.messages.jobs import JobState
from edgeswarm.planning.hmp.types import HmpPlan
from edgeswarm.runtime.service import Service
from edgeswarm.settings import Settings
from edgeswarm.values.sampling import Sampling
from edgeswarm.workloads import typed_state

log = logging.getLogger(__name__)

SILENCE_S = 120.0  # a request whose coordinator says nothing for this long is answered with a timeout
MAX_JOBS = 1024  # job states followed: more is no cluster of ours


class GatewayService(Service):
    name = "gateway"

    def __init__(self, settings: Settings, on_listening: Callable[[str], None] | None = None) -> None:
        # Refused before it connects: an API exposed without a token, or a token file it cannot read.
        self.token = read_token(settings.gateway_token_file, create=settings.gateway_token_create,
                                setting="EDGESWARM_GATEWAY_TOKEN_FILE")
        check_exposure(settings.gateway_host, self.token, what="the gateway",
                       shows="the cluster's language models to use", setting="EDGESWARM_GATEWAY_TOKEN_FILE",
                       host_setting="EDGESWARM_GATEWAY_HOST")
        super().__init__(settings)
        self.on_listening = on_listening
        self.server = GatewayServer(settings.gateway_host, settings.gateway_port, self.token, self)
        self.server.bind()  # a port in use is said before anything else happens
        self._jobs: dict[str, JobState] = {}
        self._lock = threading.Lock()

    def setup(self) -> None:
        self.bus.subscribe(topics.ALL_JOB_STATES, self._on_state, schemas=(JobState,))
        self.server.start()
        log.info("OpenAI-compatible API at %s%s", self.server.url,
                 f" (it asks for the token in {self.settings.gateway_token_file})" if self.token else "")
        if self.on_listening is not None:
            self.on_listening(self.server.url)

    def teardown(self) -> None:
        self.server.stop()

    def _on_state(self, msg: Inbound) -> None:
        state = msg.body
        assert isinstance(state, JobState)
        env = msg.envelope
        if env.sender_service != "coordinator" or topics.job_of(msg.topic) != state.job_id:
            return  # only a coordinator speaks for a job, on that job's own topic
        with self._lock:
            if state.job_id in self._jobs or len(self._jobs) < MAX_JOBS:
                self._jobs[state.job_id] = state

    # --- the server's backend ------------------------------------------------------------------------------

    def models(self) -> list[tuple[str, float]]:
        with self._lock:
            states = list(self._jobs.values())
        out = []
        for state in states:
            if state.kind != "serve-hmp" or state.status != "running":
                continue
            try:
                plan: Any = typed_state(state).plan
            except Exception:  # noqa: BLE001 - a state this version cannot read lists no model
                continue
            if isinstance(plan, HmpPlan) and plan.decode is not None:  # a decoder: it generates text
                out.append((state.job_id, state.submitted_at))
        return sorted(out)

    def generate(self, model: str, prompt: Prompt, *, request_id: str, new_tokens: int | None, sampling: Sampling,
                 stop: list[str], alive: Callable[[], bool]) -> Generator[HmpDelta | Answer, None, None]:
        return stream(self.bus, model, prompt, request_id=request_id, max_new_tokens=new_tokens, sampling=sampling,
                      stop=stop, timeout_s=SILENCE_S, alive=alive)

    def counted(self, what: str) -> None:
        self.metrics.count(f"gateway.{what}")
