"""Stage-workers over the real broker: a 2-stage HPP round with uneven groups equals single-process training."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from edgeswarm import topics
from edgeswarm.checkpoints.store import CheckpointStore
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
from edgeswarm.profiling.types import ModelSpec
from edgeswarm.training.data import open_dataset, round_sample_ids
from edgeswarm.training.jobs import DatasetSpec, OptimizerSpec
from helpers import wait_until

MLP = ModelSpec(name="mlp", config={"hidden": 64, "layers": 2, "seed": 3})
DATA = DatasetSpec(kind="teacher", size=512, test_size=64)
GROUPS = [["w0", "w1"], ["w2", "w3", "w4"]]
SHARES = [[40, 24], [32, 16, 16]]
M, B, LR = 4, 64, 0.5


def _ask_all(client, messages: dict[str, object], timeout_s: float) -> dict[str, object]:
    expectations = {}
    for node, message in messages.items():
        exp = client.expect()
        expectations[node] = exp
        client.publish(topics.request(node, "stage-worker"), message, correlation_id=exp.correlation_id,
                       reply_to=client.reply_topic, ttl_s=timeout_s)
    return {node: (exp.wait(timeout_s) or None) for node, exp in expectations.items()}


def test_an_hpp_round_over_mqtt_equals_single_process_training(broker, make_bus, services, tmp_path: Path) -> None:
    store_dir = tmp_path / "checkpoints"
    services.start("checkpoint-store", "hub", broker.url, EDGESWARM_CHECKPOINT_DIR=str(store_dir))
    procs = [services.start("stage-worker", node, broker.url) for group in GROUPS for node in group]
    client = make_bus("coordinator-test", "cli")
    for node in ("hub", *[n for g in GROUPS for n in g]):
        client.peers.wait_for(node, "checkpoint-store" if node == "hub" else "stage-worker", timeout_s=30)

    assigns = {}
    for p, group in enumerate(GROUPS):
        for r, node in enumerate(group):
            end = 3 if p == 0 else 6
            assigns[node] = StageAssign(job_id="j1", epoch=0, stage=p, rank=r, model=MLP, start=0 if p == 0 else 3,
                                        end=end, groups=GROUPS, shares=SHARES, micro_batches=M,
                                        warmup=3 if p == 0 else 1, loss_scale=1.0 / (M * B),
                                        optimizer=OptimizerSpec(name="sgd", lr=LR), data=DATA)
    ready = _ask_all(client, assigns, 60)
    assert all(isinstance(r.body, StageReady) for r in ready.values()), ready

    # A tensor for another epoch is dropped with an error, not used.
    client.send_tensor("w2", "stage-worker", StageTensor(job_id="j1", epoch=7, round=0, stage=1, kind="activation",
                                                         sender=0), np.zeros((20, 64), dtype=np.float32))
    done = _ask_all(client, {node: RoundStart(job_id="j1", epoch=0, round=0) for node in assigns}, 120)
    assert all(isinstance(d.body, RoundDone) for d in done.values()), {n: d.body for n, d in done.items()}
    last = [d.body for n, d in done.items() if n in GROUPS[1]]
    assert sum(d.terms for d in last) == M * B
    assert all(d.peak_live <= (3 if d.stage == 0 else 1) for d in (x.body for x in done.values()))

    saved = _ask_all(client, {"w0": StageSave(job_id="j1", epoch=0, store_node="hub", version=1),
                              "w3": StageSave(job_id="j1", epoch=0, store_node="hub", version=1)}, 60)
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
    for stage in ("stage-0", "stage-1"):
        _, arrays = store.get("j1", stage)
        for name, value in arrays.items():
            assert np.allclose(value, want[name].detach().numpy(), rtol=1e-5, atol=1e-7), name
            compared.add(name)
    assert compared == set(want)

    unknown = _ask_all(client, {"w0": RoundStart(job_id="other", epoch=0, round=0)}, 30)["w0"].body
    assert isinstance(unknown, StageFailed) and unknown.reason == "not_assigned"
    assert wait_until(lambda: all(p.poll() is None for p in procs), 1)
    assert "dropped a activation tensor for job j1 epoch 7" in services.log_of(procs[2])
