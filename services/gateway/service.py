"""The gateway: an OpenAI-compatible API (``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``) over the
language models the cluster's jobs serve (edgeswarm.gateway).

A thin adapter: every installed job kind that serves language models says how to ask its jobs
(``Workload.text_models``: serve-hmp's decoders, each named by its job); the gateway lists them all and sends each
request to the kind that serves its model. The coordinator counts the requests in the serving metrics; the gateway
counts its own answers and refusals (``gateway.*``).

Listening: EDGESWARM_GATEWAY_HOST (127.0.0.1) and EDGESWARM_GATEWAY_PORT (8000); a host beyond loopback needs
EDGESWARM_GATEWAY_TOKEN_FILE (every request then sends it as its bearer token: the OpenAI client's api_key), or the
service refuses to start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator

from edgeswarm.dashboard.auth import check_exposure, read_token
from edgeswarm.gateway.backend import Prompt, TextEvent, TextFailed, TextModels
from edgeswarm.gateway.server import GatewayServer
from edgeswarm.plugins import load_target
from edgeswarm.runtime.service import Service
from edgeswarm.settings import Settings
from edgeswarm.values.sampling import Sampling
from edgeswarm.workloads import installed_workload, kinds

log = logging.getLogger(__name__)


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
        self.kinds: list[TextModels] = []

    def setup(self) -> None:
        for kind in kinds():
            work = installed_workload(kind)
            if work is not None and work.text_models:
                self.kinds.append(load_target(work.text_models, f"job kind {kind!r}'s text models")(self.bus))
        self.server.start()
        log.info("OpenAI-compatible API at %s%s", self.server.url,
                 f" (it asks for the token in {self.settings.gateway_token_file})" if self.token else "")
        if self.on_listening is not None:
            self.on_listening(self.server.url)

    def teardown(self) -> None:
        self.server.stop()

    # --- the server's backend ------------------------------------------------------------------------------

    def models(self) -> list[tuple[str, float]]:
        return sorted(m for k in self.kinds for m in k.models())

    def generate(self, model: str, prompt: Prompt, *, request_id: str, new_tokens: int | None, sampling: Sampling,
                 stop: list[str], alive: Callable[[], bool]) -> Generator[TextEvent, None, None]:
        for k in self.kinds:
            if model in {name for name, _ in k.models()}:
                yield from k.generate(model, prompt, request_id=request_id, new_tokens=new_tokens, sampling=sampling,
                                      stop=stop, alive=alive)
                return
        yield TextFailed(reason="unknown_job", detail=f"no job serves the model {model!r} any more")

    def counted(self, what: str) -> None:
        self.metrics.count(f"gateway.{what}")
