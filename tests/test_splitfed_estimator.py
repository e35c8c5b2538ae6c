"""The MEC's distribution estimator, Algorithm 1's Obtain_dis (edgeswarm.splitfed.estimator; spec §5.2)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from edgeswarm.data import open_dataset
from edgeswarm.data.base import Dataset
from edgeswarm.data.partition import device_view, partition_dataset
from edgeswarm.errors import ConfigError
from edgeswarm.models.zoo import build_model
from edgeswarm.splitfed.estimator import (
    LabelDistribution,
    auxiliary_ids,
    auxiliary_set,
    class_gradients,
    obtain_dis,
    oracle_distribution,
)
from edgeswarm.values.federated import PartitionSpec
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec

UNIFORM = np.full(10, 0.1)


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """``D_KL(p ‖ q) = Σ_c p_c ln(p_c / q_c)`` in nats, with 0·ln(0/q) = 0; +inf where p_c > 0 = q_c."""
    held = p > 0
    if (q[held] <= 0).any():
        return math.inf
    return float(np.sum(p[held] * np.log(p[held] / q[held])))


def as_array(dist: LabelDistribution) -> np.ndarray:
    """A distribution's probabilities as a float64 array of shape (C,)."""
    return np.asarray(dist.probabilities, dtype=np.float64)


def _setup(model: str) -> tuple[Dataset, torch.nn.Module, str, torch.Tensor]:
    spec = ModelSpec(name=model)
    data = open_dataset(DatasetSpec(kind="digits"), spec)
    net = build_model(spec)
    output = [name for name, _ in net.named_parameters() if name.endswith("weight")][-1]
    return data, net, output, class_gradients(net, output, auxiliary_set(data))


def _train(global_net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, seed: int) -> torch.nn.Module:
    """The device's probing training: a few plain-SGD mini-batch steps from the global model."""
    local = copy.deepcopy(global_net)
    opt = torch.optim.SGD(local.parameters(), lr=0.05)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = rng.choice(len(y), min(20, len(y)), replace=False)
        loss = torch.nn.functional.cross_entropy(local(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return local


@pytest.mark.parametrize("model", ["mlp", "lenet5"])
@pytest.mark.parametrize("mix", [{3: 0.7, 7: 0.3}, {1: 0.5, 4: 0.3, 9: 0.2}])
def test_the_estimate_puts_the_mass_on_the_devices_classes(model: str, mix: dict[int, float]) -> None:
    data, net, output, grads = _setup(model)
    labels = data.labels(np.arange(data.train_size)).numpy()
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.choice(np.flatnonzero(labels == c), int(100 * share), replace=False)
                          for c, share in mix.items()])
    x, y = data.batch(ids)
    local = _train(net, x, y, steps=10, seed=1)
    est = obtain_dis(dict(local.named_parameters())[output], dict(net.named_parameters())[output], grads)
    true = np.zeros(10)
    true[list(mix)] = list(mix.values())
    p = as_array(est)
    assert est.mode == "grad_nnls" and est.scale is not None and est.scale > 0
    assert kl_divergence(true, p) < 0.1 * kl_divergence(true, UNIFORM)
    assert set(np.argsort(p)[-len(mix):].tolist()) == set(mix), "the device's classes are the most likely ones"
    assert p[list(mix)].sum() > 0.9


