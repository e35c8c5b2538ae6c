"""Standard checkpoints end to end: ``edgeswarm export`` and a training job that starts from the exported file.

One ``edgeswarm up --local --workdir W`` cluster (two native devices, a real Mosquitto) keeps its checkpoints in
W/checkpoints. A two-stage job trains; ``edgeswarm export`` writes its model as one safetensors file, which a plain
zoo model loads with ``load_state_dict(strict=True)`` and which equals, tensor for tensor and output for output,
the stages' checkpoints on the store's disk. A second job starts from that file: its first loss is the exported
model's loss on that round's batch, and after one round its weights are exactly one SGD step from the file's. A file
that does not fit the model is refused before anything is sent, with every problem listed; export errors, a job name
whose checkpoints are another job's, and a spec whose file was never uploaded each say what to do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from edgeswarm.data import open_dataset
from edgeswarm.data.base import round_sample_ids
from edgeswarm.devices.cluster import cluster_of
from edgeswarm.errors import ConfigError
from edgeswarm.hpp.model_file import read_model_file, specs_of, state_problems, write_model_file
from edgeswarm.hpp.spec import make_optimizer
from edgeswarm.local.broker import free_port
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.models.zoo import build_model, example_input
from edgeswarm.runtime.client import client_bus
from edgeswarm.settings import Settings
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.workloads.client import JobFollower, submit_job
from helpers import FAST_ENV, assert_same_weights, parse_job_text, stored_weights, wait_until

MODEL = ModelSpec(name="mlp", config={"hidden": 16, "layers": 2})
JOB = """name: {name}
model: {{name: mlp, config: {{hidden: 16, layers: 2}}}}
data: {{kind: teacher, size: 256, test_size: 32}}
global_batch: 32
micro_batches: 2
strategy: pp
optimizer: {{name: sgd, lr: 0.1}}
rounds: {rounds}
seed: {seed}
"""
ENV = {**{k: v for k, v in os.environ.items() if k != "EDGESWARM_CHECKPOINT_DIR"}, **FAST_ENV, "COLUMNS": "200"}


def edgeswarm(*args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "edgeswarm", *args], env=ENV, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"edgeswarm {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


class Cluster:
    def __init__(self, url: str, workdir: Path, root: Path) -> None:
        self.url, self.workdir, self.root = url, workdir, root


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """``edgeswarm up --local --workdir W`` with two native devices, EDGESWARM_CHECKPOINT_DIR unset."""
    root = tmp_path_factory.mktemp("export")
    port = free_port()
    env = {**ENV, "EDGESWARM_PROFILE_DIR": str(root / "profiles")}
    with open(root / "up.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgeswarm", "up", "--local", "--port", str(port), "--devices",
                                 "2", "--device-class", "native", "--workdir", str(root / "cluster"), "--ready-timeout",
                                 "180"], env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: proc.poll() is not None or "cluster up" in (root / "up.log").read_text(), 200,
                   interval_s=0.5, message="edgeswarm up --local")
        assert proc.poll() is None, (root / "up.log").read_text()
        yield Cluster(f"mqtt://127.0.0.1:{port}", root / "cluster", root)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def first_batch_loss(state: dict[str, torch.Tensor], job_text: str) -> tuple[float, torch.nn.Module]:
    """The loss of the model with ``state`` on round 0's batch of the job, as a round reports it, and one plain SGD
    step of that model on that batch (what round 0 must end with)."""
    job = parse_job_text(job_text)
    model = build_model(job.model)
    model.load_state_dict(state, strict=True)
    dataset = open_dataset(job.data, job.model)
    x, y = dataset.batch(round_sample_ids(0, job.global_batch, dataset.train_size, job.seed))
    opt = make_optimizer(job.optimizer, model.parameters())
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / job.global_batch
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach()), model


def test_export_a_trained_job_and_train_a_new_job_from_the_file(cluster: Cluster) -> None:
    src = cluster.root / "src.yaml"
    src.write_text(JOB.format(name="source", rounds=2, seed=0))
    edgeswarm("train", str(src), "--hub", cluster.url, "--wait")

    # Without EDGESWARM_CHECKPOINT_DIR, the local cluster keeps its checkpoints in its working folder.
    checkpoints = cluster.workdir / "checkpoints"
    assert {p.name for p in (checkpoints / "source").iterdir()} == {"stage-0", "stage-1", "layout"}
    assert list((checkpoints / "source" / "stage-0").glob("v0000000002-*.safetensors"))

    out_file = cluster.root / "model.safetensors"
    out = edgeswarm("export", "source", "--out", str(out_file), "--hub", cluster.url)
    assert "version 2 of job source" in out.stdout, out.stdout
    exported = load_file(out_file)
    with safe_open(out_file, framework="pt") as f:
        meta = f.metadata()
    assert meta == {"format": "pt", "edgeswarm.model": "mlp", "edgeswarm.model_config": '{"hidden": 16, "layers": 2}',
                    "edgeswarm.job": "source", "edgeswarm.version": "2"}

    # A plain zoo model loads it strictly; it is the stages' checkpoints on disk, tensor for tensor.
    plain = build_model(MODEL).eval()
    plain.load_state_dict(exported, strict=True)
    stored = stored_weights(checkpoints, "source", 2)
    assert set(stored) == set(exported)
    assert all(torch.equal(stored[k], exported[k]) for k in stored)
    reference = build_model(MODEL).eval()
    reference.load_state_dict(stored, strict=True)
    x = example_input(MODEL, 8, seed=3)
    with torch.no_grad():
        assert torch.equal(plain(x), reference(x))

    # Version 1 too; unknown jobs and versions are one line and exit 1.
    edgeswarm("export", "source", "--version", "1", "--out", str(cluster.root / "v1.safetensors"), "--hub", cluster.url)
    assert not all(torch.equal(a, b) for a, b in zip(load_file(cluster.root / "v1.safetensors").values(),
                                                     exported.values(), strict=True))
    for args, expected in ((["nope"], "no checkpoint of job 'nope'; jobs with checkpoints: source"),
                           (["source", "--version", "9"], "no complete checkpoint version 9; complete versions: 1, 2")):
        bad = edgeswarm("export", *args, "--out", str(cluster.root / "x.safetensors"), "--hub", cluster.url,
                        check=False)
        assert bad.returncode == 1 and expected in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr

    # A new job starts from the file (named relative to its spec); seed 5 would start elsewhere.
    (cluster.root / "init").mkdir()
    os.replace(out_file, cluster.root / "init" / "model.safetensors")
    dst_text = JOB.format(name="from-file", rounds=1, seed=5) + "init: {file: model.safetensors}\n"
    (cluster.root / "init" / "dst.yaml").write_text(dst_text)
    out = edgeswarm("train", str(cluster.root / "init" / "dst.yaml"), "--hub", cluster.url, "--wait", "--json",
                    str(cluster.root / "dst.json"))
    assert "uploaded model.safetensors" in out.stdout and "as version 0 of job from-file" in out.stdout, out.stdout
    run = json.loads((cluster.root / "dst.json").read_text())
    assert run["state"]["status"] == "succeeded", run["state"]
    want_loss, stepped = first_batch_loss(exported, dst_text)
    seed_loss, _ = first_batch_loss(build_model(parse_job_text(dst_text).model).state_dict(), dst_text)
    assert run["rounds"][0]["loss"] == pytest.approx(want_loss, rel=1e-5) and abs(want_loss - seed_loss) > 1e-3
    assert_same_weights(stored_weights(checkpoints, "from-file", 2),
                        {k: v.detach() for k, v in stepped.state_dict().items()}, tolerance=1e-6)

    # A name whose checkpoints belong to another job cannot take the file: one line, nothing submitted.
    (cluster.root / "init" / "taken.yaml").write_text(dst_text.replace("name: from-file", "name: source"))
    out = edgeswarm("train", str(cluster.root / "init" / "taken.yaml"), "--hub", cluster.url, check=False)
    assert out.returncode == 1 and "rename the job" in out.stderr and "Traceback" not in out.stderr, out.stderr

    # A spec with init submitted without the upload (not through `edgeswarm train`) fails at deployment, saying so.
    bus = client_bus(Settings(hub_url=cluster.url), role="export-test")
    try:
        follower = JobFollower(bus, "no-upload")
        submit_job(bus, dst_text.replace("name: from-file", "name: no-upload"), submission=follower.submission)
        final = follower.wait(120)
    finally:
        bus.stop()
    assert final.status == "failed" and "submit the job with `edgeswarm train`" in final.detail, final.detail


def test_a_file_that_does_not_fit_the_model_is_refused_with_every_problem(tmp_path: Path) -> None:
    state = {k: v.clone() for k, v in build_model(MODEL).state_dict().items()}
    names = list(state)
    del state[names[0]]
    state[names[1]] = torch.zeros(3, 3)
    state[names[2]] = state[names[2]].double()
    state["extra.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "bad.safetensors")
    (tmp_path / "job.yaml").write_text(JOB.format(name="misfit", rounds=1, seed=0) + "init: {file: bad.safetensors}\n")
    # Refused before connecting: the hub URL leads nowhere.
    out = edgeswarm("train", str(tmp_path / "job.yaml"), "--hub", "mqtt://127.0.0.1:1", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "does not fit mlp" in out.stderr and "4 problems" in out.stderr, out.stderr
    for expected in (f"missing tensor '{names[0]}'", f"tensor '{names[1]}' has shape [3, 3]",
                     f"tensor '{names[2]}' is float64, mlp needs float32", "unexpected tensor 'extra.weight'"):
        assert expected in out.stderr, (expected, out.stderr)

    (tmp_path / "job.yaml").write_text(JOB.format(name="nofile", rounds=1, seed=0) + "init: {file: none.safetensors}\n")
    out = edgeswarm("train", str(tmp_path / "job.yaml"), "--hub", "mqtt://127.0.0.1:1", check=False)
    assert out.returncode == 2 and "cannot read the weights file" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    (tmp_path / "job.yaml").write_text(JOB.format(name="junk", rounds=1, seed=0) + "init: {file: junk.safetensors}\n")
    out = edgeswarm("train", str(tmp_path / "job.yaml"), "--hub", "mqtt://127.0.0.1:1", check=False)
    assert out.returncode == 2 and "is not a safetensors file" in out.stderr and "Traceback" not in out.stderr


def test_state_problems_lists_every_difference() -> None:
    good = build_model(MODEL).state_dict()
    assert state_problems(specs_of(good), MODEL) == []
    other = ModelSpec(name="mlp", config={"hidden": 8, "layers": 2})
    problems = state_problems(specs_of(good), other)
    assert problems and all("has shape" in p for p in problems)


def test_a_model_file_with_tied_weights_round_trips(tmp_path: Path) -> None:
    """GPT-2 ties its embedding and output weights: the file holds both names, and loads back strictly."""
    spec = ModelSpec(name="gpt2", config={"vocab_size": 32, "seq_len": 8, "n_layer": 1, "n_embd": 16, "n_head": 2})
    model = build_model(spec)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # away from the seed's weights, so a model that did not load the file differs
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    path = tmp_path / "gpt2.safetensors"
    size, sha256 = write_model_file(path, model.state_dict(), {"format": "pt", "edgeswarm.model": "gpt2"})
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file was renamed"
    read = read_model_file(path, max_bytes=size)
    assert (read.file_bytes, read.sha256, read.metadata) == (size, sha256, {"format": "pt", "edgeswarm.model": "gpt2"})
    assert state_problems(specs_of(read.tensors), spec) == []
    fresh = build_model(spec)
    x = example_input(spec, 2, seed=1)
    with torch.no_grad():
        assert not torch.equal(fresh(x), model(x))
        fresh.load_state_dict(load_file(path), strict=True)
        assert torch.equal(fresh(x), model(x))
    with pytest.raises(ConfigError, match="more than the .*EDGESWARM_CHECKPOINT_MAX_BYTES"):
        read_model_file(path, max_bytes=size - 1)


def test_a_local_cluster_keeps_its_checkpoints_in_its_workdir_unless_told(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGESWARM_CHECKPOINT_DIR", raising=False)
    spec = cluster_of(1)
    assert LocalCluster(spec, workdir=tmp_path / "w").checkpoint_dir == (tmp_path / "w" / "checkpoints").resolve()
    chosen = LocalCluster(spec, workdir=tmp_path / "w", extra_env={"EDGESWARM_CHECKPOINT_DIR": str(tmp_path / "x")})
    assert chosen.checkpoint_dir == tmp_path / "x"
    monkeypatch.setenv("EDGESWARM_CHECKPOINT_DIR", str(tmp_path / "env"))
    assert LocalCluster(spec, workdir=tmp_path / "w").checkpoint_dir == tmp_path / "env"
