"""Driving a job's stage-workers over MQTT: deploy a plan, run rounds, collect what happened, save the stages.

This is the coordinator's side of a training job, usable from any process with a bus: every request waits
with a timeout and a failure names the device and its reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel

from edgeswarm import topics
from edgeswarm.bus import Bus
from edgeswarm.coordination.fanout import fan_out
from edgeswarm.coordination.program import Disrupted
from edgeswarm.errors import CheckpointError, EdgeswarmError, JobCancelled, JobError, RequestTimeoutError
from edgeswarm.hpp.spec import JobSpec
from edgeswarm.messages import Probe
from edgeswarm.messages.training import (
    CheckpointSource,
    RoundDone,
    RoundStart,
    StageAbort,
    StageAssign,
    StageFailed,
    StageHeld,
    StageInventory,
    StageReady,
    StageSave,
    StageSaved,
    StageSendState,
    StageStateSent,
    UnitSource,
)
from edgeswarm.planning.hpp.migration import UnitTransfer, backup_map
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.runtime.detection import RECONNECT_GRACE_S, Detection, FailureDetector
from edgeswarm.service_registry import STAGE_WORKER
from edgeswarm.state.layout import save_layout
from edgeswarm.wire import Message

ABORT_GRACE_S = 10.0  # how long the other devices get to give up an aborted round and answer
REACH_PROBE_S = 0.5  # one probe's wait while waiting for devices to reconnect


class DeviceLost(Disrupted):
    """Devices of the plan failed (confirmed by the failure detector) while the driver waited on them."""

    def __init__(self, message: str, failures: dict[str, Detection]) -> None:
        super().__init__(message, failures)


class StagesFailed(JobError):
    """Stage-workers answered with a failure; ``failures`` maps each device to its StageFailed (the devices that
    failed first: those that only gave up because of them are left out)."""

    def __init__(self, message: str, failures: dict[str, StageFailed]) -> None:
        super().__init__(message)
        self.failures = failures

    @property
    def transient(self) -> bool:
        """Whether every failure may pass on a later try (reason ``timeout``: a peer or a service was away)."""
        return all(f.reason == "timeout" for f in self.failures.values())


class ConnectionInterrupted(Disrupted):
    """The driver's connection to the broker dropped and came back while it waited: messages of that step may
    be lost (a restarted broker keeps none in flight), so the step is given up and replayed."""


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
    detector: FailureDetector | None = None
    service: str = STAGE_WORKER  # the worker service that hosts the stages (the kind's ``worker_service``)

    def __post_init__(self) -> None:
        self.sent: list[StageStateSent] = []  # the state sends of the last deploy
        if self.detector is not None:
            self.detector.watch(self.plan.devices)

    def _lost(self, nodes: list[str]) -> dict[str, Detection]:
        return {n: d for n, d in self.detector.failures().items() if n in nodes} if self.detector else {}

    def _ask(self, messages: dict[str, Message], round_index: int | None = None,
             targets: dict[str, str] | None = None) -> dict[str, Message]:
        """Send every device its request (keyed by node, or by a key ``targets`` maps to one) and collect the
        answers. The first failure, a device the failure detector confirms lost, or a cancellation ends the wait
        early: for a round, every device is told to abort it (and, unless a device is lost, gets ABORT_GRACE_S to
        answer). Raises DeviceLost when a failure is explained by a lost device (a failed answer makes the driver
        probe every device at once rather than wait for the heartbeats to time out), and ConnectionInterrupted
        when the connection to the broker dropped meanwhile."""
        targets = targets or {}
        nodes = [targets.get(k, k) for k in messages]
        connection = self.bus.hub.connects
        lost: dict[str, Detection] = {}
        giving_up = False

        def watch(replies: Mapping[str, Message]) -> float | None:
            nonlocal lost, giving_up
            lost = lost or self._lost(nodes)
            if lost:
                # Recovery starts at once; the survivors give the round up meanwhile (a device in the middle of a
                # computation finishes it first, and its new assignment waits for that).
                if round_index is not None:
                    self.abort(round_index, f"{', '.join(lost)} failed")
                return 0.0
            if not giving_up and (self.cancel.is_set() or any(isinstance(r, StageFailed) for r in replies.values())):
                giving_up = True
                if round_index is None:
                    return 0.0
                self.abort(round_index, "cancelled" if self.cancel.is_set() else "another device failed it")
                return ABORT_GRACE_S
            return None

        fan = fan_out(self.bus, messages, self.service, timeout_s=self.timeout_s, targets=targets, watch=watch)
        if self.cancel.is_set():
            raise JobCancelled(f"job {self.job.name} was cancelled")
        if fan.interrupted or self.bus.hub.connects != connection:
            if round_index is not None:
                self.abort(round_index, "the connection to the broker dropped")
            raise ConnectionInterrupted(f"job {self.job.name}: the connection to the broker dropped while waiting "
                                        f"for {', '.join(k for k in messages if k not in fan.replies) or 'nobody'}")
        failed = {node: r for node, r in fan.replies.items() if isinstance(r, StageFailed)}
        missing = [key for key in messages if key in fan.failures]
        if (failed or missing) and self.detector is not None and not lost:
            # A peer's death shows first as a failed send or a timeout on the devices around it: ask now.
            lost = self.detector.confirm(sorted(set(nodes)))
        if lost:
            raise DeviceLost(f"job {self.job.name}: " + "; ".join(d.detail for d in lost.values()), lost)
        if failed:
            # The devices that failed first say why; those that gave up because of them only say "aborted".
            first = {n: f for n, f in failed.items() if f.reason != "aborted"} or failed
            raise StagesFailed(f"job {self.job.name}: " + "; ".join(f"{node} failed ({f.reason}): {f.detail}"
                                                                    for node, f in first.items()), first)
        if missing:
            raise JobError(f"job {self.job.name}: no answer from the stage-worker on {', '.join(missing)} within "
                           f"{self.timeout_s:.0f} s" + "".join(f"; {exc}" for exc in fan.failures.values()
                                                               if not isinstance(exc, RequestTimeoutError)))
        return fan.replies

    def await_reconnected(self, within_s: float = RECONNECT_GRACE_S) -> dict[str, Detection]:
        """After this side's connection to the broker came back (a broker restart): wait until every device of the
        plan answers a probe, which it does only once its own connection and subscriptions are back, for at most
        ``within_s`` seconds. Returns the failures the detector then confirms among the devices still silent
        (empty when all answered). Requests sent before a device resubscribed would be lost."""
        deadline = time.monotonic() + within_s
        silent = set(self.plan.devices)
        lock = threading.Lock()

        def reach(node: str) -> None:
            while time.monotonic() < deadline:
                try:
                    self.bus.request(topics.request(node, self.service), Probe(), timeout_s=REACH_PROBE_S)
                except EdgeswarmError:
                    continue
                with lock:
                    silent.discard(node)
                return

        threads = [threading.Thread(target=reach, args=(n,), daemon=True) for n in self.plan.devices]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.detector.confirm(sorted(silent)) if silent and self.detector is not None else {}

    def abort(self, round_index: int, reason: str) -> None:
        """Tell every device of the plan to give round ``round_index`` up (no answer expected)."""
        for node in self.plan.devices:
            self.bus.publish(topics.request(node, self.service), StageAbort(job_id=self.job.name, epoch=self.epoch,
                                                                      round=round_index, reason=reason))

    def deploy(self, resume_round: int = 0, transfers: list[UnitTransfer] | None = None,
               checkpoint: CheckpointSource | None = None) -> dict[str, StageReady]:
        """Assign every device its stage; returns their StageReady answers.

        Without ``transfers`` or ``checkpoint`` the stages start from the model's seed. With ``transfers`` (a
        recovery) every device restores its units' state at the start of ``resume_round``: a unit a transfer
        brings comes from that transfer's source, which is told to send it (StageSendState; one request per link,
        so links carry their units at the same time), and every other unit from the device's own snapshot. With
        ``checkpoint`` every device loads its units from that checkpoint version instead."""
        groups = [list(s.devices) for s in self.plan.stages]
        shares = [list(s.shares) for s in self.plan.stages]
        backups = backup_map(self.plan)
        incoming: dict[tuple[str, int], UnitTransfer] = {(t.dst, t.unit): t for t in transfers or []}
        messages: dict[str, Message] = {}
        for s in self.plan.stages:
            for rank, node in enumerate(s.devices):
                restore = []
                if transfers is not None:
                    for unit in range(s.start, s.end):
                        t = incoming.get((node, unit))
                        restore.append(UnitSource(unit=unit, node=t.src, owner=t.from_backup_of) if t else
                                       UnitSource(unit=unit, node=node))
                messages[node] = StageAssign(
                    job_id=self.job.name, epoch=self.epoch, stage=s.index, rank=rank, model=self.job.model,
                    start=s.start, end=s.end, groups=groups, shares=shares,
                    micro_batches=self.plan.options.micro_batches, warmup=s.warmup,
                    loss_scale=1.0 / self.loss_terms, optimizer=self.job.optimizer, data=self.job.data,
                    seed=self.job.seed, backup_to=backups.get(node), backup_interval=self.job.backup_interval,
                    resume_round=resume_round, restore=restore, checkpoint=checkpoint)
        requests: dict[str, Message] = {}
        for (src, dst, owner), units in _links(transfers or []).items():
            requests[f"{src}>{dst}>{owner or ''}"] = StageSendState(
                job_id=self.job.name, epoch=self.epoch, round=resume_round, units=units, owner=owner, to=dst)
        # Assignments are keyed by node and state sends by ``src>dst>owner``, asked together.
        replies = self._ask({**messages, **requests}, targets={key: key.split(">", 1)[0] for key in requests})
        self.sent = [r for key, r in replies.items() if ">" in key]  # type: ignore[misc]
        return {node: r for node, r in replies.items() if ">" not in node}  # type: ignore[misc]

    def gather(self, at: str, resume_round: int, holders: dict[int, tuple[str, str | None]]) -> list[StageStateSent]:
        """Heavy rescheduling's first step: every unit's holder sends its state at the start of ``resume_round``
        to ``at`` (``holders``: unit -> (node, backup owner or None)). Returns the senders' answers."""
        by_source: dict[tuple[str, str | None], list[int]] = {}
        for unit, (node, owner) in sorted(holders.items()):
            if node != at or owner is not None:
                by_source.setdefault((node, owner), []).append(unit)
        replies = self._ask({f"{n}>{at}>{o or ''}": StageSendState(
            job_id=self.job.name, epoch=self.epoch, round=resume_round, units=units, owner=o, to=at,
            purpose="gather") for (n, o), units in by_source.items()},
            targets={f"{n}>{at}>{o or ''}": n for n, o in by_source})
        return list(replies.values())  # type: ignore[arg-type]

    def inventory(self, nodes: list[str]) -> dict[str, StageHeld]:
        """What state of the job every node in ``nodes`` holds (their snapshots and the backups of others)."""
        replies = self._ask({n: StageInventory(job_id=self.job.name) for n in nodes})
        return replies  # type: ignore[return-value]

    def run_round(self, index: int) -> RoundReport:
        """Run round ``index`` on every device and report it."""
        started = time.perf_counter()
        replies = self._ask({node: RoundStart(job_id=self.job.name, epoch=self.epoch, round=index)
                             for node in self.plan.devices}, round_index=index)
        elapsed = time.perf_counter() - started
        done: dict[str, RoundDone] = replies  # type: ignore[assignment]
        last = [d for d in done.values() if d.stage == len(self.plan.stages) - 1]
        terms = sum(d.terms for d in last)
        return RoundReport(round=index, loss=sum(d.loss_sum for d in last) / max(1, terms),
                           accuracy=sum(d.correct for d in last) / max(1, terms), round_s=elapsed, devices=done)

    def save(self, store_node: str, version: int) -> list[StageSaved]:
        """Save every stage (from its first device) to the checkpoint store as ``version``, then the version's
        layout (which units each stage holds)."""
        messages: dict[str, Message] = {s.devices[0]: StageSave(job_id=self.job.name, epoch=self.epoch,
                                                                  store_node=store_node, version=version)
                                        for s in self.plan.stages}
        saved = list(self._ask(messages).values())
        try:
            save_layout(self.bus, store_node, self.job.name, version, self.plan, model=self.job.model,
                        timeout_s=self.timeout_s)
        except CheckpointError as exc:
            raise JobError(f"job {self.job.name}: saving the layout of checkpoint version {version}: {exc}") from exc
        return saved  # type: ignore[return-value]


def _links(transfers: list[UnitTransfer]) -> dict[tuple[str, str, str | None], list[int]]:
    """The units each (source, destination, backup owner) sends, in unit order."""
    links: dict[tuple[str, str, str | None], list[int]] = {}
    for t in sorted(transfers, key=lambda t: t.unit):
        if t.src == t.dst:
            continue  # restored from the device's own backup store
        links.setdefault((t.src, t.dst, t.from_backup_of), []).append(t.unit)
    return links
