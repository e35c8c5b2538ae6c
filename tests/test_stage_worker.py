"""Stage-workers over the real broker: a 2-stage HPP round with uneven groups equals single-process training."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from edgeswarm import topics
from edgeswarm.checkpoints.store import CheckpointStore
from edgeswarm.data import open_dataset
from edgeswarm.data.base import round_sample_ids
from edgeswarm.hpp.evaluation import accuracy
from edgeswarm.messages.training import (
    RoundDone,
    RoundStart,
    StageAssign,
    StageFailed,
    StageReady,
    StageSave,
    StageSaved,
    StageTensor,
)
from edgeswarm.models.zoo import build_model
from edgeswarm.state.units import model_state
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec, OptimizerSpec
from helpers import ask_stage_workers, stored_weights, wait_until

MLP = ModelSpec(name="mlp", config={"hidden": 64, "layers": 2, "seed": 3})
DATA = DatasetSpec(kind="teacher", size=512, test_size=64)
M, B, LR = 4, 64, 0.5
# (groups, shares per micro-batch, unit ranges) of AC-13's plans on five workers: HPP with uneven groups of two
# and three, pure DP with uneven shares, and a straight pipeline.
LAYOUTS = {
    "hpp": ([["w0", "w1"], ["w2", "w3", "w4"]], [[40, 24], [32, 16, 16]], [(0, 3), (3, 6)]),
    "dp": ([["w0", "w1", "w2", "w3", "w4"]], [[20, 12, 16, 8, 8]], [(0, 6)]),
    "pp": ([["w0"], ["w1"], ["w2"]], [[64], [64], [64]], [(0, 2), (2, 4), (4, 6)]),
}


@pytest.mark.parametrize("strategy", list(LAYOUTS))
def test_a_round_over_mqtt_equals_single_process_training(strategy: str, broker, make_bus, services,
                                                          tmp_path: Path) -> None:
    """AC-13 with worker processes and Mosquitto: after one round of each plan the saved weights equal one
    process's SGD step on the same 256 samples."""
    groups, shares, ranges = LAYOUTS[strategy]
    store_dir = tmp_path / "checkpoints"
    services.start("checkpoint-store", "hub", broker.url, EDGESWARM_CHECKPOINT_DIR=str(store_dir))
    procs = {node: services.start("stage-worker", node, broker.url) for group in groups for node in group}
    client = make_bus("coordinator-test", "cli")
    for node in ("hub", *procs):
        client.peers.wait_for(node, "checkpoint-store" if node == "hub" else "stage-worker", timeout_s=30)

    assigns = {}
    for p, group in enumerate(groups):
        for r, node in enumerate(group):
            assigns[node] = StageAssign(job_id="j1", epoch=0, stage=p, rank=r, model=MLP, start=ranges[p][0],
                                        end=ranges[p][1], groups=groups, shares=shares, micro_batches=M,
                                        warmup=min(2 * (len(groups) - p) - 1, M), loss_scale=1.0 / (M * B),
                                        optimizer=OptimizerSpec(name="sgd", lr=LR), data=DATA)
    ready = ask_stage_workers(client, assigns, 60)
    assert all(isinstance(r.body, StageReady) for r in ready.values()), ready

    # A tensor for another epoch is dropped with an error, not used.
    client.send_tensor("w2", "stage-worker", StageTensor(job_id="j1", epoch=7, round=0, stage=1, kind="activation",
                                                         sender=0), np.zeros((20, 64), dtype=np.float32))
    done = ask_stage_workers(client, {node: RoundStart(job_id="j1", epoch=0, round=0) for node in assigns}, 120)
    assert all(isinstance(d.body, RoundDone) for d in done.values()), {n: d.body for n, d in done.items()}
    last = [d.body for n, d in done.items() if n in groups[-1]]
    assert sum(d.terms for d in last) == M * B
    assert all(d.peak_live <= min(2 * (len(groups) - d.stage) - 1, M) for d in (x.body for x in done.values()))

    saved = ask_stage_workers(client, {group[-1]: StageSave(job_id="j1", epoch=0, store_node="hub", version=1)
                              for group in groups}, 60)
    assert all(isinstance(s.body, StageSaved) for s in saved.values()), saved

    # The same round in one process: single-device SGD on the same 256 samples.
    dataset = open_dataset(DATA, MLP)
    x, y = dataset.batch(round_sample_ids(0, M * B, dataset.train_size, 0))
    reference = copy.deepcopy(build_model(MLP))
    loss = torch.nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    with torch.no_grad():
        for param in reference.parameters():
            param -= LR * param.grad
    assert sum(d.loss_sum for d in last) / (M * B) == pytest.approx(float(loss.detach()), rel=1e-5)
    want = dict(reference.named_parameters())
    store = CheckpointStore(store_dir)
    compared = set()
    for stage in range(len(groups)):
        _, arrays = store.get("j1", f"stage-{stage}")
        for name, value in model_state(arrays).items():
            assert np.allclose(value, want[name].detach().numpy(), rtol=1e-5, atol=1e-7), name
            compared.add(name)
    assert compared == set(want)

    unknown = ask_stage_workers(client, {"w0": RoundStart(job_id="other", epoch=0, round=0)}, 30)["w0"].body
    assert isinstance(unknown, StageFailed) and unknown.reason == "not_assigned"
    assert wait_until(lambda: all(p.poll() is None for p in procs.values()), 1)
    assert "dropped a activation tensor for job j1 epoch 7" in services.log_of(procs["w2"])


