"""What ``edgeswarm bench recovery`` measures (its command is ``hpp.bench``): drop each device of an emulated Env D in
turn, recover light and heavy, measure.

For every device and every recovery mode a fresh local cluster (Asteroid's Env D at 100 Mbps) trains the same job;
after a few rounds the device loses power (SIGKILL of all its services) in the middle of a round. The report gives
the detection time (last sign of life to the confirmed failure), the recovery time (confirmation to every stage
ready again: detection excluded), the state moved, and the measured throughput after the recovery. Light against
heavy in the same run gives the two figures of spec 5 (AC-19, AC-20): heavy recovery time over light, and light
throughput after recovery over heavy.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from edgeswarm.devices.cluster import load_cluster
from edgeswarm.errors import EdgeswarmError
from edgeswarm.hpp.coordinator import JobObserver, run_job
from edgeswarm.hpp.driver import RoundReport
from edgeswarm.hpp.recovery import RecoveryReport
from edgeswarm.hpp.spec import JobSpec, parse_job
from edgeswarm.planning.hpp.compare import Comparison
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.runtime.detection import Detection
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.workloads.commands import StartCluster, pipeline_cluster

DEFAULT_MODEL = ModelSpec(name="efficientnet-b1", config={"image_size": 32, "num_classes": 10})  # AC-20's model
KILL_FRACTION = 0.4  # how far into the round the device dies, as a fraction of the fastest round before


class RecoveryRun(BaseModel):
    """One device dropped under one recovery mode. Seconds and bytes; ``after_round_s`` is the mean measured
    round after the recovery (the replayed round left out), ``predicted_after_s`` the new plan's prediction.
    ``detection_s`` runs from the kill to the confirmed failure. ``error`` says why the run did not complete."""

    env: str
    victim: str
    mode: str
    stages_before: list[list[str]] = []
    stages_after: list[list[str]] = []
    detection_s: float | None = None
    recovery_s: float | None = None
    replan_s: float | None = None
    gather_s: float | None = None
    restore_s: float | None = None
    moved_bytes: int | None = None
    moved_state_bytes: int | None = None
    interrupted_round: int | None = None
    resume_round: int | None = None
    before_round_s: float | None = None
    after_round_s: float | None = None
    predicted_after_s: float | None = None
    after_sps: float | None = None
    error: str | None = None


class _Watch(JobObserver):
    """Kills ``victim``'s processes part-way into round ``kill_round`` and records what the job reports."""

    def __init__(self, kill: Callable[[], None], kill_round: int) -> None:
        self._kill, self.kill_round = kill, kill_round
        self.killed_at: float | None = None
        self.confirmed_at: float | None = None
        self.plan: Plan | None = None
        self.reports: list[RoundReport] = []
        self.recoveries: list[RecoveryReport] = []
        self.recovered_at = 0  # reports before the first recovery; the later ones ran on the new plan
        self.fired = False

    def planned(self, plan: Plan, comparison: Comparison | None, total_rounds: int) -> None:
        self.plan = plan

    def round_done(self, report: RoundReport) -> None:
        self.reports.append(report)
        if report.round == self.kill_round - 1 and not self.fired:
            self.fired = True
            # The fastest round so far, not the last: one slow round (a loaded machine) put the kill after the
            # job's end, and the run had no recovery to report.
            threading.Timer(KILL_FRACTION * min(r.round_s for r in self.reports), self.kill).start()

    def kill(self) -> None:
        self.killed_at = time.time()
        self._kill()

    def device_lost(self, failures: dict[str, Detection], round_index: int) -> None:
        if self.confirmed_at is None:
            self.confirmed_at = max(d.confirmed_at for d in failures.values())

    def recovered(self, report: RecoveryReport) -> None:
        if not self.recoveries:
            self.recovered_at = len(self.reports)
        self.recoveries.append(report)


