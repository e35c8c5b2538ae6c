"""Every family of the model zoo trains through the coordinator, end to end, to an evaluated checkpoint.

One local cluster (a real Mosquitto, the hub's services and two native devices, started the way ``edgeswarm up
--local`` starts them) runs one tiny job per family, one after the other: profiled, planned as a two-stage
pipeline, trained for two rounds, saved to the checkpoint store, and loaded back from it into the whole model
(``load_state_dict(strict=True)``) for the held-out accuracy. A checkpoint holding anything but the model's state
dict (a non-persistent buffer such as the transformers' position ids) fails the job at that last step.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeswarm.bus import Bus
from edgeswarm.hpp.spec import TrainProgress
from edgeswarm.local.forkserver import ForkServer
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.models.zoo import MODEL_NAMES, build_model
from edgeswarm.state.layout import stage_entry
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.workloads.client import JobFollower, submit_job
from helpers import FAST_ENV, native_cluster, stored_weights, wait_until

DEVICES = 2
ROUNDS = 2
IMAGE_DATA = {"kind": "teacher", "size": 32, "test_size": 16}
TOKEN_DATA = {"kind": "tokens", "size": 32, "test_size": 16}

# One model per zoo family, each as small as its config allows: a few channels, small images, short sequences.
FAMILIES: dict[str, tuple[str, dict[str, object], dict[str, object]]] = {
    "mlp": ("mlp", {"image_size": 8, "hidden": 16, "layers": 1}, IMAGE_DATA),
    "lenet5": ("lenet5", {"image_size": 16, "width": 0.5}, IMAGE_DATA),
    "vgg": ("vgg11", {"image_size": 32, "width": 0.0625}, IMAGE_DATA),
    "resnet": ("resnet18", {"image_size": 16, "width": 0.125}, IMAGE_DATA),
    "mobilenetv2": ("mobilenetv2", {"image_size": 32, "width": 0.25}, IMAGE_DATA),
    "efficientnet": ("efficientnet-b0", {"image_size": 32, "width": 0.25}, IMAGE_DATA),
    "bert-small": ("bert-small", {"vocab_size": 32, "seq_len": 8, "layers": 1, "hidden": 16, "heads": 2},
                   TOKEN_DATA),
    "gpt2": ("gpt2", {"vocab_size": 32, "seq_len": 8, "n_layer": 2, "n_embd": 16, "n_head": 2}, TOKEN_DATA),
}


def job_text(name: str, model: str, config: dict[str, object], data: dict[str, object]) -> str:
    """A job for ``model``: a two-stage pipeline ("pp", so the final model is merged from several stages'
    checkpoints) with 2 micro-batches of 4 samples, checkpointed after every round."""
    return json.dumps({"name": name, "model": {"name": model, "config": config}, "data": data, "strategy": "pp",
                       "global_batch": 8, "micro_batches": 2, "optimizer": {"name": "adam", "lr": 0.001},
                       "rounds": ROUNDS})


class Cluster:
    """A started local cluster, a client bus on it, and where its checkpoint store keeps its files."""

    def __init__(self, local: LocalCluster, bus: Bus, checkpoints: Path) -> None:
        self.local = local
        self.bus = bus
        self.checkpoints = checkpoints


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, forks: ForkServer) -> Iterator[Cluster]:
    """One cluster for every family's job (starting one costs more than a tiny job): stopped by PID at the end."""
    root = tmp_path_factory.mktemp("zoo-cluster")
    checkpoints = root / "checkpoints"
    env = {**FAST_ENV, "EDGESWARM_CHECKPOINT_DIR": str(checkpoints), "EDGESWARM_PROFILE_DIR": str(root / "profiles")}
    with native_cluster(DEVICES, root / "cluster", env, "zoo-test", dashboard=True, forks=forks) as (local, bus):
        yield Cluster(local, bus, checkpoints)


