"""Sample pruning of already-learned samples (edgeswarm.splitfed.pruning; spec §5.4), and a pruned round through
the device's own round loop (edgeswarm.splitfed.worker)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from edgeswarm.data.partition import device_view
from edgeswarm.devices.compute import resolve_compute
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import ConfigError
from edgeswarm.messages.splitfed import RoundSetup, SplitEnrol
from edgeswarm.models.zoo import build_model
from edgeswarm.runtime.program import ComputeGate
from edgeswarm.settings import Settings
from edgeswarm.splitfed import compute as compute_module
from edgeswarm.splitfed import worker
from edgeswarm.splitfed.compute import DevicePart, MecPart, Reassembly, host_array, partition_of
from edgeswarm.splitfed.pruning import PruningSpec, RoundPruner, expected_active_fraction, prune_step
from edgeswarm.values.federated import LocalTraining, PartitionSpec
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec

SPEC = PruningSpec(seed=7)


def test_the_lowest_fifth_is_learned_and_four_fifths_of_it_go() -> None:
    ids = np.arange(100, 200)
    losses = np.random.default_rng(0).permutation(100) / 10.0  # distinct: exactly 20 at or below the 20th pct
    step = prune_step(ids, losses, SPEC, device=3, round_index=2, epoch=1)
    assert step.threshold == pytest.approx(np.percentile(losses, 20))
    assert len(step.learned) == 20 and set(step.learned) == set(ids[losses <= step.threshold])
    assert len(step.dropped) == 16 and set(step.dropped) <= set(step.learned)
    assert len(step.active) == 84 and set(step.active) | set(step.dropped) == set(ids)
    assert np.all(np.diff(step.active) > 0)
    again = prune_step(ids, losses, SPEC, device=3, round_index=2, epoch=1)
    assert np.array_equal(step.dropped, again.dropped), "seeded"
    other = prune_step(ids, losses, SPEC, device=4, round_index=2, epoch=1)
    assert not np.array_equal(step.dropped, other.dropped), "each device draws its own"
    # The order the losses come in does not matter.
    order = np.random.default_rng(1).permutation(100)
    assert np.array_equal(prune_step(ids[order], losses[order], SPEC, device=3, round_index=2).dropped, step.dropped)


def test_a_round_prunes_epoch_after_epoch_and_the_next_round_brings_all_back() -> None:
    ids = np.arange(500)
    pruner = RoundPruner(ids, SPEC, device=1, round_index=0)
    rng = np.random.default_rng(2)
    sizes = [len(pruner.active)]
    dropped: set[int] = set()
    for _ in range(4):
        active = pruner.active
        step = pruner.end_epoch(active, rng.random(len(active)))
        assert not set(step.dropped) & set(pruner.active)
        dropped |= set(step.dropped.tolist())
        sizes.append(len(pruner.active))
    assert sizes == [500, 420, 353, 296, 248]  # 20th percentile by interpolation: 60 of 296 learned
    assert dropped.isdisjoint(pruner.active.tolist()), "a dropped sample stays out for the rest of the round"
    assert pruner.epoch == 4
    pruner.new_round(1)
    assert np.array_equal(pruner.active, ids) and pruner.epoch == 0
    # The planner's expectation matches the measured mean over a 5-epoch round within rounding.
    assert expected_active_fraction(5, SPEC) == pytest.approx(np.mean(sizes) / 500, abs=2e-3)


def test_pruning_off_and_degenerate_losses() -> None:
    ids = np.arange(10)
    off = prune_step(ids, np.arange(10.0), PruningSpec(enabled=False))
    assert np.array_equal(off.active, ids) and len(off.dropped) == 0
    assert expected_active_fraction(5, PruningSpec(enabled=False)) == 1.0
    # Equal losses: every sample is at the threshold, so all are learned; one sample always stays.
    tied = prune_step(ids, np.ones(10), PruningSpec(prune_ratio=1.0))
    assert len(tied.learned) == 10 and len(tied.active) == 1
    # NaN losses are never learned, and no finite loss means nothing is pruned.
    nan = prune_step(ids, np.array([np.nan] * 5 + [1.0, 2.0, 3.0, 4.0, 5.0]), SPEC)
    assert set(nan.learned.tolist()) <= {5, 6, 7, 8, 9} and {0, 1, 2, 3, 4} <= set(nan.active.tolist())
    assert len(prune_step(ids, np.full(10, np.nan), SPEC).dropped) == 0


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ConfigError, match="one loss per active sample"):
        prune_step(np.arange(3), np.zeros(2), SPEC)
    with pytest.raises(ConfigError, match="repeat"):
        prune_step(np.array([1, 1]), np.zeros(2), SPEC)
    with pytest.raises(ConfigError, match="epoch must be an integer >= 1"):
        prune_step(np.arange(3), np.zeros(3), SPEC, epoch=0)
    pruner = RoundPruner(np.arange(10), SPEC)
    with pytest.raises(ConfigError, match="not active"):
        pruner.end_epoch(np.array([11]), np.zeros(1))
    with pytest.raises(ConfigError, match="non-empty"):
        RoundPruner(np.array([], dtype=np.int64), SPEC)
    with pytest.raises(ValidationError):
        PruningSpec(percentile=120)
    with pytest.raises(ValidationError):
        PruningSpec(prune_ratio=-0.1)
    with pytest.raises(ConfigError, match="epochs"):
        expected_active_fraction(0, SPEC)


# --- a pruned round through the worker ---------------------------------------------------------------------------


class _DeviceWithMecHere(worker.DeviceProgram):
    """The stage-worker's device program with its MEC's replica in this process: the round loop (epochs, steps,
    ``last``, pruning, the report) is the worker's own; each mini-batch runs the five U-split steps here instead of
    over MQTT. Records each step's ``last`` flag (the MEC serves steps until that one)."""

    def __init__(self, mec: MecPart) -> None:
        super().__init__(SimpleNamespace(node="device-0"))  # type: ignore[arg-type]
        self.mec = mec
        self.lasts: list[bool] = []

    def _iteration(self, job: object, part: DevicePart, r: int, step: int, x: torch.Tensor, y: torch.Tensor,
                   last: bool) -> np.ndarray:
        assert step == len(self.lasts), "steps run 0, 1, 2, ... across the round's epochs"
        self.lasts.append(last)
        losses, g_mid = part.tail_step(self.mec.forward(part.front_forward(x)), y)
        part.front_backward(self.mec.backward(g_mid))
        return losses


