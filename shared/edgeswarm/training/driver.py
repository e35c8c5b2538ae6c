"""Driving a job's stage-workers over MQTT: deploy a plan, run rounds, collect what happened, save the stages.

This is the coordinator's side of a training job, usable from any process with a bus: every request waits
with a timeout and a failure names the device and its reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pydantic import BaseModel

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages.training import (
    RoundDone,
    RoundStart,
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


class JobError(EdgeswarmError):
    """A stage-worker refused, failed or did not answer; the message names it."""


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
    terms per round (the global batch, times the sequence length for next-token targets)."""

    bus: Bus
    job: JobSpec
    plan: Plan
    loss_terms: int
    epoch: int = 0
    timeout_s: float = 120.0

    def _ask(self, messages: dict[str, Message], timeout_s: float | None = None) -> dict[str, Inbound]:
        wait = timeout_s or self.timeout_s
        expectations = {}
        for node, message in messages.items():
            exp = self.bus.expect()
            expectations[node] = exp
            self.bus.publish(topics.request(node, WORKER), message, correlation_id=exp.correlation_id,
                             reply_to=self.bus.reply_topic, ttl_s=wait)
        deadline = time.monotonic() + wait
        replies = {node: exp.wait(max(0.0, deadline - time.monotonic())) for node, exp in expectations.items()}
        missing = [node for node, reply in replies.items() if reply is None]
        if missing:
            raise JobError(f"job {self.job.name}: no answer from the stage-worker on {', '.join(missing)} within "
                           f"{wait:.0f} s")
        failed = {node: r.body for node, r in replies.items() if isinstance(r.body, StageFailed)}
        if failed:
            raise JobError(f"job {self.job.name}: " + "; ".join(f"{node} failed ({f.reason}): {f.detail}"
                                                                for node, f in failed.items()))
        return {node: reply for node, reply in replies.items() if reply is not None}

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
                             for node in self.plan.devices})
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
