"""What ``edgeswarm bench splitfed`` measures (its command is ``splitfed.bench``): SmartSplit against FedAvg and
SplitFed (spec 10, acceptance checks U6, I1, I2, I5, I6 and the accuracy comparison), every figure measured or
computed in the run that prints it.

Sections:

- ``planner``: the BO quality check (U6) on seeded random instances, and on the paper's fleet (100 phones of
  Table I under 5 MECs, ``synthetic.paper_devices``) with each model's ``ModelCost`` profiled at CIFAR 32x32, batch
  32: the predicted round time of SmartSplit, FedAvg (``local_only``) and SplitFed (``fixed_cut``, one cloud
  server), the WAN bytes of a round, and how many of K participants each method gets when every budget is capped.
- ``memory``: the device's peak training memory measured by the runtime (``memory.measure_device_memory``, one
  U-split iteration) at the cut of least modelled memory against whole-model local training (I1).
- ``accuracy``: the in-process simulation (``splitfed.simulation``) of the three methods at the paper's scale on
  the ``digits`` data, held-out accuracy after the same number of rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.errors import EdgeswarmError
from edgeswarm.planning.splitfed.cost import cut_costs, effective_tail, iterations
from edgeswarm.planning.splitfed.plan import plan_round
from edgeswarm.planning.splitfed.quality import BoQuality, bo_quality
from edgeswarm.planning.splitfed.scheduling import fine_select
from edgeswarm.planning.splitfed.synthetic import paper_devices
from edgeswarm.planning.splitfed.types import (
    DeviceCut,
    ModelCost,
    SplitDevice,
    SplitMec,
    SplitOptions,
    SplitPlanError,
    SplitSelection,
)
from edgeswarm.profiling.host_load import TickLog
from edgeswarm.profiling.verdict import Cell

if TYPE_CHECKING:
    from edgeswarm.bus import Bus
    from edgeswarm.messages.jobs import JobState
    from edgeswarm.values.profiles import ModelSpec
    from edgeswarm.workloads.commands import StartCluster

SECTIONS = ("planner", "memory", "accuracy", "cluster")
MODELS = ("lenet5", "resnet18", "vgg16")
METHODS = ("smartsplit", "fedavg", "splitfed")
BATCH = 32
MIB = 1 << 20
CLOUD = "cloud"
# SplitFed's one cut for every device, per model: after the first convolution block (LeNet-5's first pooling, as
# the cluster's default; ResNet-18's stem; VGG16's first conv+ReLU pair).
SPLITFED_CUT = {"lenet5": 3, "resnet18": 3, "vgg16": 2}
Log = Callable[[str], None]


class SplitfedBenchConfig(BaseModel):
    """What ``edgeswarm bench splitfed`` runs: ``sections``, ``seeds`` (the planner and simulation repeat per
    seed), the U6 ``instances``, the models, K ``participants``, local ``epochs`` of the planned rounds, the I6
    ``cap_bytes``, and the simulation's ``rounds``, ``local_epochs``, ``lr`` and ``settings``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sections: list[str] = Field(default_factory=lambda: list(SECTIONS))
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, max_length=16)
    instances: int = Field(default=50, ge=1, le=1000)
    models: list[str] = Field(default_factory=lambda: list(MODELS))
    participants: int = Field(default=10, ge=1, le=100)
    epochs: int = Field(default=5, ge=1, le=20)
    cap_bytes: int = Field(default=256 * MIB, ge=1)
    cap_model: str = "vgg16"
    rounds: int = Field(default=20, ge=1, le=500)
    local_epochs: int = Field(default=5, ge=1, le=10)
    lr: float = Field(default=0.05, gt=0.0)
    settings: list[str] = Field(default_factory=lambda: ["dirichlet-0.1", "dirichlet-1.0", "label-skew-2"])
    devices: int = Field(default=100, ge=2, le=1000)
    mecs: int = Field(default=5, ge=1, le=100)
    memory_models: list[str] = Field(default_factory=lambda: list(MODELS))
    cluster_rounds: int = Field(default=3, ge=1, le=50)
    cluster_budget_bytes: int = Field(default=0, ge=0)
    netns: bool = False  # the cluster section in network namespaces, its links shaped by the kernel


class PlannerRow(BaseModel):
    """One (model, method, seed) on the paper's fleet: the planned round's participants, predicted round time
    (seconds, Eq. 5), the bytes a round moves over the WAN (cloud to MECs or devices) and the LAN (devices to
    their MEC), the cuts used, and why it could not plan (``error``)."""

    model: str
    method: str
    seed: int
    participants: int = 0
    round_s: float | None = None
    wan_bytes: int = 0
    lan_bytes: int = 0
    cuts: list[int] = []
    error: str | None = None


