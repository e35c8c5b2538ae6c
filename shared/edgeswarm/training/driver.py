"""Driving a job's stage-workers over MQTT: deploy a plan, run rounds, collect what happened, save the stages.

This is the coordinator's side of a training job, usable from any process with a bus: every request waits
with a timeout and a failure names the device and its reason.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pydantic import BaseModel

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages.training import (
    RoundDone,
    RoundStart,
    StageAbort,
    StageAssign,
    StageFailed,
    StageReady,
    StageSave,
    StageSaved,
)
from edgeswarm.planning.types import Plan
from edgeswarm.training.jobs import JobSpec
from edgeswarm.wire import Message

WORKER = "stage-worker"
POLL_S = 0.005  # how often a wait for answers looks for a failure or a cancellation
ABORT_GRACE_S = 10.0  # how long the other devices get to give up an aborted round and answer


class JobError(EdgeswarmError):
    """A stage-worker refused, failed or did not answer; the message names it."""


class JobCancelled(JobError):
    """The job was cancelled."""


class RoundReport(BaseModel):
    """One round as measured: mean loss and accuracy over the mini-batch, the wall time from start to the last
    device's answer (seconds), and each device's compute, wait and AllReduce seconds and peak live
    micro-batches."""

    round: int
    loss: float
    accuracy: float
    round_s: float
    devices: dict[str, RoundDone]


@dataclass
class JobDriver:
    """Deploys ``plan`` for ``job`` on its devices' stage-workers and runs rounds. ``loss_terms`` is the loss
    terms per round (the global batch, times the sequence length for next-token targets). Setting ``cancel``
    aborts the round in flight and makes the driver raise JobCancelled."""

    bus: Bus
    job: JobSpec
    plan: Plan
    loss_terms: int
    epoch: int = 0
    timeout_s: float = 120.0
    cancel: threading.Event = field(default_factory=threading.Event)

    def _ask(self, messages: dict[str, Message], round_index: int | None = None) -> dict[str, Inbound]:
        """Send every device its request and collect the answers. The first failure, or a cancellation, ends the
        wait early: for a round, every device is told to abort it and gets ABORT_GRACE_S to answer."""
        expectations = {}
        for node, message in messages.items():
            exp = self.bus.expect()
            expectations[node] = exp
            self.bus.publish(topics.request(node, WORKER), message, correlation_id=exp.correlation_id,
                             reply_to=self.bus.reply_topic, ttl_s=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        replies: dict[str, Inbound] = {}
        giving_up = False
        while len(replies) < len(expectations) and time.monotonic() < deadline:
            for node, exp in expectations.items():
                if node not in replies and exp.arrived:
                    replies[node] = exp.wait(0)  # type: ignore[assignment]
            if not giving_up and (self.cancel.is_set() or any(isinstance(r.body, StageFailed)
                                                              for r in replies.values())):
                giving_up = True
                if round_index is None:
                    break
                self.abort(round_index, "cancelled" if self.cancel.is_set() else "another device failed it")
                deadline = min(deadline, time.monotonic() + ABORT_GRACE_S)
            time.sleep(POLL_S)
        for node, exp in expectations.items():
            if node not in replies:
                exp.wait(0)  # ends the expectation
        if self.cancel.is_set():
            raise JobCancelled(f"job {self.job.name} was cancelled")
        failed = {node: r.body for node, r in replies.items() if isinstance(r.body, StageFailed)}
        if failed:
            # The devices that failed first say why; those that gave up because of them only say "aborted".
            first = {n: f for n, f in failed.items() if f.reason != "aborted"} or failed
            raise JobError(f"job {self.job.name}: " + "; ".join(f"{node} failed ({f.reason}): {f.detail}"
                                                                for node, f in first.items()))
        missing = [node for node in expectations if node not in replies]
        if missing:
            raise JobError(f"job {self.job.name}: no answer from the stage-worker on {', '.join(missing)} within "
                           f"{self.timeout_s:.0f} s")
        return replies

    def abort(self, round_index: int, reason: str) -> None:
        """Tell every device of the plan to give round ``round_index`` up (no answer expected)."""
        for node in self.plan.devices:
            self.bus.publish(topics.request(node, WORKER), StageAbort(job_id=self.job.name, epoch=self.epoch,
                                                                      round=round_index, reason=reason))

    def deploy(self) -> dict[str, StageReady]:
        """Assign every device its stage; returns their StageReady answers."""
        groups = [list(s.devices) for s in self.plan.stages]
        shares = [list(s.shares) for s in self.plan.stages]
        messages: dict[str, Message] = {}
        for s in self.plan.stages:
            for rank, node in enumerate(s.devices):
                messages[node] = StageAssign(
                    job_id=self.job.name, epoch=self.epoch, stage=s.index, rank=rank, model=self.job.model,
                    start=s.start, end=s.end, groups=groups, shares=shares,
                    micro_batches=self.plan.options.micro_batches, warmup=s.warmup,
                    loss_scale=1.0 / self.loss_terms, optimizer=self.job.optimizer, data=self.job.data,
                    seed=self.job.seed)
        return {node: r.body for node, r in self._ask(messages).items()}  # type: ignore[misc]

    def run_round(self, index: int) -> RoundReport:
        """Run round ``index`` on every device and report it."""
        started = time.perf_counter()
        replies = self._ask({node: RoundStart(job_id=self.job.name, epoch=self.epoch, round=index)
                             for node in self.plan.devices}, round_index=index)
        elapsed = time.perf_counter() - started
        done: dict[str, RoundDone] = {node: r.body for node, r in replies.items()}  # type: ignore[misc]
        last = [d for d in done.values() if d.stage == len(self.plan.stages) - 1]
        terms = sum(d.terms for d in last)
        return RoundReport(round=index, loss=sum(d.loss_sum for d in last) / max(1, terms),
                           accuracy=sum(d.correct for d in last) / max(1, terms), round_s=elapsed, devices=done)

    def save(self, store_node: str, version: int) -> list[StageSaved]:
        """Save every stage (from its first device) to the checkpoint store as ``version``."""
        messages: dict[str, Message] = {s.devices[0]: StageSave(job_id=self.job.name, epoch=self.epoch,
                                                                  store_node=store_node, version=version)
                                        for s in self.plan.stages}
        return [r.body for r in self._ask(messages).values()]  # type: ignore[misc]