def test_a_planned_job_trains_over_mqtt_and_its_saved_model_beats_chance(broker, make_bus, services,
                                                                         tmp_path: Path) -> None:
    """The job driver deploys a plan (a 2-device data-parallel stage, then one device) on three stage-workers,
    runs 25 rounds of the teacher task over MQTT, and saves the stages: the loss falls, and the saved model,
    reassembled here, classifies the held-out split far above chance."""
    from edgeswarm.hpp.driver import JobDriver
    from edgeswarm.hpp.spec import parse_job
    from edgeswarm.planning.hpp.assemble import assemble_plan
    from edgeswarm.planning.hpp.costmodel import CostModel
    from edgeswarm.planning.hpp.types import PlanOptions
    from edgeswarm.profiling.compute import profile_model
    from edgeswarm.values.profiles import ClusterProfile, DeviceInfo, DeviceProfileEntry, LinkProfile

    store_dir = tmp_path / "checkpoints"
    services.start("checkpoint-store", "hub", broker.url, EDGESWARM_CHECKPOINT_DIR=str(store_dir))
    nodes = ["a", "b", "c"]
    for node in nodes:
        services.start("stage-worker", node, broker.url)
    model, compute = profile_model(MLP, [1, 8, 32], repeats=1, warmup=0)
    entries = [DeviceProfileEntry(device=DeviceInfo(node=n, fingerprint=n, memory_budget_bytes=(3 - i) * 2**30),
                                  compute=compute) for i, n in enumerate(nodes)]
    links = [LinkProfile(src=x, dst=y, bandwidth_bps=12.5e6) for x, y in (("a", "b"), ("a", "c"), ("b", "c"))]
    cluster = ClusterProfile(model=model, devices=entries, links=links)
    plan = assemble_plan(CostModel(cluster, PlanOptions(micro_batch_size=32, micro_batches=4)),
                         [(0, 3, (0, 1)), (3, len(model.units), (2,))], "hpp")
    job = parse_job({"name": "mlp-teacher", "model": MLP.model_dump(), "data": DATA.model_dump(), "global_batch": 128,
                     "micro_batches": 4, "optimizer": {"name": "momentum", "lr": 0.05}, "rounds": 25})
    client = make_bus("coordinator-test", "cli")
    for node in nodes:
        client.peers.wait_for(node, "stage-worker", timeout_s=30)
    client.peers.wait_for("hub", "checkpoint-store", timeout_s=30)

    driver = JobDriver(client, job, plan, loss_terms=128)
    assert set(driver.deploy()) == set(nodes)
    reports = [driver.run_round(i) for i in range(25)]
    losses = [r.loss for r in reports]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert all(r.devices["a"].peak_live <= 3 and r.devices["c"].peak_live <= 1 for r in reports)
    assert all(r.devices["a"].allreduce_s > 0 for r in reports)
    assert {s.checkpoint_stage for s in driver.save("hub", 25)} == {"stage-0", "stage-1"}

    trained = build_model(MLP)
    trained.load_state_dict(stored_weights(store_dir, "mlp-teacher", 2), strict=True)
    held_out = accuracy(trained, open_dataset(DATA, MLP))
    assert held_out > 0.3, held_out  # ten classes: chance is 0.1


