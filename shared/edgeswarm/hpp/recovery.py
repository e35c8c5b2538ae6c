"""Fault-tolerant pipeline replay (spec 5.6): from confirmed device failures to a job running again.

After the failure detector confirms that devices are gone and the driver has aborted the round in flight:

1. every survivor says which state it holds (its snapshots at round starts, the backups it keeps for others);
2. the resume round is the latest round start at which every unit still has a copy: the survivors' snapshots
   and, for a failed single-device stage, its backup device's copy;
3. a new plan (epoch + 1): ``light`` moves the cut points by FLOPs and group capacity (``light_replan``) and
   sends only the units whose owner changed, on every link at once; ``heavy`` is the straw-man: gather the whole
   model on the strongest survivor, run the full planner, and send every device its whole stage from there;
4. every device of the new plan restores its units at the resume round, and the job replays from there.

With no device lost (a round failed for another reason, such as a restarted broker), ``replay`` keeps the plan
and restores every device from its own snapshot. When devices failed together with their backups, some unit has
no copy left on any device: the job goes back to its last checkpoint (``checkpoint``: weights and optimizer state
from the checkpoint store, on a new plan of the survivors) and loses only the rounds since. ``grow`` adds devices
that appeared during the job at a round boundary: the full planner runs on every device, and only the units
whose owner changed move.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Set
from typing import Literal

from pydantic import BaseModel, Field

from edgeswarm.errors import CheckpointError, InfeasiblePlanError
from edgeswarm.hpp.driver import DeviceLost, JobDriver, JobError
from edgeswarm.messages.training import CheckpointSource, StageHeld
from edgeswarm.planning.hpp.compare import plan_best
from edgeswarm.planning.hpp.migration import (
    UnitTransfer,
    UnrecoverableError,
    backup_map,
    local_restores,
    plan_migration,
    unit_holders,
)
from edgeswarm.planning.hpp.replan import light_replan
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.runtime.detection import Detection
from edgeswarm.state.layout import load_layout
from edgeswarm.values.profiles import OPTIMIZER_STATE_FACTOR, ClusterProfile

log = logging.getLogger(__name__)

RecoveryMode = Literal["light", "heavy", "replay", "join", "checkpoint", "rebalance"]
MAX_ATTEMPTS = 3  # recoveries in a row when devices keep failing while the job recovers


class RecoveryReport(BaseModel):
    """One recovery (or, with mode ``join``, the addition of the devices ``joined``) as it happened. Times are
    seconds: ``replan_s`` computing the new plan, ``gather_s`` (heavy only) collecting the model on one device,
    ``restore_s`` sending the moved units and rebuilding every stage, ``recovery_s`` from the failure's
    confirmation to every stage ready (detection excluded); ``detection_s`` is per failed device, from its last
    sign of life to the confirmation. Bytes: ``moved_bytes`` the unit state put on the wire, ``moved_state_bytes``
    the state of the units whose owner changed (what it may not exceed)."""

    mode: RecoveryMode
    failed: list[str]
    joined: list[str] = Field(default_factory=list)
    detection_s: dict[str, float] = Field(default_factory=dict)
    interrupted_round: int
    resume_round: int
    epoch: int
    replan_s: float = 0.0
    gather_s: float = 0.0
    restore_s: float = 0.0
    recovery_s: float = 0.0
    moved_bytes: int = 0
    moved_state_bytes: int = 0
    transfers: int = 0
    plan: Plan


def unit_state_bytes(cluster: ClusterProfile, optimizer: str) -> list[int]:
    """Every unit's training state in bytes: weights, optimizer state and buffers."""
    factor = 1 + OPTIMIZER_STATE_FACTOR[optimizer]
    return [u.weight_bytes * factor + u.buffer_bytes for u in cluster.model.units]