def test_dirichlet_devices_are_estimated_close_to_their_histograms() -> None:
    """Devices of a Dirichlet(0.1) partition of digits, one local epoch each: the estimate is far closer to the
    device's true histogram (the oracle) than the uniform distribution is."""
    data, net, output, grads = _setup("mlp")
    partition = partition_dataset(data, 10, PartitionSpec(kind="dirichlet", alpha=0.1, seed=0))
    ratios = []
    for device in range(4):
        view = device_view(data, partition, device)
        x, y = view.batch(np.arange(view.train_size))
        local = _train(net, x, y, steps=max(1, view.train_size // 20), seed=device)
        est = obtain_dis(dict(local.named_parameters())[output], dict(net.named_parameters())[output], grads)
        oracle = as_array(oracle_distribution(partition.histogram(device)))
        ratios.append(kl_divergence(oracle, as_array(est)) / kl_divergence(oracle, UNIFORM))
    assert max(ratios) < 0.2, ratios
    assert float(np.mean(ratios)) < 0.1, ratios


def test_no_update_gives_the_uniform_distribution() -> None:
    grads = torch.randn(4, 6)
    w = torch.randn(2, 3)
    est = obtain_dis(w, w.clone(), grads)
    assert est.probabilities == (0.25,) * 4 and est.scale == 0.0


def test_the_exact_mixture_is_recovered() -> None:
    """When the update is exactly -Σ q_c g_c, NNLS finds q and the estimate is q normalised."""
    torch.manual_seed(0)
    grads = torch.randn(5, 40, dtype=torch.float64)
    q = torch.tensor([0.0, 3.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    w_g = torch.randn(8, 5, dtype=torch.float64)
    w_i = w_g - (q @ grads).reshape(8, 5)
    est = obtain_dis(w_i, w_g, grads)
    np.testing.assert_allclose(as_array(est), [0, 0.75, 0.25, 0, 0], atol=1e-9)
    assert est.residual is not None and est.residual < 1e-9 and est.scale == pytest.approx(4.0)


def test_class_gradients_leave_the_model_as_it_was() -> None:
    spec = ModelSpec(name="mlp")
    data = open_dataset(DatasetSpec(kind="digits"), spec)
    net = build_model(spec)
    net.train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    aux = auxiliary_set(data, per_class=3, seed=1)
    assert aux.labels.bincount(minlength=10).tolist() == [3] * 10
    grads = class_gradients(net, "3.weight", aux)
    assert grads.shape == (10, net[3].weight.numel()) and grads.dtype == torch.float32
    assert grads.device == net[3].weight.device
    assert net.training and all(p.grad is None for p in net.parameters())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    with pytest.raises(ConfigError, match="no parameter 'head.weight'"):
        class_gradients(net, "head.weight", aux)


def test_the_auxiliary_set_is_class_balanced_and_seeded() -> None:
    y = np.repeat(np.arange(3), [30, 5, 12])
    ids = auxiliary_ids(y, 3, per_class=10, seed=4)
    assert np.bincount(y[ids]).tolist() == [10, 5, 10]
    assert np.array_equal(ids, auxiliary_ids(y, 3, per_class=10, seed=4))
    assert not np.array_equal(ids, auxiliary_ids(y, 3, per_class=10, seed=5))
    with pytest.raises(ConfigError, match="per_class"):
        auxiliary_ids(y, 3, per_class=0)
    with pytest.raises(ConfigError, match="below 2"):
        auxiliary_ids(y, 2)


def test_the_oracle_is_the_normalised_histogram() -> None:
    assert oracle_distribution([0, 2, 6, 0]).probabilities == (0.0, 0.25, 0.75, 0.0)
    assert oracle_distribution([0, 2, 6, 0]).mode == "oracle"
    for bad in ([], [0, 0], [-1, 3], [float("nan"), 1]):
        with pytest.raises(ConfigError, match="histogram"):
            oracle_distribution(bad)


def test_a_distribution_is_validated_at_the_boundary() -> None:
    with pytest.raises(ValidationError, match="sum to 1"):
        LabelDistribution(probabilities=(0.5, 0.4), mode="oracle")
    with pytest.raises(ValidationError, match="non-negative"):
        LabelDistribution(probabilities=(1.5, -0.5), mode="oracle")
    with pytest.raises(ValidationError, match="finite"):
        LabelDistribution(probabilities=(float("nan"), 1.0), mode="oracle")
    with pytest.raises(ValidationError):
        LabelDistribution(probabilities=(1.0,), mode="guess")  # type: ignore[arg-type]


def test_obtain_dis_refuses_what_does_not_fit() -> None:
    grads = torch.randn(3, 6)
    with pytest.raises(ConfigError, match="differ"):
        obtain_dis(torch.zeros(2, 3), torch.zeros(3, 2), grads)
    with pytest.raises(ConfigError, match="expected \\(num_classes, 4\\)"):
        obtain_dis(torch.zeros(2, 2), torch.zeros(2, 2), grads)
    with pytest.raises(ConfigError, match="NaN"):
        obtain_dis(torch.full((2, 3), float("nan")), torch.zeros(2, 3), grads)
