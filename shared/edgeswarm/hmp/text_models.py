"""serve-hmp's language models for the gateway (``Workload.text_models``): the decoders its running jobs serve, each
named by its job, and a request to one as any caller asks it (``hmp.client.stream``: streamed, cancelled when the
HTTP client goes away), told in the gateway's terms (``gateway.backend``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import Any

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.gateway.backend import Prompt, TextDelta, TextDone, TextEvent, TextFailed
from edgeswarm.hmp.client import stream
from edgeswarm.messages.hmp import HmpDelta
from edgeswarm.messages.jobs import JobState
from edgeswarm.planning.hmp.types import HmpPlan
from edgeswarm.values.sampling import Sampling
from edgeswarm.workloads import typed_state

KIND = "serve-hmp"
SILENCE_S = 120.0  # a request whose coordinator says nothing for this long is answered with a timeout
MAX_JOBS = 1024  # job states followed: more is no cluster of ours


class HmpTextModels:
    """Follows the jobs' retained states (only a coordinator's, on its own job's topic) on ``bus``."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._jobs: dict[str, JobState] = {}
        self._lock = threading.Lock()
        bus.subscribe(topics.ALL_JOB_STATES, self._on_state, schemas=(JobState,))

    def _on_state(self, msg: Inbound) -> None:
        state = msg.body
        assert isinstance(state, JobState)
        if msg.envelope.sender_service != "coordinator" or topics.job_of(msg.topic) != state.job_id:
            return  # only a coordinator speaks for a job, on that job's own topic
        if state.kind != KIND:
            return
        with self._lock:
            if state.job_id in self._jobs or len(self._jobs) < MAX_JOBS:
                self._jobs[state.job_id] = state

    def models(self) -> list[tuple[str, float]]:
        with self._lock:
            states = [s for s in self._jobs.values() if s.status == "running"]
        out = []
        for state in states:
            try:
                plan: Any = typed_state(state).plan
            except Exception:  # noqa: BLE001 - a state this version cannot read lists no model
                continue
            if isinstance(plan, HmpPlan) and plan.decode is not None:  # a decoder: it generates text
                out.append((state.job_id, state.submitted_at))
        return sorted(out)

    def generate(self, model: str, prompt: Prompt, *, request_id: str, new_tokens: int | None, sampling: Sampling,
                 stop: list[str], alive: Callable[[], bool]) -> Generator[TextEvent, None, None]:
        events = stream(self.bus, model, prompt, request_id=request_id, max_new_tokens=new_tokens, sampling=sampling,
                        stop=stop, timeout_s=SILENCE_S, alive=alive)
        try:
            for event in events:
                if isinstance(event, HmpDelta):
                    yield TextDelta(offset=event.offset, text=event.text)
                elif event.reply is not None:
                    reply = event.reply
                    yield TextDone(text=reply.text, finish=reply.finish, prompt_tokens=len(reply.prompt_tokens),
                                   completion_tokens=len(reply.tokens))
                else:
                    yield TextFailed(reason=event.reason or "failed", detail=event.error or "")
        finally:
            events.close()  # a caller that stops early cancels the request on the coordinator


def text_models(bus: Bus) -> HmpTextModels:
    return HmpTextModels(bus)
