"""HPP's section of ``edgeswarm bench peers``: pipeline training beside ``torch.distributed.pipelining`` over gloo,
on the same devices, links, model, data and optimizer, in one run per cell.

A cell is a cluster in network namespaces: four Jetson Nanos (one class) or Asteroid's Env D (a TX2 and three
Nanos), at 100 Mbps. On it HPP trains the job ``bench training`` trains (its planned hybrid of pipeline and data
parallelism), then our pure pipeline (``pp``: a stage a device, boundaries by the profiled compute); then the peer
runs a stage a device at the pipeline plan's boundaries on the same devices (``hpp.peer_pipeline``: a
``PipelineStage`` each, GPipe's schedule over the same micro-batches, SGD at the same rate), each process in its
device's namespace, computing as its class. The row: samples a second, HPP against the peer; our pipeline's figure
beside (the same split on our runtime). Where the pipeline has four stages, torch's pipelining + DDP runs too: the
same four devices as two pipelines of two stages (the pipeline's boundaries taken two stages at a time), each
training half the batch, each stage's two replicas averaging gradients with DDP. The cross-check: the peer's first
round's gradients equal the model's on one device over the same micro-batches (to 1e-5 of the largest). Neither
runs HPP's own plan: torch's pipelining with DDP needs as many replicas of every stage, and HPP gives each stage its
own count.
"""

from __future__ import annotations

import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry, NetworkDefaults, load_cluster
from edgeswarm.errors import EdgeswarmError
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.workloads.commands import pipeline_cluster
from edgeswarm.workloads.peers import Figure, PeerRow, PeersConfig, PeerSection, run_ranks

if TYPE_CHECKING:
    from edgeswarm.bus import Bus
    from edgeswarm.hpp.bench_training import StrategyRun
    from edgeswarm.hpp.peer_pipeline import PipelineResult
    from edgeswarm.hpp.spec import JobSpec
    from edgeswarm.planning.hpp.types import Plan
    from edgeswarm.workloads.commands import BenchCluster, CommandTools

PEER = "torch pipelining (GPipe, gloo)"
PEER_DDP = "torch pipelining + DDP (2 pipelines x 2 stages, gloo)"
TOLERANCE = 1e-5  # the peer's gradients against one device's, over the largest
PEER_WAIT_S = 900.0


class PipelinePeers(PeerSection):
    name = "pipeline"
    title = "pipeline training: HPP against torch.distributed.pipelining over gloo"

    def run(self, config: PeersConfig, tools: CommandTools) -> list[PeerRow]:
        if config.quick:
            model, batch, micro, rounds = ModelSpec(name="lenet5", config={}), 16, 4, 2
            nanos = ClusterSpec(name="peers-pipeline-2-nano", description="2 Jetson Nanos at 1 Gbps",
                                devices=tuple(DeviceEntry(id=f"nano-{i}", device_class="jetson-nano")
                                              for i in range(2)),
                                network=NetworkDefaults(bandwidth_mbps=1000, latency_ms=0.5))
            cells = [("2 x Nano, 1000 Mbps", nanos)]
        else:
            model, batch, micro = ModelSpec(name="mobilenetv2", config={"image_size": 32, "num_classes": 10}), 64, 4
            rounds = max(3, config.requests + 1)
            env_d = load_cluster("asteroid-env-d-100mbps")
            nanos = env_d.model_copy(update={"name": "peers-pipeline-4-nano", "devices": tuple(
                DeviceEntry(id=f"nano-{i}", device_class="jetson-nano") for i in range(4))})
            cells = [("4 x Nano, 100 Mbps", nanos), ("Env D: TX2 + 3 Nano, 100 Mbps", env_d)]
        rows = []
        for cell, spec in cells:
            rows += self._cell(tools, cell, spec, model, batch, micro, rounds)
        return rows

    def _cell(self, tools: CommandTools, cell: str, spec: ClusterSpec, model: ModelSpec, batch: int, micro: int,
              rounds: int) -> list[PeerRow]:
        from edgeswarm.hpp.bench_training import bench_job

        row = PeerRow(section=self.name, cell=cell, metric="samples per second", ours="HPP", peer=PEER,
                      unit="samples/s", better="higher")
        classes = {d.id: d.device_class for d in spec.devices}
        tools.log(f"pipeline: {cell}: starting the cluster")
        try:
            with tempfile.TemporaryDirectory(prefix="edgeswarm-peers-profiles-") as profiles, \
                    pipeline_cluster(tools.cluster, spec, Path(profiles), netns=True, as_hub=True) as (running, bus):
                hpp_job, pp_job = (bench_job("peers", strategy, model, global_batch=batch, micro_batches=micro,
                                             rounds=rounds) for strategy in ("hpp", "pp"))
                hpp, _ = _train(bus, hpp_job, tools)
                pp, pp_plan = _train(bus, pp_job, tools)
                torch_peer = partial(run_peer, running, pp_plan, classes, model=model,
                                     data=pp_job.data.model_dump_json(), batch=batch, micro=micro, rounds=rounds - 1)
                tools.log(f"pipeline: {cell}: {PEER} at the pipeline's boundaries")
                peer = torch_peer()
                ddp = None
                if len(pp_plan.stages) == 4:
                    tools.log(f"pipeline: {cell}: {PEER_DDP}")
                    ddp = torch_peer(replicas=2)
        except EdgeswarmError as exc:
            return [row.model_copy(update={"error": str(exc)})]
        figures = [Figure(name="our pipeline (pp) on the same split", value=pp.measured_sps, unit="samples/s"),
                   Figure(name="HPP's stages", value=float(hpp.stages)),
                   Figure(name="HPP's predicted samples/s",
                          value=batch / hpp.predicted_round_s if hpp.predicted_round_s else None, unit="samples/s")]
        rows = [row.model_copy(update={"ours_value": hpp.measured_sps, "peer_value": peer.samples_per_s,
                                       "error": peer.error, "figures": figures, **_checked(peer, pp_plan, 1)})]
        if ddp is not None:
            rows.append(row.model_copy(update={"peer": PEER_DDP, "ours_value": hpp.measured_sps,
                                               "peer_value": ddp.samples_per_s, "error": ddp.error,
                                               "figures": figures, **_checked(ddp, pp_plan, 2)}))
        return rows