def resume_round(plan: Plan, failed: Set[str], held: dict[str, StageHeld], interrupted: int) -> int:
    """The latest round start, at or before the interrupted round, at which every unit of ``plan`` has a copy:
    every surviving device has its snapshot and every failed single-device stage's backup device has its backup.
    Raises UnrecoverableError when there is none (both copies of a unit were lost)."""
    backups = backup_map(plan)
    unit_holders(plan, failed, backups)  # raises naming the units nobody holds
    candidates = set(range(interrupted + 1))
    for node, inventory in held.items():
        candidates &= {s.round for s in inventory.snapshots}
        del node
    for stage in plan.stages:
        if all(d in failed for d in stage.devices):
            owner = stage.devices[0]
            holder = held.get(backups[owner])
            rounds = {b.round for b in holder.backups if b.owner == owner
                      and set(b.units) >= set(range(stage.start, stage.end))} if holder else set()
            candidates &= rounds
    if not candidates:
        raise UnrecoverableError(
            f"no round start at or before round {interrupted} has a copy of every unit after losing "
            f"{', '.join(sorted(failed))}: restart the job from its last checkpoint", units=[], devices=sorted(failed))
    return max(candidates)


def strongest(cluster: ClusterProfile, nodes: list[str]) -> str:
    """The node among ``nodes`` that runs the whole model fastest at the largest profiled batch."""
    def whole_model_s(node: str) -> float:
        entry = next(e for e in cluster.devices if e.device.node == node)
        return sum(f[-1] + b[-1] for f, b in zip(entry.compute.forward_s, entry.compute.backward_s, strict=True))
    return min(nodes, key=whole_model_s)


def recover(driver: JobDriver, failures: dict[str, Detection], interrupted: int, cluster: ClusterProfile,
            mode: RecoveryMode, checkpoint: tuple[str, int] | None = None) -> tuple[JobDriver, RecoveryReport]:
    """Bring the job of ``driver`` back after ``failures`` (empty: ``replay`` on the same devices) while round
    ``interrupted`` ran. Returns the driver of the new plan, whose devices hold the state at the start of the
    report's resume round, and the report. A device lost during the recovery is added to the failures and the
    recovery starts again from the same old plan (at most MAX_ATTEMPTS times). When some unit has no copy left
    on the devices (a device and its backup failed together), the job goes back to ``checkpoint`` (the checkpoint
    store's node and the last version saved) on a new plan of the survivors, mode ``checkpoint``; without one
    that raises UnrecoverableError. Raises DeviceLost after too many attempts, or JobError from a device."""
    failed = dict(failures)
    for attempt in range(MAX_ATTEMPTS):
        try:
            try:
                return _recover_once(driver, failed, interrupted, cluster, mode if failed else "replay")
            except UnrecoverableError as exc:
                if checkpoint is None:
                    raise
                log.warning("job %s: %s; going back to checkpoint version %d", driver.job.name, exc, checkpoint[1])
                return _from_checkpoint(driver, failed, interrupted, cluster, *checkpoint)
        except DeviceLost as more:
            log.warning("job %s: %s failed during the recovery (attempt %d)", driver.job.name,
                        ", ".join(more.failures), attempt + 1)
            failed.update(more.failures)
            if mode == "replay":
                mode = "light"
    raise DeviceLost(f"job {driver.job.name}: devices kept failing during {MAX_ATTEMPTS} recoveries", failed)


def _from_checkpoint(driver: JobDriver, failures: dict[str, Detection], interrupted: int, cluster: ClusterProfile,
                     store_node: str, version: int) -> tuple[JobDriver, RecoveryReport]:
    """The job on a new plan of the surviving devices (the full planner: every unit comes from the store
    anyway), every device loading its units from checkpoint ``version``; the rounds after it run again."""
    started = time.monotonic()
    confirmed = max((d.confirmed_at for d in failures.values()), default=time.time())
    old = driver.plan
    remaining = cluster.without(*failures)
    try:
        layout = load_layout(driver.bus, store_node, driver.job.name, version, timeout_s=driver.timeout_s)
    except CheckpointError as exc:
        raise UnrecoverableError(f"job {driver.job.name}: devices and their backups failed together and checkpoint "
                                 f"version {version} cannot be read: {exc}", units=[],
                                 devices=sorted(failures)) from exc
    t0 = time.monotonic()
    new = full_plan(old, remaining)
    replan_s = time.monotonic() - t0
    t0 = time.monotonic()
    successor = _successor(driver, new)
    ready = successor.deploy(version, checkpoint=CheckpointSource(store_node=store_node, version=version,
                                                                  stages=layout))
    restore_s = time.monotonic() - t0
    loaded = sum(r.restored_bytes for r in ready.values())
    report = RecoveryReport(
        mode="checkpoint", failed=sorted(failures), detection_s={n: d.detection_s for n, d in failures.items()},
        interrupted_round=interrupted, resume_round=version, epoch=new.epoch, replan_s=replan_s,
        restore_s=restore_s, recovery_s=max(time.monotonic() - started, time.time() - confirmed),
        moved_bytes=loaded, moved_state_bytes=loaded, transfers=len(ready), plan=new)
    log.info("job %s: back to checkpoint version %d without %s: %d stages, %d bytes loaded, %.2f s", driver.job.name,
             version, ", ".join(report.failed), len(new.stages), loaded, report.recovery_s)
    return successor, report


