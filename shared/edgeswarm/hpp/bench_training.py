"""What ``edgeswarm bench training`` measures (its command is ``hpp.bench``): HPP and its baselines trained on emulated
Asteroid environments, measured.

For each environment (a local cluster of emulated devices at 100 Mbps) every strategy trains the same job for a few
rounds on the same runtime; the report gives measured samples/s, the measured/predicted round-time ratio, and the
runtime's own overhead per micro-batch (time a worker spends outside compute, blocking waits and the AllReduce:
reading data, slicing, queueing sends).

Emulated devices compute through ``DeviceProfile.run``, whose CPU-time scaling is exact only as far as the host runs
the same kernels equally fast each time; so each run also reports how the devices' measured compute compares with
their profiles (``compute_ratio``) and the round time the plan's own schedule gives with the measured compute put in
(``replayed_round_s``): measured against replayed is the runtime's and the network's share of any gap, compute_ratio
the emulated devices' share. ``refitted_round_s`` is the coordinator's own closed loop: the last round as the fit of
the rounds before it predicted it (planning.refit: each device's compute and each link fitted from measurement).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from edgeswarm.devices.cluster import load_cluster
from edgeswarm.errors import EdgeswarmError
from edgeswarm.hpp.coordinator import JobObserver, run_job
from edgeswarm.hpp.driver import RoundReport
from edgeswarm.hpp.spec import JobSpec, parse_job
from edgeswarm.planning.hpp.compare import Comparison
from edgeswarm.planning.hpp.schedule import plan_timeline
from edgeswarm.planning.hpp.types import Plan, Strategy
from edgeswarm.profiling.host_load import HostLoad, busy_text
from edgeswarm.profiling.verdict import Cell
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.workloads.commands import StartCluster, pipeline_cluster

STRATEGIES: tuple[Strategy, ...] = ("hpp", "dp", "pp", "single")
DEFAULT_MODEL = ModelSpec(name="mobilenetv2", config={"image_size": 32, "num_classes": 10})


class StrategyRun(BaseModel):
    """One strategy trained on one environment: plan shape, predicted and measured seconds per round (mean of
    the rounds after the first), measured samples/s, and the largest per-device runtime overhead per
    micro-batch (seconds); ``host_busy``, the fraction of the host's core time busy over the job
    (``profiling.host_load``). ``error`` says why it did not run."""

    env: str
    strategy: Strategy
    stages: int = 0
    devices: int = 0
    micro_batches: int = 0
    micro_batch_size: int = 0
    predicted_round_s: float | None = None
    measured_round_s: float | None = None
    measured_sps: float | None = None
    overhead_per_micro_batch_s: float | None = None
    compute_ratio: float | None = None
    replayed_round_s: float | None = None
    refitted_round_s: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    host_busy: float | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """Measured over predicted round time."""
        if self.measured_round_s is None or not self.predicted_round_s:
            return None
        return self.measured_round_s / self.predicted_round_s

    def cell(self) -> Cell | None:
        """This run as a cell of the benchmark's verdict (``profiling.verdict``); None when it did not train."""
        if self.ratio is None:
            return None
        refitted = (self.measured_round_s / self.refitted_round_s
                    if self.measured_round_s and self.refitted_round_s else None)
        return Cell(name=f"Env {self.env.upper()} {self.strategy}", ratio=self.ratio, refitted_ratio=refitted,
                    host_busy=self.host_busy)


class Collect(JobObserver):
    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.comparison: Comparison | None = None
        self.reports: list[RoundReport] = []
        self.refitted_rounds: list[float] = []  # the coordinator's refitted prediction after each round

    def refitted_round(self, seconds: float) -> None:
        self.refitted_rounds.append(seconds)

    def planned(self, plan: Plan, comparison: Comparison | None, total_rounds: int) -> None:
        self.plan, self.comparison = plan, comparison

    def round_done(self, report: RoundReport) -> None:
        self.reports.append(report)