def _checked(peer: PipelineResult, plan: Plan, replicas: int) -> dict[str, object]:
    """The row's cross-check of ``peer``'s first round against one device's gradients."""
    if peer.max_difference is None or peer.scale is None:
        return {}
    layout = f"stages at units {_bounds(plan, replicas)}" + (f", {replicas} pipelines" if replicas > 1 else "")
    return {"checked": peer.max_difference <= TOLERANCE * max(1.0, peer.scale),
            "check": f"first round's gradients within {peer.max_difference:.1e} of one device's (largest "
                     f"{peer.scale:.2e}); {layout}"}


def _train(bus: Bus, job: JobSpec, tools: CommandTools) -> tuple[StrategyRun, Plan]:
    """Train ``job`` (a bench_training job) on the cluster; its figures and plan. Raises EdgeswarmError."""
    from edgeswarm.hpp.bench_training import Collect, summarize
    from edgeswarm.hpp.coordinator import run_job

    seen = Collect()
    run_job(bus, job, store_node=None, observer=seen, closed_loop=False)
    if seen.plan is None:
        raise EdgeswarmError(f"job {job.name} ran without a plan")
    run = summarize("peers", job.strategy, seen.plan, seen.reports, seen.refitted_rounds)
    tools.log(f"pipeline: {job.strategy}: {len(seen.plan.stages)} stages, {run.measured_sps or 0:.1f} samples/s")
    return run, seen.plan


def _bounds(plan: Plan, replicas: int = 1) -> str:
    """The pipeline's stage boundaries; with ``replicas`` pipelines over its devices, every ``replicas``-th (its
    stages merged in runs of ``replicas``)."""
    bounds = [s.start for s in plan.stages] + [plan.stages[-1].end]
    return ",".join(str(b) for b in bounds[::replicas])


def run_peer(running: BenchCluster, plan: Plan, classes: dict[str, str], *, model: ModelSpec, data: str, batch: int,
             micro: int, rounds: int, replicas: int = 1) -> PipelineResult:
    """One ``hpp.peer_pipeline`` process per stage of ``plan`` (a pipeline: a device a stage) on that device, in
    its namespace as its class; rank 0's result (``workloads.peers.run_ranks``). With ``replicas``, the same
    devices as that many pipelines of the plan's stages merged in runs of ``replicas`` (rank r: pipeline r //
    stages), DDP between each stage's replicas."""
    from edgeswarm.hpp.peer_pipeline import PipelineResult

    if any(len(s.devices) != 1 for s in plan.stages):
        raise EdgeswarmError(f"{PEER} runs a stage a device; the plan replicates a stage: {_bounds(plan)}")
    nodes = [s.devices[0] for s in plan.stages]

    def argv(rank: int, master: str, out: Path) -> list[str]:
        return [sys.executable, "-m", "edgeswarm.hpp.peer_pipeline", "--rank", str(rank), "--world", str(len(nodes)),
                "--master", master, "--model", model.model_dump_json(), "--data", data, "--bounds",
                _bounds(plan, replicas), "--global-batch", str(batch), "--micro-batches", str(micro), "--rounds",
                str(rounds), "--replicas", str(replicas),
                "--device-class", classes[nodes[rank]], "--out", str(out)]

    return run_ranks(running, nodes, argv, PipelineResult, name=PEER, wait_s=PEER_WAIT_S)