def full_plan(old: Plan, cluster: ClusterProfile) -> Plan:
    """The full planner on ``cluster`` for ``old``'s strategy, global batch, M and optimizer; epoch plus one."""
    new = plan_best(old.strategy, cluster, old.options.global_batch, micro_batches=old.options.micro_batches,
                    optimizer=old.options.optimizer)
    return new.model_copy(update={"epoch": old.epoch + 1})


def _successor(driver: JobDriver, new: Plan) -> JobDriver:
    """A driver of plan ``new`` for ``driver``'s job, bus, detector, timeout, cancellation and worker service."""
    return JobDriver(driver.bus, driver.job, new, driver.loss_terms, epoch=new.epoch, timeout_s=driver.timeout_s,
                     cancel=driver.cancel, detector=driver.detector, service=driver.service)


def _recover_once(driver: JobDriver, failures: dict[str, Detection], interrupted: int, cluster: ClusterProfile,
                  mode: RecoveryMode) -> tuple[JobDriver, RecoveryReport]:
    started = time.monotonic()
    confirmed = max((d.confirmed_at for d in failures.values()), default=time.time())
    old = driver.plan
    failed = set(failures)
    survivors = [d for d in old.devices if d not in failed]
    held = driver.inventory(survivors)
    resume = resume_round(old, failed, held, interrupted)
    sizes = unit_state_bytes(cluster, driver.job.optimizer.name)
    backups = backup_map(old)
    remaining = cluster.without(*failed)

    t0 = time.monotonic()
    gathered_at = None
    gather_s = 0.0
    if mode == "light":
        try:
            new = old
            for node in sorted(failed):
                new = light_replan(new, remaining if new is not old else cluster, node)
            new = new.model_copy(update={"epoch": old.epoch + 1})
        except InfeasiblePlanError as exc:
            log.warning("job %s: the light re-plan does not fit (%s); rescheduling from scratch", driver.job.name, exc)
            mode = "heavy"
    if mode == "replay":
        new = old.model_copy(update={"epoch": old.epoch + 1})
    replan_s = time.monotonic() - t0

    if mode == "heavy":
        # The straw-man: the whole model is gathered on the strongest survivor before the full planner runs there.
        gathered_at = strongest(cluster, survivors)
        holders = {u: hs[0] for u, hs in unit_holders(old, failed, backups).items()}
        t0 = time.monotonic()
        driver.gather(gathered_at, resume, holders)
        _wait_gathered(driver, gathered_at, resume, old.units)
        gather_s = time.monotonic() - t0
        t0 = time.monotonic()
        new = full_plan(old, remaining)
        replan_s = time.monotonic() - t0
        transfers = [UnitTransfer(unit=u, src=gathered_at, dst=d, nbytes=sizes[u])
                     for s in new.stages for d in s.devices if d != gathered_at for u in range(s.start, s.end)]
        moved_state = sum(t.nbytes for t in transfers)
    else:
        moving = plan_migration(old, new, failed, backups, sizes)
        moved_state = sum(t.nbytes for t in moving)
        transfers = [*moving, *local_restores(old, new, failed, backups, sizes)]

    t0 = time.monotonic()
    successor = _successor(driver, new)
    successor.deploy(resume, transfers)
    restore_s = time.monotonic() - t0
    report = RecoveryReport(
        mode=mode, failed=sorted(failed), detection_s={n: d.detection_s for n, d in failures.items()},
        interrupted_round=interrupted, resume_round=resume, epoch=new.epoch, replan_s=replan_s, gather_s=gather_s,
        restore_s=restore_s, recovery_s=max(time.monotonic() - started, time.time() - confirmed),
        moved_bytes=sum(s.nbytes for s in successor.sent), moved_state_bytes=moved_state,
        transfers=sum(1 for t in transfers if t.src != t.dst), plan=new)
    log.info("job %s: %s recovery from losing %s: resume at round %d on %d stages, %d bytes moved, %.2f s",
             driver.job.name, mode, ", ".join(report.failed) or "nobody", resume, len(new.stages),
             report.moved_bytes, report.recovery_s)
    return successor, report