def summarize(env: str, strategy: Strategy, plan: Plan, reports: list[RoundReport],
              refitted: list[float] | None = None) -> StrategyRun:
    """The figures of one run from its plan and round reports (the first round, which warms every device up,
    is left out of the times when there are others), and the coordinator's refitted predictions of its rounds (the
    last is the one the closed loop converged to)."""
    timed = reports[1:] if len(reports) > 1 else reports
    measured = statistics.fmean(r.round_s for r in timed)
    m = plan.options.micro_batches
    overhead = max(statistics.fmean(r.devices[d].overhead_s for r in timed) for d in plan.devices) / m
    # Compute against the plan: each stage's busiest device over the stage's predicted compute per round.
    ratios = []
    for stage in plan.stages:
        predicted = m * (stage.forward_s + stage.backward_s)
        busiest = max(statistics.fmean(r.devices[d].compute_s for r in timed) for d in stage.devices)
        ratios.append(busiest / predicted if predicted > 0 else 1.0)
    replayed = plan.model_copy(update={"stages": [
        stage.model_copy(update={"forward_s": stage.forward_s * k, "backward_s": stage.backward_s * k})
        for stage, k in zip(plan.stages, ratios, strict=True)]})
    return StrategyRun(env=env, strategy=strategy, stages=len(plan.stages), devices=len(plan.devices),
                       micro_batches=m, micro_batch_size=plan.options.micro_batch_size,
                       predicted_round_s=plan.round_latency_s, measured_round_s=measured,
                       measured_sps=plan.options.global_batch / measured, overhead_per_micro_batch_s=overhead,
                       compute_ratio=max(ratios),
                       replayed_round_s=plan_timeline(replayed).makespan_s + plan.round_overhead_s,
                       refitted_round_s=refitted[-1] if refitted else None,
                       first_loss=reports[0].loss,
                       last_loss=reports[-1].loss)


def bench_job(env: str, strategy: Strategy, model: ModelSpec, *, global_batch: int, micro_batches: int | None,
              rounds: int) -> JobSpec:
    """The job every strategy runs: the teacher task, SGD, no checkpoints."""
    return parse_job({"name": f"bench-{env}-{strategy}", "model": model.model_dump(),
                      "data": {"kind": "teacher", "size": 4 * global_batch, "test_size": global_batch},
                      "global_batch": global_batch, "micro_batches": micro_batches,
                      "optimizer": {"name": "sgd", "lr": 0.01}, "rounds": rounds, "strategy": strategy,
                      "checkpoint_interval": 0})


def run_training_bench(envs: list[str], *, model: ModelSpec = DEFAULT_MODEL, global_batch: int = 64,
                       micro_batches: int | None = 4, rounds: int = 4,
                       strategies: tuple[Strategy, ...] = STRATEGIES, profile_dir: Path, cluster: StartCluster,
                       netns: bool = False,
                       log: Callable[[str], None] = lambda _m: None) -> list[StrategyRun]:
    """Train ``model`` with every strategy on each of ``envs`` (a, b, c, d: Asteroid's environments at 100
    Mbps), one cluster per environment (started with ``cluster``); profiles are cached in ``profile_dir``."""
    rows: list[StrategyRun] = []
    for env in envs:
        with pipeline_cluster(cluster, load_cluster(f"asteroid-env-{env}-100mbps"), profile_dir,
                              netns=netns, as_hub=True) as (_running, bus):
            for strategy in strategies:
                job = bench_job(env, strategy, model, global_batch=global_batch, micro_batches=micro_batches,
                                rounds=rounds)
                seen = Collect()
                log(f"env {env}: {strategy}, {rounds} rounds")
                try:
                    # Every strategy planned on the profiles alone; the loop's refitted prediction is reported beside.
                    with HostLoad() as host:
                        run_job(bus, job, store_node=None, observer=seen, closed_loop=False)
                except EdgeswarmError as exc:
                    log(f"env {env}: {strategy} failed: {exc}")
                    rows.append(StrategyRun(env=env, strategy=strategy, error=str(exc)))
                    continue
                assert seen.plan is not None
                row = summarize(env, strategy, seen.plan, seen.reports, seen.refitted_rounds)
                row = row.model_copy(update={"host_busy": host.busy})
                log(f"env {env}: {strategy}: {row.measured_round_s:.3f} s per round measured, "
                    f"{row.predicted_round_s:.3f} s predicted, {row.replayed_round_s:.3f} s replayed with the "
                    f"measured compute ({row.compute_ratio or 0:.2f}x planned), "
                    f"overhead {1000 * (row.overhead_per_micro_batch_s or 0):.2f} ms per micro-batch; "
                    f"{busy_text(row.host_busy)}")
                rows.append(row)
    return rows