def recovery_job(env: str, victim: str, mode: str, model: ModelSpec, *, global_batch: int, micro_batches: int,
                 rounds: int) -> JobSpec:
    """The job every run trains: the teacher task, momentum SGD (so optimizer state moves too), no checkpoints."""
    return parse_job({"name": f"recovery-{env}-{victim}-{mode}", "model": model.model_dump(),
                      "data": {"kind": "teacher", "size": 4 * global_batch, "test_size": global_batch},
                      "global_batch": global_batch, "micro_batches": micro_batches,
                      "optimizer": {"name": "momentum", "lr": 0.01, "momentum": 0.9}, "rounds": rounds,
                      "checkpoint_interval": 0, "recovery": mode})


def summarize(env: str, victim: str, mode: str, watch: _Watch) -> RecoveryRun:
    """The figures of one run from what its observer saw."""
    if not watch.recoveries or watch.plan is None:
        return RecoveryRun(env=env, victim=victim, mode=mode, error="the job ended without a recovery")
    rec = watch.recoveries[0]
    before = [r.round_s for r in watch.reports if 0 < r.round < rec.interrupted_round]
    # The reports after the recovery: the replayed round warms the new stages up, so it is left out.
    after = [r.round_s for r in watch.reports[watch.recovered_at:] if r.round > rec.resume_round]
    after_s = statistics.fmean(after) if after else None
    return RecoveryRun(
        env=env, victim=victim, mode=rec.mode, stages_before=[list(s.devices) for s in watch.plan.stages],
        stages_after=[list(s.devices) for s in rec.plan.stages],
        detection_s=watch.confirmed_at - watch.killed_at if watch.confirmed_at and watch.killed_at else None,
        recovery_s=rec.recovery_s, replan_s=rec.replan_s, gather_s=rec.gather_s, restore_s=rec.restore_s,
        moved_bytes=rec.moved_bytes, moved_state_bytes=rec.moved_state_bytes,
        interrupted_round=rec.interrupted_round, resume_round=rec.resume_round,
        before_round_s=statistics.fmean(before) if before else None, after_round_s=after_s,
        predicted_after_s=rec.plan.round_latency_s,
        after_sps=rec.plan.options.global_batch / after_s if after_s else None)


def run_recovery_bench(env: str = "d", *, victims: list[str] | None = None, modes: tuple[str, ...] = ("light", "heavy"),
                       model: ModelSpec = DEFAULT_MODEL, global_batch: int = 64, micro_batches: int = 4,
                       rounds: int = 9, kill_round: int = 3, profile_dir: Path, cluster: StartCluster,
                       log: Callable[[str], None] = lambda _m: None) -> list[RecoveryRun]:
    """Drop each device of ``env`` (all of them when ``victims`` is None) under every recovery mode, each on a
    fresh local cluster; profiles are cached in ``profile_dir``."""
    spec = load_cluster(f"asteroid-env-{env}-100mbps")
    nodes = [d.id for d in spec.devices]
    rows: list[RecoveryRun] = []
    for victim in victims or nodes:
        for mode in modes:
            job = recovery_job(env, victim, mode, model, global_batch=global_batch, micro_batches=micro_batches,
                               rounds=rounds)
            log(f"env {env}: {mode} recovery from losing {victim} during round {kill_round}")
            with pipeline_cluster(cluster, spec, profile_dir, as_hub=True) as (running, bus):
                watch = _Watch(lambda v=victim, c=running: c.power_cut(v), kill_round)
                try:
                    # Each mode starts from the same plan, and only the loss re-plans it.
                    run_job(bus, job, store_node=None, observer=watch, closed_loop=False)
                    row = summarize(env, victim, mode, watch)
                except EdgeswarmError as exc:
                    row = RecoveryRun(env=env, victim=victim, mode=mode, error=str(exc))
            log(f"env {env}: {mode}, {victim}: " + (row.error or (
                f"detected in {row.detection_s or 0:.2f} s, recovered in {row.recovery_s or 0:.2f} s, "
                f"{row.moved_bytes or 0} bytes moved, {row.after_round_s or 0:.3f} s per round after")))
            rows.append(row)
    return rows
