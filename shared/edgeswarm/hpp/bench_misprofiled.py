"""What ``edgeswarm bench training --sections misprofiled`` measures: the closed loop correcting a profile that is
deliberately wrong about one device's speed and one link's.

On one emulated Asteroid environment a first job, with the closed loop on, learns what the devices and links take
in this cluster (the speeds it saves, in a profile cache of the bench's own: the user's saved speeds are not
touched); the plan the planner gives on those speeds is the correct plan. Then the speed saved for one device (the
one whose units the correct plan loads most) is made ``device_factor`` times faster than measured and one link's
(of the links the wrong plan's tensors cross, the one whose error costs most) ``link_factor`` times faster, and a
second job starts from them: it is planned on the wrong profile, measures, and re-plans itself through the running job's
re-plan path. The report gives the rounds at which it re-planned, whether it ended on the correct plan (and both
priced on the measured speeds), and its rounds on the last plan against what that plan predicted.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import BaseModel, Field

from edgeswarm.devices.cluster import load_cluster
from edgeswarm.errors import EdgeswarmError
from edgeswarm.hpp.bench_training import Collect, bench_job
from edgeswarm.hpp.coordinator import profile_batch_sizes, run_job
from edgeswarm.hpp.recovery import RecoveryReport
from edgeswarm.planning.hpp.compare import plan_best
from edgeswarm.planning.hpp.refit import predicted_compute_s, reprice
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.planning.refit import link_key, link_nodes, scaled
from edgeswarm.profiling.cache import ProfileCache
from edgeswarm.profiling.gather import profile_cluster
from edgeswarm.profiling.refits import MIN_ROUNDS, saved_scales
from edgeswarm.values.profiles import ClusterProfile, ComputeRefit, LinkRefit, ModelSpec
from edgeswarm.workloads.commands import StartCluster, pipeline_cluster


class Replan(BaseModel):
    """A re-plan of the running job: the round the new plan started at, its layout and what the loop said."""

    round: int
    layout: list[str]
    detail: str


class MisprofiledRun(BaseModel):
    """One environment's run. Seconds per round. ``*_true_s``: a plan priced on the speeds the first job measured
    (the correct profile); ``settled_round`` the first round on the last plan; ``after_*`` that plan's rounds after
    its first (a plan's first round is its stages' first), measured, as the plan predicted when it was chosen, and
    as the loop's refit of the rounds before each predicted it (mean). Speeds are measured over profiled, keyed by
    node or ``link_key``: ``learned`` the first job's (the correct profile), ``started_from`` the wrong ones the
    second job started from, ``saved`` what the next job would start from (what the second measured, blended with
    the wrong speeds as profiling.refits blends a history). ``error`` says why it did not run."""

    env: str
    device: str = ""
    device_factor: float
    link: str = ""
    link_factor: float
    correct_layout: list[str] = Field(default_factory=list)
    started_layout: list[str] = Field(default_factory=list)
    final_layout: list[str] = Field(default_factory=list)
    correct_true_s: float | None = None
    started_predicted_s: float | None = None
    started_true_s: float | None = None
    final_true_s: float | None = None
    replans: list[Replan] = Field(default_factory=list)
    learned: dict[str, float] = Field(default_factory=dict)
    started_from: dict[str, float] = Field(default_factory=dict)
    saved: dict[str, float] = Field(default_factory=dict)
    rounds_s: list[float] = Field(default_factory=list)
    refitted_s: list[float] = Field(default_factory=list)
    settled_round: int | None = None
    after_measured_s: float | None = None
    after_predicted_s: float | None = None
    after_refitted_s: float | None = None
    ended_on_correct: bool = False  # the last plan's stages are the correct plan's, up to devices of a class alike
    error: str | None = None


def layout(plan: Plan, names: Mapping[str, str] | None = None) -> list[str]:
    """Each stage of ``plan`` as "units START-END: devices", each device as ``names`` calls it (its class, say;
    then sorted) or by its node name."""
    if names is None:
        return [f"units {s.start}-{s.end}: {', '.join(s.devices)}" for s in plan.stages]
    return [f"units {s.start}-{s.end}: {', '.join(sorted(names[d] for d in s.devices))}" for s in plan.stages]


def crossed(plan: Plan) -> set[str]:
    """The links (``link_key``) ``plan``'s tensors cross: between neighbouring stages' devices, and within a stage's
    AllReduce group."""
    keys = {link_key(a, b) for s, t in zip(plan.stages, plan.stages[1:], strict=False)
            for a in s.devices for b in t.devices}
    keys |= {link_key(a, b) for s in plan.stages for a, b in itertools.combinations(s.devices, 2)}
    return keys


class _Watch(Collect):
    def __init__(self) -> None:
        super().__init__()
        self.replans: list[Replan] = []
        self.predicted: dict[int, float] = {}  # round a plan started at -> its prediction when chosen

    def rebalanced(self, report: RecoveryReport, detail: str) -> None:
        self.replans.append(Replan(round=report.resume_round, layout=layout(report.plan), detail=detail))
        self.predicted[report.resume_round] = report.plan.round_latency_s


def _wrong_link(truth: ClusterProfile, device: str, plan_on: Callable[[ClusterProfile], Plan],
                device_factor: float, link_factor: float, nodes: list[str]) -> str:
    """Of the links among ``nodes``, the one whose being priced ``link_factor`` times faster (beside ``device``
    priced ``device_factor`` times faster) gives the plan slowest on ``truth``: of the links that plan's tensors
    cross when any does (a link no tensor crosses cannot be measured)."""
    cost: dict[str, tuple[bool, float]] = {}
    for a, b in itertools.combinations(nodes, 2):
        key = link_key(a, b)
        wrong = plan_on(scaled(truth, {device: 1 / device_factor, key: 1 / link_factor}))
        cost[key] = (key in crossed(wrong), reprice(wrong, truth).round_latency_s)
    return max(cost, key=cost.__getitem__)


def run_misprofiled_bench(env: str, *, model: ModelSpec, global_batch: int, micro_batches: int | None,
                          learn_rounds: int = 6, rounds: int = 14, device_factor: float = 3.0,
                          link_factor: float = 5.0, profile_dir: Path, cluster: StartCluster, netns: bool = False,
                          log: Callable[[str], None] = lambda _m: None) -> MisprofiledRun:
    """The closed loop on a wrong profile (see the module's docstring), on Asteroid's environment ``env`` at 100
    Mbps: ``learn_rounds`` rounds learn the correct speeds, then ``rounds`` rounds start from speeds ``device_factor``
    times wrong about one device and ``link_factor`` times about one link. Profiles are cached in ``profile_dir``."""
    row = MisprofiledRun(env=env, device_factor=device_factor, link_factor=link_factor)
    spec = load_cluster(f"asteroid-env-{env}-100mbps")
    nodes = [d.id for d in spec.devices]
    classes = {d.id: d.device_class for d in spec.devices}
    with pipeline_cluster(cluster, spec, profile_dir, netns=netns, as_hub=True) as (_running, bus), \
            tempfile.TemporaryDirectory(prefix="edgeswarm-speeds-") as speeds_dir:
        speeds = ProfileCache(speeds_dir)
        learn = bench_job(env, "hpp", model, global_batch=global_batch, micro_batches=micro_batches,
                          rounds=learn_rounds).model_copy(update={"name": f"misprofiled-{env}-learn"})
        try:
            log(f"env {env}: learning the devices' and links' speeds, {learn_rounds} rounds")
            run_job(bus, learn, store_node=None, closed_loop=True, speeds_dir=Path(speeds_dir))
            raw = profile_cluster(bus, model, profile_batch_sizes(learn), nodes=nodes)
        except EdgeswarmError as exc:
            return row.model_copy(update={"error": f"learning the speeds: {exc}"})
        measured = saved_scales(speeds, raw, "train")
        truth = scaled(raw, measured)

        def plan_on(profile: ClusterProfile) -> Plan:
            return plan_best("hpp", profile, global_batch, micro_batches=micro_batches, optimizer=learn.optimizer.name)

        correct = plan_on(truth)
        # Its units' seconds, not the calls' cold costs: the loop does not fit a device whose units are a sliver of
        # the busiest's (ScaleFit.add), and a Nano given an MLP's last unit, priced mostly cold costs, was chosen,
        # never measured, and saved at the wrong speed it started from.
        loads = predicted_compute_s(correct, truth, cold=False)
        device = max(loads, key=loads.__getitem__)
        link = _wrong_link(truth, device, plan_on, device_factor, link_factor, nodes)
        entry = next(e for e in raw.devices if e.device.node == device)
        wrong = measured | {device: measured.get(device, 1.0) / device_factor,
                            link: measured.get(link, 1.0) / link_factor}
        speeds.put_refit(ComputeRefit(model_fingerprint=entry.compute.model_fingerprint, node=device,
                                      device_fingerprint=entry.compute.device_fingerprint, scale=wrong[device],
                                      rounds=MIN_ROUNDS, work="train"))
        pair = link_nodes(link)
        assert pair is not None
        speeds.put_link_refit(LinkRefit(a=min(pair), b=max(pair), scale=wrong[link], rounds=MIN_ROUNDS))
        row = row.model_copy(update={"device": device, "link": link, "correct_layout": layout(correct),
                                     "learned": measured, "started_from": wrong,
                                     "correct_true_s": reprice(correct, truth).round_latency_s})
        job = bench_job(env, "hpp", model, global_batch=global_batch, micro_batches=micro_batches,
                        rounds=rounds).model_copy(update={"name": f"misprofiled-{env}"})
        seen = _Watch()
        log(f"env {env}: {rounds} rounds from speeds {device_factor:g}x wrong about {device} and "
            f"{link_factor:g}x about {link}")
        try:
            result = run_job(bus, job, store_node=None, observer=seen, closed_loop=True, speeds_dir=Path(speeds_dir))
        except EdgeswarmError as exc:
            return row.model_copy(update={"error": str(exc)})
        saved = saved_scales(speeds, raw, "train")
    assert seen.plan is not None
    settled = seen.replans[-1].round if seen.replans else 0
    after = [r.round_s for r in seen.reports if r.round > settled]
    refitted = [s for r, s in zip(seen.reports, seen.refitted_rounds, strict=False) if r.round > settled]
    return row.model_copy(update={
        "started_layout": layout(seen.plan), "final_layout": layout(result.plan),
        "ended_on_correct": layout(result.plan, classes) == layout(correct, classes),
        "started_predicted_s": seen.plan.round_latency_s,
        "started_true_s": reprice(seen.plan, truth).round_latency_s,
        "final_true_s": reprice(result.plan, truth).round_latency_s,
        "replans": seen.replans, "rounds_s": [r.round_s for r in seen.reports], "refitted_s": seen.refitted_rounds,
        "saved": saved, "settled_round": settled,
        "after_measured_s": statistics.fmean(after) if after else None,
        "after_predicted_s": seen.predicted.get(settled, seen.plan.round_latency_s),
        "after_refitted_s": statistics.fmean(refitted) if refitted else None})