def _pipeline_plan(nodes: list[str], cut: int, micro_batch: int = 32, micro_batches: int = 2):
    """A 2-stage straight pipeline of MLP over ``nodes`` (one device each), cut before unit ``cut``."""
    from edgeswarm.planning.hpp.assemble import assemble_plan
    from edgeswarm.planning.hpp.costmodel import CostModel
    from edgeswarm.planning.hpp.types import PlanOptions
    from edgeswarm.profiling.compute import profile_model
    from edgeswarm.values.profiles import ClusterProfile, DeviceInfo, DeviceProfileEntry, LinkProfile

    model, compute = profile_model(MLP, [1, micro_batch], repeats=1, warmup=0)
    entries = [DeviceProfileEntry(device=DeviceInfo(node=n, fingerprint=n, memory_budget_bytes=2**30), compute=compute)
               for n in nodes]
    cluster = ClusterProfile(model=model, devices=entries, links=[LinkProfile(src=nodes[0], dst=nodes[1],
                                                                              bandwidth_bps=12.5e6)])
    return assemble_plan(CostModel(cluster, PlanOptions(micro_batch_size=micro_batch, micro_batches=micro_batches)),
                         [(0, cut, (0,)), (cut, len(model.units), (1,))], "pp")


def _job(name: str, rounds: int = 2):
    from edgeswarm.hpp.spec import parse_job

    return parse_job({"name": name, "model": MLP.model_dump(), "data": DATA.model_dump(), "global_batch": 64,
                      "micro_batches": 2, "optimizer": {"name": "sgd", "lr": 0.1}, "rounds": rounds})


def test_a_wrong_shape_tensor_fails_the_round_at_once_and_the_others_are_aborted(broker, make_bus, services) -> None:
    """A tensor of the wrong sample shape is dropped with a logged error; its round fails at once with the
    shapes named, the coordinator aborts the round on the other device, and nobody waits out a timeout."""
    import time

    from edgeswarm.hpp.driver import JobDriver, JobError

    nodes = ["p0", "p1"]
    procs = [services.start("stage-worker", n, broker.url) for n in nodes]
    client = make_bus("coordinator-test", "cli")
    for node in nodes:
        client.peers.wait_for(node, "stage-worker", timeout_s=30)
    driver = JobDriver(client, _job("shapes"), _pipeline_plan(nodes, 3), loss_terms=64)
    driver.deploy()
    assert driver.run_round(0).loss > 0  # a healthy round first
    # A tensor from a node that is not the rank it claims is dropped, and fails nothing: the genuine one comes.
    client.send_tensor("p1", "stage-worker", StageTensor(job_id="shapes", epoch=0, round=1, stage=1,
                                                         kind="activation", sender=0, micro_batch=0),
                       np.zeros((32, 7), dtype=np.float32))
    assert driver.run_round(1).loss > 0
    assert "that is not coordinator-test in this plan" in services.log_of(procs[1])

    as_p0 = make_bus("p0", "cli")  # the wrong shape, from the node that is rank 0 of stage 0
    as_p0.peers.wait_for("p1", "stage-worker", timeout_s=30)
    as_p0.send_tensor("p1", "stage-worker", StageTensor(job_id="shapes", epoch=0, round=2, stage=1,
                                                        kind="activation", sender=0, micro_batch=0),
                      np.zeros((32, 7), dtype=np.float32))
    started = time.monotonic()
    with pytest.raises(JobError, match=r"p1 failed \(error\).*shape \[32, 7\], but this stage expects \[rows, 64\]"):
        driver.run_round(2)
    assert time.monotonic() - started < 60  # the workers' own timeout is 120 s
    assert "dropped a activation tensor (round 2, micro-batch 0)" in services.log_of(procs[1])
    assert wait_until(lambda: "round 2 aborted" in services.log_of(procs[0]), 10)
    assert all(p.poll() is None for p in procs)


