"""The toy's worker program, hosted by the toy-worker service: holds jobs by id and doubles numbers for them."""

from __future__ import annotations

import threading

from edgeswarm.bus import Inbound
from edgeswarm.messages.training import StageFailed
from edgeswarm.runtime.program import WorkerContext
from edgeswarm.wire import Message
from edgeswarm_toy.messages import ToyAssign, ToyReady, ToyRelease, ToyStep, ToyStepDone


class ToyProgram:
    handles: tuple[type[Message], ...] = (ToyAssign, ToyStep, ToyRelease)
    tensors: tuple[type[Message], ...] = ()

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._jobs: dict[str, int] = {}  # job id -> epoch

    def job_of(self, body: Message) -> str:
        return str(getattr(body, "job_id", ""))

    def holds(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._jobs

    def on_request(self, msg: Inbound) -> None:
        body = msg.body
        if isinstance(body, ToyAssign):
            with self._lock:
                self._jobs[body.job_id] = body.epoch
            self.ctx.bus.reply(msg, ToyReady(job_id=body.job_id))
        elif isinstance(body, ToyStep):
            if not self.holds(body.job_id):
                self.refuse(msg, body.job_id, "not_assigned", f"{self.ctx.node} holds no toy job {body.job_id}")
                return
            self.ctx.metrics.count("toy_steps")
            self.ctx.bus.reply(msg, ToyStepDone(job_id=body.job_id, step=body.step, doubled=2 * body.value))
        elif isinstance(body, ToyRelease):
            with self._lock:
                self._jobs.pop(body.job_id, None)

    def on_tensor(self, msg: Inbound) -> None:
        return None

    def refuse(self, msg: Inbound, job_id: str, reason: str, detail: str) -> None:
        self.ctx.metrics.count(f"toy_refused.{reason}")
        self.ctx.bus.reply(msg, StageFailed(job_id=job_id, reason=reason, detail=detail[:4096]))  # type: ignore[arg-type]

    def close(self) -> None:
        with self._lock:
            self._jobs.clear()