GATHER_POLL_S = 0.1


def _wait_gathered(driver: JobDriver, at: str, round_index: int, units: int) -> None:
    """Wait until ``at`` holds every unit's state at the start of ``round_index`` (the senders have answered, but
    the last units may still be on their way); raises JobError after the driver's timeout."""
    deadline = time.monotonic() + driver.timeout_s
    while time.monotonic() < deadline:
        held = driver.inventory([at])[at]
        if len(held.snapshot_units(round_index)) >= units:
            return
        time.sleep(GATHER_POLL_S)
    raise JobError(f"job {driver.job.name}: {at} did not receive the whole model within {driver.timeout_s:.0f} s")


def grow(driver: JobDriver, joined: list[str], cluster: ClusterProfile, round_index: int,
         min_gain: float = 0.02) -> tuple[JobDriver, RecoveryReport] | None:
    """Add the devices ``joined`` to the job of ``driver`` at the start of round ``round_index`` (every device of
    the plan holds its snapshot of that round start). ``cluster`` profiles the plan's devices and the joined ones.
    The full planner runs on all of them; when its plan is not predicted at least ``min_gain`` (a fraction)
    faster than the current one, nothing changes and None is returned. Otherwise ``move_to`` the new plan (mode
    ``join``). Raises JobError from a device, DeviceLost if one fails meanwhile."""
    started = time.monotonic()
    old = driver.plan
    new = full_plan(old, cluster)
    if new.round_latency_s > old.round_latency_s * (1 - min_gain):
        log.info("job %s: %s joined, but the best plan with them (%.3f s per round) is no faster than the current "
                 "one (%.3f s): keeping it", driver.job.name, ", ".join(joined), new.round_latency_s,
                 old.round_latency_s)
        return None
    return move_to(driver, new, cluster, round_index, "join", joined=joined, started=started)


def move_to(driver: JobDriver, new: Plan, cluster: ClusterProfile, round_index: int, mode: RecoveryMode, *,
            joined: list[str] | None = None, started: float | None = None) -> tuple[JobDriver, RecoveryReport]:
    """Put the job of ``driver`` on plan ``new`` at the start of round ``round_index`` (every device of the old plan
    holds its snapshot of that round start; ``cluster`` profiles every device of both): every device of the new
    plan restores its units there, only the units whose owner changed moving. Returns the new driver and the report
    (``mode``: ``join`` for devices that appeared, ``rebalance`` for a re-plan on measured speeds; ``started`` is
    when the decision began, monotonic seconds). Raises JobError from a device, DeviceLost if one fails meanwhile."""
    started = time.monotonic() if started is None else started
    old = driver.plan
    replan_s = time.monotonic() - started
    transfers = plan_migration(old, new, set(), backup_map(old), unit_state_bytes(cluster, driver.job.optimizer.name))
    t0 = time.monotonic()
    successor = _successor(driver, new)
    successor.deploy(round_index, transfers)
    report = RecoveryReport(
        mode=mode, failed=[], joined=sorted(joined or []), interrupted_round=round_index, resume_round=round_index,
        epoch=new.epoch, replan_s=replan_s, restore_s=time.monotonic() - t0, recovery_s=time.monotonic() - started,
        moved_bytes=sum(s.nbytes for s in successor.sent), moved_state_bytes=sum(t.nbytes for t in transfers),
        transfers=len(transfers), plan=new)
    log.info("job %s: plan epoch %d (%s) at round %d: %d stages, %d bytes moved, %.2f s", driver.job.name, new.epoch,
             mode, round_index, len(new.stages), report.moved_bytes, report.recovery_s)
    return successor, report