class CapRow(BaseModel):
    """I6: with every budget capped at ``cap_bytes``, how many of K each method trains, and how many devices
    could train at all."""

    model: str
    method: str
    seed: int
    cap_bytes: int
    participants: int
    eligible: int
    error: str | None = None


class MemoryRow(BaseModel):
    """I1 for one model: the cut of least modelled device memory against whole-model training (cut V-h), both
    measured (bytes) and modelled by the planner's memory model."""

    model: str
    units: int
    cut: int
    split_peak_bytes: int
    local_peak_bytes: int
    split_model_bytes: int
    local_model_bytes: int
    ratio: float
    seconds: float


class AccuracyRow(BaseModel):
    """One (setting, method, seed) of the simulation: held-out accuracy after ``rounds`` rounds (and per round),
    the mean participants a round, devices that could never train (budget below the method's footprint)."""

    setting: str
    method: str
    seed: int
    rounds: int
    accuracy: float
    accuracies: list[float]
    mean_participants: float
    excluded_devices: int
    seconds: float


class ClusterRow(BaseModel):
    """One round of a train-splitfed job on the local cluster (3 native devices, 1 edge server): the mode, the
    measured, predicted and refitted round time (seconds; see RoundRecord), the bytes on the MEC's LAN and the WAN,
    held-out accuracy and loss, the largest device peak (bytes) among its trainers, their cuts, the fraction of the
    host's core time busy over about the round (``profiling.host_load``: the round's length up to when its record
    arrived), and why the job failed (``error``)."""

    mode: str
    round: int = 0
    round_s: float = 0.0
    predicted_s: float = 0.0
    refitted_s: float | None = None
    lan_bytes: int = 0
    wan_bytes: int = 0
    accuracy: float | None = None
    loss: float | None = None
    peak_bytes: int = 0
    cuts: list[int] = []
    host_busy: float | None = None
    error: str | None = None

    def cell(self) -> Cell | None:
        """This round as a cell of the benchmark's verdict (``profiling.verdict``); None for a failed job's row."""
        if self.error is not None or self.predicted_s <= 0 or self.round_s <= 0:
            return None
        return Cell(name=f"{self.mode} round {self.round}", ratio=self.round_s / self.predicted_s,
                    refitted_ratio=self.round_s / self.refitted_s if self.refitted_s else None,
                    host_busy=self.host_busy)


class SplitfedReport(BaseModel):
    """Everything the bench measured."""

    config: SplitfedBenchConfig
    quality: list[BoQuality] = []
    planner: list[PlannerRow] = []
    cap: list[CapRow] = []
    memory: list[MemoryRow] = []
    accuracy: list[AccuracyRow] = []
    cluster: list[ClusterRow] = []
    budget_note: str = ""


def _quiet(_: str) -> None:
    return None


def run_splitfed_bench(config: SplitfedBenchConfig, log: Log = _quiet, cluster: StartCluster | None = None
                       ) -> SplitfedReport:
    """Run the configured sections in order (see the module's docstring) and return every figure. The ``cluster``
    section starts its cluster with ``cluster`` (EdgeswarmError without one)."""
    report = SplitfedReport(config=config)
    if "planner" in config.sections:
        log("planner: BO quality")
        report.quality = [bo_quality(instances=config.instances, seed=s) for s in config.seeds]
        costs = {m: profile(m) for m in dict.fromkeys(config.models + [config.cap_model])}
        for seed in config.seeds:
            for m in config.models:
                log(f"planner: {m} seed {seed}")
                report.planner.extend(plan_methods(costs[m], m, seed, config))
            report.cap.extend(cap_rows(costs[config.cap_model], config.cap_model, seed, config))
    if "memory" in config.sections:
        for m in config.memory_models:
            log(f"memory: {m}")
            report.memory.append(memory_row(m))
    if "accuracy" in config.sections:
        import torch

        from edgeswarm.splitfed.simulation import BUDGET_NOTE

        report.budget_note = BUDGET_NOTE
        # LeNet-5 on batches of a dozen samples: torch's intra-op threads only contend (17x slower with 2
        # threads than 1 on the shared 2-core VM).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _simulate_all(config, report, log)
        finally:
            torch.set_num_threads(threads)
    if "cluster" in config.sections:
        if cluster is None:
            raise EdgeswarmError("the cluster section needs a way to start a cluster (edgeswarm bench has one)")
        report.cluster = cluster_rows(config, cluster, log)
    return report