def test_a_stage_over_its_memory_budget_fails_with_the_numbers(broker, make_bus, services) -> None:
    """Eq. 3 as the worker counts it: a budget below the stage's weights, gradients and optimizer state refuses
    the assignment; a budget that holds those but not one micro-batch's activations fails the round."""
    from edgeswarm.hpp.driver import JobDriver, JobError
    from edgeswarm.models.sequence import layer_sequence

    stage1 = layer_sequence(build_model(MLP)).build_stage(3, len(layer_sequence(build_model(MLP))))
    static = 2 * sum(p.numel() * 4 for p in stage1.parameters())  # SGD: weights and gradients, no buffers
    nodes = ["q0", "q1"]
    services.start("stage-worker", "q0", broker.url)
    services.start("stage-worker", "q1", broker.url, EDGESWARM_MEMORY_BUDGET_BYTES=str(static + 1024))
    client = make_bus("coordinator-test", "cli")
    for node in nodes:
        client.peers.wait_for(node, "stage-worker", timeout_s=30)
    driver = JobDriver(client, _job("memory"), _pipeline_plan(nodes, 3), loss_terms=64)
    driver.deploy()
    with pytest.raises(JobError, match=r"q1 failed \(memory\): stage 1 on q1 \(native\) needs [\d.]+ MiB with 1 "
                                       r"micro-batches live .* but its memory budget is [\d.]+ MiB"):
        driver.run_round(0)

    tiny = ["r0", "r1"]
    services.start("stage-worker", "r0", broker.url)
    services.start("stage-worker", "r1", broker.url, EDGESWARM_MEMORY_BUDGET_BYTES=str(static // 2))
    for node in tiny:
        client.peers.wait_for(node, "stage-worker", timeout_s=30)
    with pytest.raises(JobError, match=r"r1 failed \(memory\): stage 1 \(units \[3, \d+\)\) needs [\d.]+ MiB for "
                                       r"weights, gradients, sgd state and buffers alone"):
        JobDriver(client, _job("memory2"), _pipeline_plan(tiny, 3), loss_terms=64).deploy()


def _rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_an_assignment_over_budget_is_refused_before_any_weight_is_allocated(broker, make_bus, services) -> None:
    """A stage whose weights would be 4 TiB is refused with reason "memory" and Eq. 3's numbers, measured without
    building it: the worker's resident memory does not grow by the stage (allocating it would have failed with an
    allocator error instead), it still answers probes, and it goes on building stages that fit."""
    from edgeswarm.messages import Probe, ProbeReply
    from edgeswarm.models.footprint import stage_footprint

    proc = services.start("stage-worker", "big0", broker.url, EDGESWARM_MEMORY_BUDGET_BYTES=str(512 * 2**20))
    client = make_bus("coordinator-test", "cli")
    client.peers.wait_for("big0", "stage-worker", timeout_s=30)
    huge = ModelSpec(name="mlp", config={"image_size": 1, "hidden": 2**20, "layers": 2})

    def assign(model: ModelSpec, job: str) -> object:
        return StageAssign(job_id=job, epoch=0, stage=0, rank=0, model=model, start=0, end=6, groups=[["big0"]],
                           shares=[[B]], micro_batches=1, warmup=1, loss_scale=1.0 / B,
                           optimizer=OptimizerSpec(name="adam", lr=0.01), data=DATA)

    # A stage that fits first: the worker has imported torch and built a stage before its memory is measured.
    assert isinstance(ask_stage_workers(client, {"big0": assign(MLP, "fits")}, 60)["big0"].body, StageReady)
    before = _rss_bytes(proc.pid)
    refused = ask_stage_workers(client, {"big0": assign(huge, "huge")}, 60)["big0"].body
    assert isinstance(refused, StageFailed) and refused.reason == "memory", refused
    static = stage_footprint(huge, 0, 6).static_bytes("adam")
    assert static > 2**44  # weights, gradients and two Adam moments of 4 TiB each
    assert f"needs {static / 2**20:.1f} MiB for weights, gradients, adam state and buffers alone" in refused.detail
    assert "memory budget of 512.0 MiB" in refused.detail
    assert _rss_bytes(proc.pid) - before < 128 * 2**20, "the refused stage was allocated"
    probe = client.request(topics.request("big0", "stage-worker"), Probe(), timeout_s=10).body
    assert isinstance(probe, ProbeReply) and probe.healthy
    ready = ask_stage_workers(client, {"big0": assign(MLP, "fits-again")}, 60)["big0"].body
    assert isinstance(ready, StageReady), ready
    assert proc.poll() is None


def test_a_worker_holds_two_training_jobs_and_runs_their_rounds_at_once(broker, make_bus, services) -> None:
    """Two jobs of different models on the same two workers, each stage on the other worker than the other job's:
    both are deployed, their rounds run at the same time and each equals single-process training of its model; a
    new assignment of one job replaces only that job's stage, and the other goes on training."""
    second = ModelSpec(name="mlp", config={"hidden": 32, "layers": 2, "seed": 5})
    jobs = {"ja": (MLP, ["x0", "x1"]), "jb": (second, ["x1", "x0"])}
    procs = {node: services.start("stage-worker", node, broker.url) for node in ("x0", "x1")}
    client = make_bus("coordinator-test", "cli")
    for node in procs:
        client.peers.wait_for(node, "stage-worker", timeout_s=30)
    m = 2

    def assigns(job: str, epoch: int) -> dict[str, object]:
        model, nodes = jobs[job]
        return {node: StageAssign(job_id=job, epoch=epoch, stage=p, rank=0, model=model, start=(0, 3)[p],
                                  end=(3, 6)[p], groups=[[nodes[0]], [nodes[1]]], shares=[[B], [B]],
                                  micro_batches=m, warmup=min(2 * (2 - p) - 1, m), loss_scale=1.0 / (m * B),
                                  optimizer=OptimizerSpec(name="sgd", lr=LR), data=DATA)
                for p, node in enumerate(nodes)}

    def start_round(job: str, epoch: int, round_index: int) -> dict[str, object]:
        expectations = {}
        for node in jobs[job][1]:
            exp = client.expect()
            expectations[node] = exp
            client.publish(topics.request(node, "stage-worker"), RoundStart(job_id=job, epoch=epoch,
                                                                             round=round_index),
                           correlation_id=exp.correlation_id, reply_to=client.reply_topic, ttl_s=120)
        return expectations

    for job in jobs:  # (one after the other: each worker builds one stage of each job)
        ready = ask_stage_workers(client, assigns(job, 0), 60)
        assert all(isinstance(r.body, StageReady) for r in ready.values()), ready

    dataset = open_dataset(DATA, MLP)
    x, y = dataset.batch(round_sample_ids(0, m * B, dataset.train_size, 0))
    for round_index in range(2):
        # Both jobs' rounds are under way at once on both workers.
        pending = {job: start_round(job, 0, round_index) for job in jobs}
        done = {job: {node: exp.wait(120) for node, exp in expectations.items()}
                for job, expectations in pending.items()}
        for job, replies in done.items():
            assert all(r is not None and isinstance(r.body, RoundDone) for r in replies.values()), (job, replies)
            if round_index == 0:  # the first round's loss is the untrained model's, computed here in one process
                last = replies[jobs[job][1][1]].body
                reference = build_model(jobs[job][0])
                want = torch.nn.functional.cross_entropy(reference(x), y)
                assert last.loss_sum / (m * B) == pytest.approx(float(want.detach()), rel=1e-5), job

    # A new plan epoch of ja replaces ja's stages only: jb's round still runs on the same workers.
    ready = ask_stage_workers(client, assigns("ja", 1), 60)
    assert all(isinstance(r.body, StageReady) for r in ready.values()), ready
    after = {node: exp.wait(120) for node, exp in start_round("jb", 0, 2).items()}
    assert all(r is not None and isinstance(r.body, RoundDone) for r in after.values()), after
    stale = ask_stage_workers(client, {"x0": RoundStart(job_id="ja", epoch=0, round=2)}, 30)["x0"].body
    assert isinstance(stale, StageFailed) and stale.reason == "not_assigned"
    again = {node: exp.wait(120) for node, exp in start_round("ja", 1, 2).items()}
    assert all(r is not None and isinstance(r.body, RoundDone) for r in again.values()), again
    assert all(p.poll() is None for p in procs.values())
