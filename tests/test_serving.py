"""Serving a model as a pipeline (workload ``serve-pipeline``), end to end on real processes and a real Mosquitto.

One local cluster of three native devices, each with a memory budget of 2 MB, so every model here must be cut
into at least two stages. Jobs are submitted to the coordinator like any job; requests go to its data topic as
InferRequest frames and come back on the caller's reply topic. The test that kills a device runs last: it leaves
the cluster with two.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgeswarm import topics
from edgeswarm.bus import Bus
from edgeswarm.local.forkserver import ForkServer
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.messages.jobs import JobState
from edgeswarm.messages.serving import InferError, InferRequest
from edgeswarm.models.zoo import build_model, example_input
from edgeswarm.pipeline_serve.client import InferRefusedError, infer, infer_stream
from edgeswarm.pipeline_serve.spec import ServeProgress
from edgeswarm.pipeline_serve.workload import ServePipelineWorkload
from edgeswarm.planning.serve.load import at_measured_load
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.workloads.client import JobFollower, JobRequestError, cancel_job, submit_job
from helpers import FAST_ENV, native_cluster, wait_serving, wait_until

DEVICES = 3
BUDGET = 2_000_000  # bytes per device: every model below needs two stages or more
MLP = {"name": "mlp", "config": {"image_size": 8, "hidden": 512, "layers": 3}}
CNN = {"name": "resnet18", "config": {"image_size": 16, "width": 0.25}}
TRANSFORMER = {"name": "gpt2", "config": {"vocab_size": 64, "seq_len": 8, "n_layer": 4, "n_embd": 128,
                                          "n_head": 2}}


class Cluster:
    def __init__(self, local: LocalCluster, bus: Bus, root: Path) -> None:
        self.local = local
        self.bus = bus
        self.root = root


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, forks: ForkServer) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("serving-cluster")
    env = {**FAST_ENV, "EDGESWARM_CHECKPOINT_DIR": str(root / "checkpoints"),
           "EDGESWARM_PROFILE_DIR": str(root / "profiles"), "EDGESWARM_MEMORY_BUDGET_BYTES": str(BUDGET)}
    # The dashboard collects the stages' spans for `edgeswarm explain`.
    with native_cluster(DEVICES, root / "cluster", env, "serving-test", dashboard=True, forks=forks) as (local, bus):
        yield Cluster(local, bus, root)


def serve(cluster: Cluster, model: dict[str, object], **fields: object) -> tuple[str, JobFollower]:
    """Submit a serving job and wait until it serves; returns its name and follower."""
    name = f"serve-{uuid.uuid4().hex[:6]}"
    spec = {"kind": "serve-pipeline", "name": name, "model": model, "micro_batch_size": 4, **fields}
    follower = JobFollower(cluster.bus, name)
    submit_job(cluster.bus, json.dumps(spec), submission=follower.submission)
    wait_serving(follower, 300, message=f"job {name} serving")
    return name, follower


def stop(cluster: Cluster, name: str, follower: JobFollower) -> JobState:
    cancel_job(cluster.bus, name)
    final = follower.wait(60)
    assert final.status == "cancelled"
    return final


def reference(model: dict[str, object]) -> torch.nn.Module:
    return build_model(ModelSpec.model_validate(model)).eval()


@pytest.mark.parametrize("model", [CNN, TRANSFORMER], ids=["cnn", "transformer"])
def test_pipelined_outputs_equal_a_single_process(cluster: Cluster, model: dict[str, object]) -> None:
    name, follower = serve(cluster, model)
    state = follower.state
    assert state is not None and isinstance(state.plan, ServePlan)
    assert len(state.plan.stages) >= 2 and state.plan.throughput_per_s > 0
    spec = ModelSpec.model_validate(model)
    inputs = [example_input(spec, rows, seed=k) for k, rows in enumerate([1, 4, 2, 3, 1, 4, 4, 2, 1, 3])]
    report = infer_stream(cluster.bus, name, inputs, window=4)
    net = reference(model)
    with torch.no_grad():
        for r in report.results:
            assert r.outputs is not None, r.error
            torch.testing.assert_close(r.outputs, net(inputs[r.index]), rtol=1e-5, atol=1e-5)
    wait_until(lambda: follower.state is not None and _answered(follower.state) == len(inputs), 10)
    final = stop(cluster, name, follower)
    figures = final.progress_as(ServeProgress)
    assert figures.errors == 0 and figures.samples == sum(int(x.shape[0]) for x in inputs)
    # The full items carried each stage's measured forward: the plan is priced on them too (the closed loop's fit).
    assert figures.refitted_throughput_per_s is not None and figures.refitted_throughput_per_s > 0, figures
    # The load it measured, and the plan's prediction at that load beside the measured figures on the dashboard.
    assert figures.offered_per_s is not None and figures.offered_per_s > 0 and figures.at_load is not None, figures
    assert isinstance(final.plan, ServePlan)  # nothing held once every request is answered; the spec's window is 8
    assert figures.at_load == at_measured_load(final.plan, figures.offered_per_s, 0, 8), figures
    charted = {s.name: s.predicted for s in ServePipelineWorkload().series(final)}
    assert charted["throughput"] == figures.at_load.throughput_per_s, charted
    # A cancelled job answers no more: the caller hears so at once.
    with pytest.raises(InferRefusedError) as refused:
        infer(cluster.bus, name, inputs[0], timeout_s=10)
    assert refused.value.reason == "not_serving"


def test_bad_requests_get_an_error_and_the_stream_goes_on(cluster: Cluster) -> None:
    name, follower = serve(cluster, MLP)
    spec = ModelSpec.model_validate(MLP)
    good = example_input(spec, 2)
    cases = {
        "bad_shape": good.reshape(2, 1, -1),
        "bad_dtype": good.half(),
        "too_large": example_input(spec, 5),  # more rows than the micro-batch size
    }
    for reason, x in cases.items():
        with pytest.raises(InferRefusedError) as refused:
            infer(cluster.bus, name, x, timeout_s=10)
        assert refused.value.reason == reason
    with pytest.raises(InferRefusedError) as refused:
        infer(cluster.bus, "no-such-job", good, timeout_s=10)
    assert refused.value.reason == "unknown_job"
    # A request without its tensor (a plain message on the data topic).
    reply = cluster.bus.request(topics.data("hub", "coordinator"), InferRequest(job_id=name), timeout_s=10)
    assert isinstance(reply.body, InferError) and reply.body.reason == "no_tensor"
    result = infer(cluster.bus, name, good, timeout_s=30)
    with torch.no_grad():
        torch.testing.assert_close(result.outputs, reference(MLP)(good), rtol=1e-5, atol=1e-5)
    final = stop(cluster, name, follower)
    assert final.progress_as(ServeProgress).errors == len(cases) + 1 and final.progress_as(ServeProgress).answered == 1


def test_a_spec_that_cannot_run_is_refused_with_every_problem(cluster: Cluster) -> None:
    unknown = {"kind": "serve-pipeline", "name": "bad-1", "model": {"name": "no-such-model"}}
    with pytest.raises(JobRequestError, match="no-such-model"):
        submit_job(cluster.bus, json.dumps(unknown))
    with pytest.raises(JobRequestError, match="unknown job kind 'galaxy'"):
        submit_job(cluster.bus, json.dumps({**unknown, "kind": "galaxy"}))
    huge = {"kind": "serve-pipeline", "name": "bad-2", "model": {"name": "mlp", "config": {"hidden": 4096}}}
    with pytest.raises(JobRequestError, match="fits nowhere"):
        submit_job(cluster.bus, json.dumps(huge))


def test_the_cli_serves_infers_lists_and_cancels(cluster: Cluster, tmp_path: Path) -> None:
    name = f"cli-{uuid.uuid4().hex[:6]}"
    spec = tmp_path / "serve.yaml"
    spec.write_text(f"kind: serve-pipeline\nname: {name}\nmodel:\n  name: mlp\n  config: {{image_size: 8, "
                    "hidden: 512, layers: 3}\nmicro_batch_size: 4\n")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "edgeswarm", *args, "--hub", cluster.local.hub_url],
                              capture_output=True, text=True, timeout=300, env={**os.environ, **FAST_ENV})

    served = cli("serve", str(spec))
    assert served.returncode == 0, served.stderr
    assert "is serving" in served.stdout and "samples/s" in served.stdout
    x = example_input(ModelSpec.model_validate(MLP), 6, seed=3).numpy()
    np.savez(tmp_path / "inputs.npz", x=x.astype(np.float64))  # NumPy's default dtype: infer converts it
    out = tmp_path / "outputs.npz"
    inferred = cli("infer", name, "--npz", str(tmp_path / "inputs.npz"), "--rows", "2", "--out", str(out),
                   "--json", str(tmp_path / "run.json"))
    assert inferred.returncode == 0, inferred.stderr
    assert "3/3 requests answered, 6 samples" in inferred.stdout and "p99" in inferred.stdout
    with torch.no_grad():
        expected = reference(MLP)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.load(out)["y"], expected, rtol=1e-5, atol=1e-5)
    generated = cli("infer", name, "--count", "5", "--show", "2")
    assert generated.returncode == 0 and "5/5 requests answered" in generated.stdout
    full = cli("infer", name, "--count", "2", "--rows", "4", "--show", "0")  # each fills a micro-batch
    assert full.returncode == 0 and "2/2 requests answered, 8 samples" in full.stdout, full.stdout + full.stderr
    listed = cli("jobs")
    assert name in listed.stdout and "serve-pipeline" in listed.stdout and "answered" in listed.stdout

    def explained() -> dict[str, Any] | None:
        """`edgeswarm explain` once every stage's spans are in (they follow the answers by up to 0.5 s)."""
        result = cli("explain", name, "--json", str(tmp_path / "explain.json"))
        if result.returncode != 0:
            return None
        data: dict[str, Any] = json.loads((tmp_path / "explain.json").read_text())
        seen = {o["lane"] for o in data["operations"] if o["measured_each_s"] is not None}
        return data if {"stage 0", "stage 1"} <= seen else None

    data = wait_until(explained, 30, message="the stages' spans for edgeswarm explain")
    assert data["unit"] == "item" and len(data["units"]) >= 2 and data["predicted_s"] > 0
    ops = {(o["lane"], o["name"]): o for o in data["operations"]}
    assert ops[("stage 0", "forward")]["planned_each_s"] > 0 and ops[("stage 1", "forward")]["measured_s"] > 0
    assert ops[("link 0→1", "activation")]["planned_each_s"] is not None
    # Lined up: the items that filled the plan's micro-batch of 4, as the stages' spans say; not the smaller ones.
    traced = cli("trace", name, "--out", str(tmp_path / "trace.json"))
    assert traced.returncode == 0, traced.stderr
    forwards = [e["args"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
                if e["ph"] == "X" and e["name"].startswith("forward")]
    assert {f["samples"] for f in forwards} >= {2, 4}, forwards
    assert set(data["units"]) <= {f["micro_batch"] for f in forwards if f["samples"] == 4}
    assert not set(data["units"]) & {f["micro_batch"] for f in forwards if f["samples"] != 4}
    cancelled = cli("cancel", name)
    assert cancelled.returncode == 0, cancelled.stderr
    wrong = cli("infer", "no-such-job", "--count", "1")
    assert wrong.returncode != 0 and "Traceback" not in wrong.stderr


def test_two_models_are_served_at_once(cluster: Cluster) -> None:
    a, follower_a = serve(cluster, MLP)
    b, follower_b = serve(cluster, TRANSFORMER)
    x = example_input(ModelSpec.model_validate(MLP), 2)
    t = example_input(ModelSpec.model_validate(TRANSFORMER), 2)
    with torch.no_grad():
        torch.testing.assert_close(infer(cluster.bus, a, x).outputs, reference(MLP)(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(infer(cluster.bus, b, t).outputs, reference(TRANSFORMER)(t), rtol=1e-5,
                                   atol=1e-5)
    stop(cluster, a, follower_a)
    stop(cluster, b, follower_b)


def test_a_stream_survives_the_loss_of_a_stage_device_with_every_request_answered_once(cluster: Cluster) -> None:
    name, follower = serve(cluster, MLP, window=4)
    state = follower.state
    assert state is not None and isinstance(state.plan, ServePlan)
    victim = state.plan.devices[0]
    spec = ModelSpec.model_validate(MLP)
    inputs = [example_input(spec, 1 + k % 4, seed=k) for k in range(120)]
    answered = threading.Event()
    count = 0

    def on_result(_r: object) -> None:
        nonlocal count
        count += 1
        if count == 20:
            answered.set()

    def kill() -> None:
        answered.wait(120)
        for child in cluster.local.children:
            if child.node == victim and child.alive():
                os.kill(child.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    late_before = cluster.bus.metrics.counter("late_replies")
    report = infer_stream(cluster.bus, name, inputs, window=4, timeout_s=120, on_result=on_result)
    killer.join(5)
    net = reference(MLP)
    with torch.no_grad():
        for r in report.results:
            assert r.outputs is not None, f"request {r.index}: {r.reason}: {r.error}"
            torch.testing.assert_close(r.outputs, net(inputs[r.index]), rtol=1e-5, atol=1e-5)
    assert len(report.results) == len(inputs)
    wait_until(lambda: follower.state is not None and _answered(follower.state) == len(inputs), 10)
    final = stop(cluster, name, follower)
    assert final.progress_as(ServeProgress).reconfigurations >= 1 and isinstance(final.plan, ServePlan)
    assert victim not in final.plan.devices and final.plan.epoch >= 1
    # Exactly once: the coordinator answered each request one time (a second answer would be a late reply here).
    assert final.progress_as(ServeProgress).answered == len(inputs)
    assert cluster.bus.metrics.counter("late_replies") == late_before


def _answered(state: JobState) -> int:
    return state.progress_as(ServeProgress).answered
