"""HPP arithmetic without messaging: routing (AC-14), the activation bound (AC-15) and gradient equivalence
(AC-13) of a whole round run by replicas in one process."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edgeswarm.errors import PlanningError
from edgeswarm.hpp.compute import StageCompute, StageError
from edgeswarm.hpp.routing import pieces, route_ids, routing_matrix, stage_sample_ids
from edgeswarm.models.zoo import build_model
from edgeswarm.values.profiles import ModelSpec
from hpp_simulation import StageLayout, build_replicas, run_round

MLP = ModelSpec(name="mlp", config={"hidden": 64, "layers": 2, "seed": 3})


def test_routing_matrix_of_the_spec_and_random_shares() -> None:
    """AC-14: the example, and row and column sums for random shares."""
    assert routing_matrix([40, 24], [32, 16, 16]).tolist() == [[20, 10, 10], [12, 6, 6]]
    rng = np.random.default_rng(0)
    for _ in range(500):
        b = int(rng.integers(1, 200))
        a = np.bincount(rng.integers(0, int(rng.integers(1, 6)), b), minlength=1)
        c = np.bincount(rng.integers(0, int(rng.integers(1, 6)), b), minlength=1)
        x = routing_matrix(a.tolist(), c.tolist())
        assert (x >= 0).all() and x.sum(axis=1).tolist() == a.tolist() and x.sum(axis=0).tolist() == c.tolist()
    with pytest.raises(PlanningError, match="same micro-batch size"):
        routing_matrix([3, 4], [8])


def test_every_sample_goes_back_to_the_device_that_ran_its_forward() -> None:
    """AC-14: the pieces a receiver gets are exactly the rows a sender sent, so gradient rows can go back."""
    shares = [[40, 24], [32, 16, 16], [64]]
    ids = np.arange(1000, 1064)
    held = stage_sample_ids(shares, ids)
    assert [[len(h) for h in stage] for stage in held] == shares
    for stage in held:
        assert sorted(np.concatenate(stage).tolist()) == ids.tolist()
    x = routing_matrix(shares[0], shares[1])
    for pc in pieces(x):
        sent = held[0][pc.sender][pc.sender_start:pc.sender_start + pc.rows]
        got = held[1][pc.receiver][pc.receiver_start:pc.receiver_start + pc.rows]
        assert sent.tolist() == got.tolist()
    assert [r.tolist() for r in route_ids(held[1], routing_matrix(shares[1], shares[2]))] == [
        np.concatenate(held[1]).tolist()]


def _single_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def _sgd(lr: float):
    def step(stage: StageCompute) -> None:
        with torch.no_grad():
            for p in stage.parameters():
                p -= lr * p.grad
                p.grad = None
    return step


@pytest.mark.parametrize("layout", [
    [StageLayout(0, 3, (40, 24)), StageLayout(3, 6, (32, 16, 16))],  # AC-13: HPP with uneven shares
    [StageLayout(0, 6, (20, 30, 14))],  # pure DP, uneven
    [StageLayout(0, 2, (64,)), StageLayout(2, 4, (64,)), StageLayout(4, 6, (64,))],  # pure PP
], ids=["hpp", "dp", "pp"])
def test_one_round_equals_single_process_training(layout: list[StageLayout]) -> None:
    """AC-13: after one round every replica's weights equal single-process SGD on the same 256 samples."""
    torch.manual_seed(0)
    model = build_model(MLP)
    reference = copy.deepcopy(model)
    m, b = 4, 64
    x = torch.randn(m * b, 1, 28, 28)
    y = torch.randint(0, 10, (m * b,))
    replicas = build_replicas(model, layout, loss_scale=1.0 / (m * b))
    result = run_round(replicas, layout, x, y, m, step=_sgd(0.5))
    _single_step(reference, x, y, 0.5)
    with torch.no_grad():
        expected_loss = float(torch.nn.functional.cross_entropy(build_model(MLP)(x), y))
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    ref_params = dict(reference.named_parameters())  # stages keep the model's parameter names
    initial = dict(build_model(MLP).named_parameters())
    assert all(not torch.allclose(ref_params[n], initial[n]) for n in ref_params), "the step must move every weight"
    compared = set()
    for stage, group in zip(layout, replicas, strict=True):
        for replica in group:
            for name, p in replica.module.named_parameters():
                want = ref_params[name]
                assert torch.allclose(p, want, rtol=1e-5, atol=1e-7), (stage, name)
                compared.add(name)
    assert compared == set(ref_params)
    # AC-15: no device held more micro-batches than its warm-up count.
    ks = [min(2 * (len(layout) - p) - 1, m) for p in range(len(layout))]
    assert all(peak <= k for k, group in zip(ks, result.peak_live, strict=True) for peak in group)
    assert result.peak_live[0][0] == ks[0]


def test_stage_refuses_out_of_order_work() -> None:
    stage = StageCompute(torch.nn.Linear(4, 2), first=False, last=False)
    with pytest.raises(StageError, match="without its forward"):
        stage.backward(0, torch.zeros(3, 2))
    stage.forward(0, torch.zeros(3, 4))
    with pytest.raises(StageError, match="already ran forward"):
        stage.forward(0, torch.zeros(3, 4))
    with pytest.raises(StageError, match="gradient of shape"):
        stage.backward(0, torch.zeros(5, 2))