def _simulate_all(config: SplitfedBenchConfig, report: SplitfedReport, log: Log) -> None:
    from edgeswarm.splitfed.simulation import SimulationConfig, simulate

    for seed in config.seeds:
        for setting in config.settings:
            for method in METHODS:
                log(f"accuracy: {setting} {method} seed {seed}")
                started = time.monotonic()
                result = simulate(SimulationConfig(
                    method=method, setting=setting, seed=seed, rounds=config.rounds,
                    local_epochs=config.local_epochs, lr=config.lr, devices=config.devices, mecs=config.mecs,
                    participants=config.participants))
                report.accuracy.append(AccuracyRow(
                    setting=setting, method=method, seed=seed, rounds=config.rounds,
                    accuracy=result.accuracies[-1], accuracies=result.accuracies,
                    mean_participants=float(np.mean(result.participants)),
                    excluded_devices=result.excluded_devices, seconds=time.monotonic() - started))
                log(f"accuracy: {setting} {method} seed {seed}: {100 * result.accuracies[-1]:.1f}%")


# --- planner ---------------------------------------------------------------------------------------------------


def spec_of(model: str) -> ModelSpec:
    """Zoo model ``model`` on CIFAR-10 input (3 x 32 x 32, 10 classes): LeNet-5 defaults to one channel."""
    from edgeswarm.values.profiles import ModelSpec

    return ModelSpec(name=model, config={"in_channels": 3} if model == "lenet5" else {})


def profile(model: str) -> ModelCost:
    """The planner's ModelCost of ``spec_of(model)``, batch BATCH, momentum SGD."""
    from edgeswarm.splitfed.profiling import model_cost

    return model_cost(spec_of(model), BATCH, optimizer_states=1)


def method_options(method: str, model: str, seed: int, config: SplitfedBenchConfig, gamma: float = 1.0,
                   ) -> SplitOptions:
    """The options each method plans with, as the coordinator sets them: SmartSplit's U-split with BO, FedAvg's
    local training, SplitFed's vanilla split at SPLITFED_CUT."""
    base = SplitOptions(participants=config.participants, gamma=gamma if method == "smartsplit" else 1.0,
                        epochs=config.epochs, seed=seed)
    if method == "fedavg":
        return base.model_copy(update={"local_only": True})
    if method == "splitfed":
        return base.model_copy(update={"fixed_cut": SPLITFED_CUT.get(model, 3), "tail": 0,
                                       "latency_model": "vanilla"})
    return base