@pytest.mark.parametrize("partition", [PartitionSpec(kind="dirichlet", alpha=0.1, devices=2, seed=3),
                                       PartitionSpec(kind="iid", devices=2, seed=3)], ids=["dirichlet-0.1", "iid"])
def test_a_pruned_round_trains_what_the_rule_keeps_and_is_whole_model_sgd_over_it(
        partition: PartitionSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pruning may cost a round only the samples it drops, never anything else: the device's round (its U-split
    # with the MEC, under a budget that makes it recompute) must equal plain whole-model SGD over the batches it
    # trained, and each epoch must train exactly the samples the rule keeps from the losses of the epoch before.
    model = ModelSpec(name="lenet5", config={"num_classes": 10})
    training = LocalTraining(epochs=4, batch_size=16, lr=0.05, recompute="always")
    setup = RoundSetup(model=model, dataset=DatasetSpec(kind="digits", size=240), partition=partition,
                       training=training)
    # Parts and reference on the one compute device the settings give (EDGESWARM_COMPUTE), computing alike: a loss
    # that differed in its last bit could change the rank that decides what is learned.
    settings = Settings()
    compute = resolve_compute(settings.compute, DeviceProfile.from_settings(settings))
    cut, index, r = 3, 0, 2
    torch.manual_seed(0)
    global_state = build_model(model).state_dict()
    part = DevicePart(setup, cut, compute=compute, gate=ComputeGate())
    part.load(Reassembly(setup, compute=compute).device_flat(global_state, cut))
    part.plan_memory(6_000_000)
    assert part.recompute_summary != "none"
    mec = MecPart(setup, cut, compute=compute)
    mec.load(global_state)
    epochs: list[list[np.ndarray]] = []  # each epoch's batches of sample ids, as the round loop drew them
    batches_of = compute_module.local_batches

    def recorded(active: np.ndarray, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
        epochs.append(batches_of(active, batch_size, rng))
        return epochs[-1]

    monkeypatch.setattr(compute_module, "local_batches", recorded)
    device = _DeviceWithMecHere(mec)
    job = SimpleNamespace(enrol=SplitEnrol(job_id="j", round=r, mec="edge-0", index=index, setup=setup))
    report = device._epochs(job, part, part.partition_data(index), r, 6_000_000, threading.Event(),  # type: ignore[arg-type]
                            0.0)
    trained = Reassembly(setup, compute=compute).full_state(cut, part.flat(), mec.state())

    dataset, split = partition_of(setup)
    view = device_view(dataset, split, index)
    reference = build_model(model).to(compute)
    reference.load_state_dict(global_state)
    opt = torch.optim.SGD(reference.parameters(), lr=training.lr, momentum=training.momentum,
                          weight_decay=training.weight_decay)
    rule = PruningSpec(percentile=training.prune_percentile, prune_ratio=training.prune_ratio, seed=partition.seed)
    active = np.arange(view.train_size)
    latest = np.zeros(view.train_size)
    assert len(epochs) == training.epochs
    for e, batches in enumerate(epochs):
        ids = np.concatenate(batches)
        assert np.array_equal(np.sort(ids), active), f"epoch {e + 1} trains each active sample once"
        for batch in batches:
            x, y = (t.to(compute) for t in view.batch(batch))
            per_sample = torch.nn.functional.cross_entropy(reference(x), y, reduction="none")
            latest[batch] = host_array(per_sample.detach().double())  # as the device part hands losses to it
            opt.zero_grad()
            per_sample.mean().backward()
            opt.step()
        if e + 1 < training.epochs:
            active = prune_step(active, latest[active], rule, device=index, round_index=r, epoch=e + 1).active
    assert report.pruned == view.train_size - len(active) > 0
    assert report.samples == view.train_size and report.iterations == sum(len(b) for b in epochs)
    assert device.lasts == [False] * (report.iterations - 1) + [True]
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6, msg=key)