@pytest.mark.parametrize("forced", [False, True], ids=["planned", "dp-group"])
def test_a_planned_job_trains_in_process_and_beats_chance(forced: bool) -> None:
    """A plan's layout on three unequal devices (the planner's own, from a real profile, or one with a two-device
    data-parallel front stage) trains the teacher task: the loss falls and held-out accuracy beats chance."""
    from edgeswarm.hpp.spec import parse_job
    from edgeswarm.planning.hpp.asteroid import plan_asteroid
    from edgeswarm.planning.hpp.types import PlanOptions
    from edgeswarm.profiling.compute import profile_model
    from edgeswarm.values.profiles import ClusterProfile, DeviceInfo, DeviceProfileEntry, LinkProfile
    from hpp_simulation import layout_of, train_in_process

    spec = ModelSpec(name="lenet5", config={"in_channels": 1, "image_size": 16, "width": 0.5})
    model, compute = profile_model(spec, [1, 8, 32], repeats=1, warmup=0)
    # Times proportional to batch size, not the one-shot measurement: a cold first call would make a slow device
    # look useless at small batches and the plan would change from run to run.
    per_sample = [[20e-6 * b for b in compute.batch_sizes] for _ in compute.forward_s]
    entries = []
    for name, slow, budget in (("a", 1.0, 2**30), ("b", 2.0, 2**30), ("c", 4.0, 2**30)):
        scaled = compute.model_copy(update={"forward_s": [[t * slow for t in r] for r in per_sample],
                                            "backward_s": [[2 * t * slow for t in r] for r in per_sample]})
        entries.append(DeviceProfileEntry(device=DeviceInfo(node=name, fingerprint=name, memory_budget_bytes=budget),
                                          compute=scaled))
    links = [LinkProfile(src=a, dst=b, bandwidth_bps=12.5e6) for a, b in (("a", "b"), ("a", "c"), ("b", "c"))]
    cluster = ClusterProfile(model=model, devices=entries, links=links)
    options = PlanOptions(micro_batch_size=32, micro_batches=4)
    if forced:
        from edgeswarm.planning.hpp.assemble import assemble_plan
        from edgeswarm.planning.hpp.costmodel import CostModel

        plan = assemble_plan(CostModel(cluster, options), [(0, 5, (0, 1)), (5, len(model.units), (2,))], "hpp")
        assert plan.stages[0].shares[0] > plan.stages[0].shares[1] > 0  # uneven, by speed
    else:
        plan = plan_asteroid(cluster, options)
    job = parse_job({"name": "lenet", "model": spec.model_dump(), "data": {"kind": "teacher", "size": 2048},
                     "global_batch": 128, "micro_batches": 4, "optimizer": {"name": "momentum", "lr": 0.05},
                     "rounds": 60})
    run = train_in_process(job, plan)
    losses = [r.loss for r in run.rounds]
    assert sum(len(s.shares) for s in layout_of(plan)) == 3
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert run.test_accuracy > 0.3, run.test_accuracy  # chance is 0.1


def test_a_device_with_no_samples_adds_nothing_and_still_steps() -> None:
    """Alg. 1 may leave a device with share 0: the round still equals single-process training."""
    torch.manual_seed(1)
    model = build_model(MLP)
    reference = copy.deepcopy(model)
    layout = [StageLayout(0, 3, (64, 0)), StageLayout(3, 6, (0, 48, 16))]
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    replicas = build_replicas(model, layout, loss_scale=1.0 / 128)
    run_round(replicas, layout, x, y, 2, step=_sgd(0.5))
    _single_step(reference, x, y, 0.5)
    want = dict(reference.named_parameters())
    for group in replicas:
        for replica in group:
            for name, p in replica.module.named_parameters():
                assert torch.allclose(p, want[name], rtol=1e-5, atol=1e-7), name


def test_warm_up_leaves_no_trace() -> None:
    """The stage-worker's warm-up pass changes no parameter, BatchNorm statistic, gradient or random state."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Dropout(0.5),
                                 torch.nn.Flatten())
    stage = StageCompute(module, first=False, last=False)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.random.get_rng_state()
    stage.warm_up(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())
    assert torch.equal(rng, torch.random.get_rng_state())


def test_a_first_stage_without_weights_warms_up_and_runs_a_micro_batch() -> None:
    """Re-planning can leave the first stage with only weightless units (a flatten): nothing to back-propagate."""
    stage = StageCompute(torch.nn.Flatten(), first=True, last=False)
    x = torch.randn(3, 2, 2)
    stage.warm_up(x)
    out = stage.forward(0, x)
    assert out.shape == (3, 4)
    assert stage.backward(0, torch.ones(3, 4)) is None
    assert stage.live == 0


def test_held_bytes_are_counted_once_per_input_shape_and_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage counts what autograd saves for a forward once per input shape (the count's hooks cost CPU on every
    saved tensor), and every later forward of that shape holds exactly what a fresh count says."""
    import edgeswarm.hpp.compute as stage_compute
    from edgeswarm.models.saved import saved_for_backward

    counts: list[int] = []

    def counting(module: torch.nn.Module):  # type: ignore[no-untyped-def]
        counts.append(1)
        return saved_for_backward(module)

    monkeypatch.setattr(stage_compute, "saved_for_backward", counting)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                 torch.nn.Flatten(), torch.nn.Linear(64, 2))
    stage = StageCompute(module, first=False, last=False)

    def fresh(batch: int) -> int:
        x = torch.randn(batch, 3, 6, 6).requires_grad_(True)
        with saved_for_backward(module) as saved:
            module(x)
        return saved.nbytes

    held = []
    for mb, batch in enumerate((2, 2, 5, 2)):
        stage.forward(mb, torch.randn(batch, 3, 6, 6))
        held.append(stage.held_bytes)
    assert held[0] == fresh(2) > 0
    assert held[1] == 2 * fresh(2)
    assert held[2] == 2 * fresh(2) + fresh(5) and fresh(5) > fresh(2)
    assert held[3] == 3 * fresh(2) + fresh(5)
    assert len(counts) == 2  # batches of 2 and 5: the second and fourth forwards reuse the first's count
    assert stage.peak_held_bytes == held[3]