def _fleet(seed: int, config: SplitfedBenchConfig) -> tuple[list[SplitDevice], list[SplitMec]]:
    return paper_devices(np.random.default_rng(seed), per_type=max(1, config.devices // 5), mecs=config.mecs)


def _to_cloud(devices: list[SplitDevice], mecs: list[SplitMec]) -> tuple[list[SplitDevice], list[SplitMec]]:
    """SplitFed's server is one cloud server (an MEC-class GPU) shared by every participant."""
    return ([d.model_copy(update={"mec": CLOUD}) for d in devices],
            [SplitMec(node=CLOUD, speed_flops=max(m.speed_flops for m in mecs))])


def plan_methods(cost: ModelCost, model: str, seed: int, config: SplitfedBenchConfig) -> list[PlannerRow]:
    """Plan one round of each method on the paper's fleet (seeded) with gamma 1 (K devices each, so the round
    times compare the same number of participants) and count its bytes: SmartSplit's WAN is the global model to
    and from each MEC that trains someone; its devices' U-split traffic and model sync stay on the LAN. FedAvg's
    and SplitFed's server is the cloud: FedAvg's devices send and receive the whole model over the WAN, SplitFed's
    their part and every iteration's activations and gradients."""
    devices, mecs = _fleet(seed, config)
    model_bytes = sum(u.param_bytes for u in cost.units)
    rows = []
    for method in METHODS:
        options = method_options(method, model, seed, config)
        devs, servers = _to_cloud(devices, mecs) if method == "splitfed" else (devices, mecs)
        try:
            sel = plan_round(cost, devs, servers, options)
        except (SplitPlanError, EdgeswarmError) as exc:
            rows.append(PlannerRow(model=model, method=method, seed=seed, error=str(exc)[:300]))
            continue
        costs = cut_costs(cost, options)
        samples = {d.node: d.samples for d in devs}
        per_device = [2 * int(costs.device_params[c.cut - 1])
                      + iterations(samples[c.node], cost.batch_size, options.epochs)
                      * int(costs.transfer_bytes[c.cut - 1]) for c in sel.selected]
        if method == "smartsplit":
            wan, lan = 2 * model_bytes * len({c.mec for c in sel.selected}), sum(per_device)
        else:
            wan, lan = sum(per_device), 0
        rows.append(PlannerRow(model=model, method=method, seed=seed, participants=len(sel.selected),
                               round_s=sel.t_system_s, wan_bytes=wan, lan_bytes=lan,
                               cuts=sorted({c.cut for c in sel.selected})))
    return rows


def cap_rows(cost: ModelCost, model: str, seed: int, config: SplitfedBenchConfig) -> list[CapRow]:
    """I6: every device's budget capped at ``config.cap_bytes``; SmartSplit plans gamma*K candidates and its MECs
    keep K by Algorithm 2 (epsilon 0: by Stat), the baselines pick K at random among the devices their footprint
    fits."""
    devices, mecs = _fleet(seed, config)
    devices = [d.model_copy(update={"budget_bytes": min(d.budget_bytes, config.cap_bytes)}) for d in devices]
    rows = []
    for method in METHODS:
        options = method_options(method, model, seed, config, gamma=2.0)
        devs, servers = _to_cloud(devices, mecs) if method == "splitfed" else (devices, mecs)
        try:
            sel = plan_round(cost, devs, servers, options)
        except (SplitPlanError, EdgeswarmError) as exc:
            rows.append(CapRow(model=model, method=method, seed=seed, cap_bytes=config.cap_bytes, participants=0,
                               eligible=0, error=str(exc)[:300]))
            continue
        trained = _fine(sel, devs, config.participants, seed) if method == "smartsplit" else sel.selected
        rows.append(CapRow(model=model, method=method, seed=seed, cap_bytes=config.cap_bytes,
                           participants=len(trained), eligible=len(devs) - len(sel.infeasible)))
    return rows


def _fine(sel: SplitSelection, devices: list[SplitDevice], k: int, seed: int) -> list[DeviceCut]:
    return fine_select(sel.selected, devices, k, 0.0, np.random.default_rng(seed))


# --- memory ----------------------------------------------------------------------------------------------------


def memory_row(model: str) -> MemoryRow:
    """I1: measure the device side of one U-split iteration at the cut of least modelled device memory and at
    cut V-h (the whole model on the device), batch BATCH at the model's default input."""
    from edgeswarm.splitfed.memory import measure_device_memory
    from edgeswarm.splitfed.split import split_point

    spec = spec_of(model)
    cost = profile(model)
    options = SplitOptions()
    tail = effective_tail(cost, options)
    modelled = cut_costs(cost, options).memory
    cut = int(np.argmin(modelled)) + 1
    last = len(cost.units) - tail
    started = time.monotonic()
    split = measure_device_memory(spec, split_point(spec, cut, tail), BATCH).peak_bytes
    local = measure_device_memory(spec, split_point(spec, last, tail), BATCH).peak_bytes
    return MemoryRow(model=model, units=len(cost.units), cut=cut, split_peak_bytes=split, local_peak_bytes=local,
                     split_model_bytes=int(modelled[cut - 1]), local_model_bytes=int(modelled[last - 1]),
                     ratio=local / max(1, split), seconds=time.monotonic() - started)


# --- summaries the CLI prints ----------------------------------------------------------------------------------


def mean_of(values: list[float]) -> float | None:
    """The mean, or None for no values (a method that could not plan on any seed)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


# --- cluster ---------------------------------------------------------------------------------------------------

# SmartSplit's phones (its Table I: the slowest, a middle one and the fastest) on their emulated Wi-Fi links, and an
# edge server. Emulated classes compute on one thread each, slowed as their class says; native devices on one host
# would share its cores with each other and the edge server while each was profiled alone, so no prediction could
# hold for them (3 native devices on 2 cores: local steps 2x their profile).
CLUSTER_CLASSES = ("redmi-2", "honor-8", "pixel-6")
CLUSTER_DEVICES = len(CLUSTER_CLASSES)
CLUSTER_MODES = ("smartsplit", "fedavg", "splitfed")


def cluster_rows(config: SplitfedBenchConfig, cluster: StartCluster, log: Log = _quiet) -> list[ClusterRow]:
    """Run each mode as a train-splitfed job of ``config.cluster_rounds`` rounds on one local cluster of the
    CLUSTER_CLASSES phones and an edge server (LeNet-5 on digits, 2 participants a round, a Dirichlet 0.5 split),
    every device's budget ``config.cluster_budget_bytes``, and read each round's record from the job state. A mode
    that fails is one row with its error."""
    import tempfile
    from pathlib import Path

    from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry

    spec = ClusterSpec(name="smartsplit-phones", description="SmartSplit's phones and an edge server",
                       devices=tuple(DeviceEntry(id=f"{c}-{i}", device_class=c)
                                     for i, c in enumerate(CLUSTER_CLASSES)),
                       edges=(DeviceEntry(id="edge-0", device_class="edge-server"),))
    with tempfile.TemporaryDirectory(prefix="bench-splitfed-") as tmp:
        root = Path(tmp)
        env = {"EDGESWARM_CHECKPOINT_DIR": str(root / "checkpoints"), "EDGESWARM_PROFILE_DIR": str(root / "profiles")}
        log(f"cluster: starting {', '.join(CLUSTER_CLASSES)} and an edge server")
        try:
            with cluster(spec, workdir=root / "cluster", extra_env=env, skip_services=("tensor-shard-worker",),
                         netns=config.netns, timeout_s=300) as (_running, bus):
                return [row for mode in CLUSTER_MODES for row in _cluster_mode(bus, mode, config, log)]
        except EdgeswarmError as exc:  # the cluster did not come up
            return [ClusterRow(mode=m, error=str(exc)[:300]) for m in CLUSTER_MODES]


def _cluster_mode(bus: Bus, mode: str, config: SplitfedBenchConfig, log: Log) -> list[ClusterRow]:
    """One train-splitfed job of ``mode`` on the cluster ``bus`` reaches: a row per round, or one with its error."""
    job = {"kind": "train-splitfed", "name": f"bench-sf-{mode}", "mode": mode, "rounds": config.cluster_rounds,
           "participants": 2, "partition": {"kind": "dirichlet", "devices": CLUSTER_DEVICES, "alpha": 0.5, "seed": 1},
           "training": {"epochs": 1, "batch_size": 32, "lr": 0.05}, "wait_s": 30, "seed": 0,
           "memory_budget_bytes": config.cluster_budget_bytes}
    log(f"cluster: {mode}")
    return job_rows(bus, job, log)


def job_rows(bus: Bus, job: dict[str, object], log: Log = _quiet, timeout_s: float = 600.0,
             on_state: Callable[[JobState], None] | None = None) -> list[ClusterRow]:
    """Submit ``job`` (a train-splitfed job's fields) to the cluster ``bus`` reaches and wait for it: a row per
    round from its state, or one row with its error (after ``timeout_s`` seconds at the latest). ``on_state`` sees
    every state the job publishes, as it comes."""
    import json

    from edgeswarm.splitfed.spec import SplitfedProgress
    from edgeswarm.workloads.client import JobFollower, submit_job

    mode, name = str(job["mode"]), str(job["name"])
    arrived: dict[int, float] = {}  # round -> when its record first arrived (time.monotonic)

    def seen(state: JobState) -> None:
        now = time.monotonic()
        if isinstance(state.progress, SplitfedProgress):
            for rec in state.progress.history:
                arrived.setdefault(rec.round, now)
        if on_state is not None:
            on_state(state)

    follower = JobFollower(bus, name, on_state=seen,
                           on_event=lambda e: log(f"{name}: {e.detail}") if e.kind in ("refit", "profiling") else None)
    with TickLog() as ticks:
        submit_job(bus, json.dumps(job), submission=follower.submission)
        try:
            state = follower.wait(timeout_s)
        except EdgeswarmError as exc:
            return [ClusterRow(mode=mode, error=str(exc)[:300])]
    progress = state.progress_as(SplitfedProgress)
    if not progress.history:
        return [ClusterRow(mode=mode, error=f"{state.status}: {state.detail}"[:300])]
    rows = []
    for rec in progress.history:
        trained = [p for p in rec.participants if p.outcome == "trained"]
        end = arrived.get(rec.round)
        rows.append(ClusterRow(mode=mode, round=rec.round, round_s=rec.round_s, predicted_s=rec.predicted_s,
                               refitted_s=rec.refitted_s, loss=rec.loss,
                               lan_bytes=rec.lan_bytes, wan_bytes=rec.wan_bytes, accuracy=rec.accuracy,
                               peak_bytes=max((p.peak_bytes for p in trained), default=0),
                               cuts=sorted({p.cut for p in trained}),
                               host_busy=None if end is None else ticks.busy_between(end - rec.round_s, end)))
    return rows