def test_every_zoo_model_belongs_to_a_family_trained_here() -> None:
    assert all(any(name.startswith(family) for family in FAMILIES) for name in MODEL_NAMES), MODEL_NAMES
    assert {model for model, _, _ in FAMILIES.values()} <= set(MODEL_NAMES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_tiny_model_of_every_family_trains_through_the_coordinator_to_an_evaluation(cluster: Cluster,
                                                                                        family: str) -> None:
    model, config, data = FAMILIES[family]
    name = f"zoo-{family}-{uuid.uuid4().hex[:6]}"
    follower = JobFollower(cluster.bus, name)
    submit_job(cluster.bus, job_text(name, model, config, data), submission=follower.submission)
    # Bounded, and generous for a loaded host: the job itself takes seconds.
    final = follower.wait(300)

    assert final.status == "succeeded", f"job {name} ended {final.status}: {final.detail}"
    t = final.progress_as(TrainProgress)
    assert t.round == ROUNDS and t.checkpoint_version == ROUNDS
    assert t.test_accuracy is not None and 0.0 <= t.test_accuracy <= 1.0
    assert final.plan is not None and len(final.plan.stages) == DEVICES
    assert t.loss is not None and math.isfinite(t.loss)
    saved = {p.name for p in (cluster.checkpoints / name).iterdir()}
    assert saved == {stage_entry(s.index) for s in final.plan.stages} | {"layout"}
    # The stages' checkpoints together are exactly the model's state dict: no non-persistent buffer, nothing lacking.
    stored = stored_weights(cluster.checkpoints, name, len(final.plan.stages))
    assert set(stored) == set(build_model(ModelSpec(name=model, config=config)).state_dict())


def test_edgeswarm_trace_writes_one_forward_and_backward_per_micro_batch_of_every_stage_and_round(
        cluster: Cluster, tmp_path: Path) -> None:
    """A job's spans, collected on the hub by its dashboard service and written by `edgeswarm trace JOB --out FILE`:
    a Chrome trace with exactly one forward and one backward span per micro-batch per stage per round, and the last
    round measured beside the planned one (what the dashboard draws and `train --timeline-png` too)."""
    from edgeswarm.hpp.cli import measured_round
    from edgeswarm.values.schedule import ScheduleView

    name = f"trace-{uuid.uuid4().hex[:6]}"
    model, config, data = FAMILIES["mlp"]
    follower = JobFollower(cluster.bus, name)
    submit_job(cluster.bus, job_text(name, model, config, data), submission=follower.submission)
    final = follower.wait(300)
    assert final.status == "succeeded", final.detail

    def last_round() -> ScheduleView | None:
        """The last round as the dashboard draws it, once its spans are in (they follow its RoundDone by up to a
        publishing interval, 0.5 s)."""
        measured, _note = measured_round(cluster.bus, final)
        return measured if measured is not None and measured.round == ROUNDS - 1 else None

    view = wait_until(last_round, 30, message="the last round's spans on the dashboard")
    out = tmp_path / "trace.json"
    result = subprocess.run([sys.executable, "-m", "edgeswarm", "trace", name, "--out", str(out), "--hub",
                             cluster.local.hub_url], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"of job {name} on 2 nodes" in result.stdout and "rounds 0-1" in result.stdout, result.stdout
    trace = json.loads(out.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert final.plan is not None
    stages = len(final.plan.stages)
    for kind in ("forward", "backward"):
        seen: dict[str, list[tuple[int, int]]] = {}
        for e in spans:
            if e["name"].split(" ")[0] == kind:
                seen.setdefault(lanes[(e["pid"], e["tid"])], []).append((e["args"]["round"],
                                                                          e["args"]["micro_batch"]))
        assert sorted(seen) == [f"stage {p}" for p in range(stages)], seen
        for lane, keys in seen.items():
            assert sorted(keys) == [(r, mb) for r in range(ROUNDS) for mb in range(2)], (kind, lane, keys)
    assert {e["name"].split(" ")[0] for e in spans} >= {"activation", "gradient", "wait", "step"}
    assert sum(b.name == "forward" and b.source == "measured" for b in view.bars) == 2 * stages  # both micro-batches
    # The dashboard draws the same round planned beside measured, on one lane per stage and link.
    assert cluster.local.dashboard_url is not None
    with urllib.request.urlopen(cluster.local.dashboard_url + "api/snapshot", timeout=10) as reply:
        snapshot = json.loads(reply.read())
    drawn = next(j for j in snapshot["jobs"] if j["job_id"] == name)["schedule"]
    assert drawn is not None and drawn["round"] == ROUNDS - 1, drawn
    assert {b["source"] for b in drawn["bars"]} == {"planned", "measured"}
    assert {"stage 0", "link 0→1", "stage 1"} <= set(drawn["lanes"])
    # `edgeswarm explain JOB`: the planned operations beside the measured ones, round 1 (round 0 warms up).
    out = tmp_path / "explain.json"
    result = subprocess.run([sys.executable, "-m", "edgeswarm", "explain", name, "--json", str(out), "--hub",
                             cluster.local.hub_url], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"job {name} (train-hpp), 1 round measured: predicted" in result.stdout, result.stdout
    explained = json.loads(out.read_text())
    assert explained["units"] == [ROUNDS - 1] and explained["spans_s"] > 0
    ops = {(o["lane"], o["name"]): o for o in explained["operations"]}
    for p in range(stages):
        for kind in ("forward", "backward"):
            op = ops[(f"stage {p}", kind)]
            assert op["planned_each_s"] > 0 and op["measured_each_s"] > 0 and op["measured_s"] > 0, op
    assert ops[("link 0→1", "activation")]["planned_each_s"] is not None
    assert ops[("job", "outside spans")]["planned_s"] == 0.0
    gaps = [abs(o["measured_s"] - o["planned_s"]) for o in explained["operations"]]
    assert gaps == sorted(gaps, reverse=True)
