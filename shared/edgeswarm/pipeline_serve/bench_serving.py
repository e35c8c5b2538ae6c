"""What ``edgeswarm bench serving`` measures (its command is ``pipeline_serve.bench``): pipelined serving on emulated
Asteroid environments, measured on the stage-workers.

For each environment (a local cluster of emulated devices at 100 Mbps) the same model is served three ways, one job
after the other, on the same runtime: as planned (``auto``: the best predicted of the paper's k-path placement, the
greedy-joint placement and the exact search, compute counted), with the greedy-joint placement alone, and on the
single best device (``max_stages: 1``). Each job gets a warm-up, then a stream of full micro-batches with enough
requests in flight to fill its pipeline; the report gives measured samples per second against the plan's prediction,
the per-request latency percentiles, and each variant's throughput over the single device's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from edgeswarm.bus import Bus
from edgeswarm.devices.cluster import load_cluster
from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages.jobs import JobState
from edgeswarm.pipeline_serve.client import infer_stream
from edgeswarm.pipeline_serve.spec import ServeProgress
from edgeswarm.planning.serve.load import at_outstanding
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.profiling.host_load import HostLoad, busy_text
from edgeswarm.profiling.verdict import Cell
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.workloads.client import JobFollower, cancel_job, submit_job
from edgeswarm.workloads.commands import StartCluster, pipeline_cluster

DEFAULT_MODEL = ModelSpec(name="mobilenetv2", config={"image_size": 32, "num_classes": 10})
VARIANTS: dict[str, dict[str, object]] = {"planned": {}, "greedy": {"method": "greedy"}, "single": {"max_stages": 1}}


class ServeRun(BaseModel):
    """One variant served on one environment: its plan's shape and prediction, the coordinator's refitted prediction
    after the stream (the plan priced on each stage's measured forward), the measured samples per second over the
    stream, and the clients' per-request latency percentiles (seconds) beside the plan's median latency predicted
    for the stream's load (``planning.serve.load.at_outstanding``). ``host_busy``: the fraction of the host's core
    time busy over the stream (``profiling.host_load``). ``error`` says why it did not run."""

    env: str
    variant: str
    stages: int = 0
    devices: list[str] = []
    bottleneck: str = ""
    predicted_per_s: float | None = None
    refitted_per_s: float | None = None
    measured_per_s: float | None = None
    p50_s: float | None = None
    predicted_p50_s: float | None = None
    p99_s: float | None = None
    requests: int = 0
    replayed: int = 0
    host_busy: float | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """Measured over predicted throughput."""
        if self.measured_per_s is None or not self.predicted_per_s:
            return None
        return self.measured_per_s / self.predicted_per_s

    def cell(self) -> Cell | None:
        """This run as a cell of the benchmark's verdict (``profiling.verdict``); None when it did not serve."""
        if self.ratio is None:
            return None
        refitted = self.measured_per_s / self.refitted_per_s if self.measured_per_s and self.refitted_per_s else None
        return Cell(name=f"Env {self.env.upper()} {self.variant}", ratio=self.ratio, refitted_ratio=refitted,
                    host_busy=self.host_busy)


def _state_after(follower: JobFollower, answered: int, *, timeout_s: float) -> JobState | None:
    """The job's first state that counts ``answered`` requests answered (its progress is published about every
    second), or its last state after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = follower.state
        if state is not None and state.progress_as(ServeProgress).answered >= answered:
            return state
        time.sleep(0.1)
    return follower.state


def _serve_variant(bus: Bus, env: str, variant: str, model: ModelSpec, *, micro_batch: int, requests: int,
                   window: int, log: Callable[[str], None]) -> ServeRun:
    from edgeswarm.models.zoo import example_input

    name = f"bench-serve-{env}-{variant}-{uuid.uuid4().hex[:4]}"
    spec = {"kind": "serve-pipeline", "name": name, "model": model.model_dump(), "micro_batch_size": micro_batch,
            "window": window, "planner": VARIANTS[variant]}
    follower = JobFollower(bus, name)
    submit_job(bus, json.dumps(spec), submission=follower.submission)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and (follower.state is None or follower.state.status not in (
            "running", "failed", "cancelled")):
        time.sleep(0.2)
    state = follower.state
    if state is None or state.status != "running" or not isinstance(state.plan, ServePlan):
        return ServeRun(env=env, variant=variant, error=f"not serving: {state.status if state else 'no state'} "
                                                        f"{state.detail if state else ''}".strip())
    plan = state.plan
    try:
        inputs = [example_input(model, micro_batch, seed=k) for k in range(16)]
        infer_stream(bus, name, [inputs[k % 16] for k in range(2 * window)], window=window)  # warm-up
        # The client keeps twice the job's window outstanding, so requests also queue at the coordinator.
        outstanding = 2 * window
        with HostLoad() as host:
            report = infer_stream(bus, name, [inputs[k % 16] for k in range(requests)], window=outstanding,
                                  timeout_s=300)
        failed = [r for r in report.results if r.outputs is None]
        if failed:
            return ServeRun(env=env, variant=variant, error=f"{len(failed)} requests failed: {failed[0].error}")
        latency = report.latency_s()
        assert latency is not None  # every request was answered
        final = _state_after(follower, 2 * window + len(report.results), timeout_s=10.0)
        refitted = final.progress_as(ServeProgress).refitted_throughput_per_s if final is not None else None
        row = ServeRun(env=env, variant=variant, stages=len(plan.stages), devices=plan.devices,
                       bottleneck=plan.bottleneck, predicted_per_s=plan.throughput_per_s, refitted_per_s=refitted,
                       measured_per_s=report.samples / report.wall_s, p50_s=latency[0], p99_s=latency[1],
                       predicted_p50_s=at_outstanding(plan, outstanding, window).latency_s,
                       requests=len(report.results), replayed=sum(r.replayed for r in report.results),
                       host_busy=host.busy)
        log(f"env {env}: {variant}: {row.stages} stages on {', '.join(row.devices)}: {row.measured_per_s:.1f} "
            f"samples/s measured, {row.predicted_per_s:.1f} predicted ({row.ratio or 0:.2f}x); p50 "
            f"{row.p50_s * 1000:.0f} ms ({(row.predicted_p50_s or 0) * 1000:.0f} predicted), p99 "
            f"{row.p99_s * 1000:.0f} ms; {busy_text(row.host_busy)}")
        return row
    finally:
        cancel_job(bus, name)
        follower.wait(60)


def run_serving_bench(envs: list[str], *, model: ModelSpec = DEFAULT_MODEL, micro_batch: int = 8,
                      requests: int = 200, window: int = 8, variants: tuple[str, ...] = tuple(VARIANTS),
                      profile_dir: Path, cluster: StartCluster, netns: bool = False,
                      log: Callable[[str], None] = lambda _m: None) -> list[ServeRun]:
    """Serve ``model`` in every variant on each of ``envs`` (a, b, c, d: Asteroid's environments at 100 Mbps),
    one cluster per environment started with ``cluster``; profiles are cached in ``profile_dir``."""
    rows: list[ServeRun] = []
    for env in envs:
        with pipeline_cluster(cluster, load_cluster(f"asteroid-env-{env}-100mbps"), profile_dir,
                              netns=netns) as (_running, bus):
            for variant in variants:
                log(f"env {env}: serving {model.name} ({variant})")
                try:
                    rows.append(_serve_variant(bus, env, variant, model, micro_batch=micro_batch, requests=requests,
                                               window=window, log=log))
                except EdgeswarmError as exc:
                    log(f"env {env}: {variant} failed: {exc}")
                    rows.append(ServeRun(env=env, variant=variant, error=str(exc)))
    return rows
