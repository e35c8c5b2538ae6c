"""Federated partitions (edgeswarm.data.partition) and the bundled digits data set (edgeswarm.data.digits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from edgeswarm.data import open_dataset
from edgeswarm.data.base import Dataset
from edgeswarm.data.partition import (
    DeviceDataset,
    PartitionSpec,
    device_view,
    partition_dataset,
    partition_labels,
)
from edgeswarm.errors import ConfigError, DataError
from edgeswarm.models.zoo import build_model
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec

DIGITS = DatasetSpec(kind="digits")
SPECS = [PartitionSpec(kind="iid", seed=3), PartitionSpec(kind="dirichlet", alpha=0.1, seed=3),
         PartitionSpec(kind="dirichlet", alpha=1.0, seed=3), PartitionSpec(kind="dirichlet", alpha=0.01, seed=3),
         PartitionSpec(kind="label-skew", classes_per_device=2, seed=3)]


def _labels(n: int = 1797, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 10, n)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.alpha}-{s.classes_per_device}")
@pytest.mark.parametrize("devices", [1, 10, 100])
def test_every_sample_goes_to_one_device_and_every_device_gets_one(spec: PartitionSpec, devices: int) -> None:
    y = _labels()
    p = partition_labels(y, devices, spec, 10)
    assert p.num_devices == devices
    every = np.concatenate(p.device_ids)
    assert len(np.unique(every)) == len(every), "devices' samples are disjoint"
    if spec.kind != "label-skew" or devices * 2 >= 10:
        assert len(every) == len(y), "every sample is used"
    assert p.sizes().min() >= 1
    for d in range(devices):
        ids = p.ids(d)
        assert np.all(np.diff(ids) > 0) and not ids.flags.writeable
        assert np.array_equal(p.histogram(d), np.bincount(y[ids], minlength=10))
    again = partition_labels(y, devices, spec, 10)
    assert all(np.array_equal(a, b) for a, b in zip(p.device_ids, again.device_ids, strict=True)), "deterministic"


def test_the_kinds_skew_as_they_should() -> None:
    y = _labels()
    classes_held = {}
    for spec in SPECS:
        p = partition_labels(y, 100, spec, 10)
        classes_held[(spec.kind, spec.alpha)] = float((p.histograms > 0).sum(axis=1).mean())
    assert classes_held[("iid", None)] > 8
    assert classes_held[("label-skew", None)] == 2.0
    # A smaller alpha concentrates each device on fewer classes.
    assert classes_held[("dirichlet", 0.01)] < classes_held[("dirichlet", 0.1)] < classes_held[("dirichlet", 1.0)]
    iid = partition_labels(y, 100, SPECS[0], 10).sizes()
    assert iid.max() - iid.min() <= 1
    # A different seed draws a different partition.
    other = partition_labels(y, 100, PartitionSpec(kind="dirichlet", alpha=0.1, seed=4), 10)
    assert not np.array_equal(other.histograms, partition_labels(y, 100, SPECS[1], 10).histograms)


def test_label_skew_deals_classes_evenly() -> None:
    y = _labels()
    p = partition_labels(y, 20, PartitionSpec(kind="label-skew", classes_per_device=3), 10)
    holders = (p.histograms > 0).sum(axis=0)
    assert holders.min() == 6 and holders.max() == 6  # 20 devices x 3 classes = 60 = 6 per class


def test_tiny_alpha_still_gives_every_device_a_sample() -> None:
    """With alpha 0.01 nearly every class goes to one device; the repair gives the empty devices one sample."""
    y = _labels(200)
    p = partition_labels(y, 150, PartitionSpec(kind="dirichlet", alpha=0.01, seed=1), 10)
    assert p.sizes().min() == 1 and p.sizes().sum() == 200


@pytest.mark.parametrize(("fields", "says"), [
    ({"kind": "dirichlet"}, "needs alpha > 0"),
    ({"kind": "dirichlet", "alpha": 0}, "greater than 0"),
    ({"kind": "dirichlet", "alpha": float("nan")}, "finite"),
    ({"kind": "iid", "alpha": 0.1}, "alpha applies to kind 'dirichlet' only"),
    ({"kind": "label-skew"}, "needs classes_per_device"),
    ({"kind": "label-skew", "classes_per_device": 0}, "greater than or equal to 1"),
    ({"kind": "dirichlet", "alpha": 1, "classes_per_device": 2}, "classes_per_device applies to kind 'label-skew'"),
    ({"kind": "shards"}, "'iid', 'dirichlet' or 'label-skew'"),
    ({"kind": "iid", "seed": -1}, "greater than or equal to 0"),
    ({"kind": "iid", "clients": 3}, "Extra inputs"),
])
def test_bad_specs_say_what_to_change(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        PartitionSpec.model_validate(fields)


def test_partitions_that_cannot_hold_are_refused() -> None:
    y = _labels(50)
    with pytest.raises(ConfigError, match="50 training samples cannot give each of 51 devices one"):
        partition_labels(y, 51, PartitionSpec())
    with pytest.raises(ConfigError, match="classes_per_device is 11"):
        partition_labels(y, 5, PartitionSpec(kind="label-skew", classes_per_device=11))
    with pytest.raises(ConfigError, match="some would get none"):
        partition_labels(np.array([0, 1, 1, 1, 1, 1]), 6, PartitionSpec(kind="label-skew", classes_per_device=1))
    with pytest.raises(ConfigError, match="num_devices"):
        partition_labels(y, 0, PartitionSpec())
    with pytest.raises(ConfigError, match="outside 0..9"):
        partition_labels(np.array([0, 10]), 1, PartitionSpec(), 10)
    with pytest.raises(ConfigError, match="flat array"):
        partition_labels(np.zeros((3, 2), dtype=np.int64), 1, PartitionSpec())
    with pytest.raises(ConfigError, match="device 3 is not one"):
        partition_labels(y, 3, PartitionSpec()).ids(3)


class _Recording(Dataset):
    """Labels by id; records every id whose inputs were read."""

    def __init__(self, n: int) -> None:
        super().__init__(kind="npz", train_size=n, test_size=4, input_shape=(2,), input_dtype=torch.float32,
                         num_classes=10, label_shape=())
        self.read: set[int] = set()

    def _inputs(self, ids: np.ndarray, split: str) -> np.ndarray:  # type: ignore[override]
        if split == "train":
            self.read.update(ids.tolist())
        return np.stack([ids, ids], axis=1).astype(np.float32)

    def _labels(self, ids: np.ndarray, split: str) -> np.ndarray:  # type: ignore[override]
        return ids % 10


def test_a_device_reads_only_its_own_samples() -> None:
    base = _Recording(300)
    p = partition_dataset(base, 7, PartitionSpec(kind="dirichlet", alpha=0.1, seed=2))
    view = device_view(base, p, 4)
    mine = p.ids(4)
    assert isinstance(view, DeviceDataset) and view.train_size == len(mine) and view.test_size == 4
    x, y = view.batch(np.arange(view.train_size))
    assert x[:, 0].long().tolist() == mine.tolist() and y.tolist() == (mine % 10).tolist()
    assert np.bincount(view.labels(np.arange(view.train_size)).numpy(), minlength=10).tolist() == \
        p.histogram(4).tolist()
    assert base.read == set(mine.tolist()), "no other device's inputs were read"
    assert view.inputs([0, 1], "test")[:, 0].tolist() == [0.0, 1.0]  # the shared held-out set
    with pytest.raises(DataError, match="outside the train split"):
        view.inputs([len(mine)])
    with pytest.raises(DataError, match="lie in 0..299"):
        DeviceDataset(base, np.array([300]))


# --- digits ------------------------------------------------------------------------------------------------------


def test_digits_load_with_a_fixed_class_balanced_split() -> None:
    data = open_dataset(DIGITS, ModelSpec(name="lenet5"))
    assert (data.train_size, data.test_size, data.num_classes) == (1438, 359, 10)
    assert data.input_shape == (1, 32, 32)
    y_train = data.labels(np.arange(data.train_size)).numpy()
    y_test = data.labels(np.arange(data.test_size), "test").numpy()
    from sklearn.datasets import load_digits

    from edgeswarm.data.digits import digits_arrays

    bunch = load_digits()
    images, labels = digits_arrays()  # scikit-learn's own file, read without importing scikit-learn
    assert np.array_equal(images, bunch.images) and np.array_equal(labels, bunch.target)
    per_class = np.bincount(bunch.target, minlength=10)
    assert np.bincount(y_test, minlength=10).tolist() == np.round(0.2 * per_class).astype(int).tolist()
    assert (np.bincount(y_train, minlength=10) + np.bincount(y_test, minlength=10)).tolist() == per_class.tolist()
    x = data.inputs(np.arange(data.train_size))
    assert x.dtype == torch.float32 and abs(float(x.mean())) < 0.1 and 0.8 < float(x.std()) < 1.2
    again = open_dataset(DatasetSpec(kind="digits", seed=5), ModelSpec(name="lenet5"))
    assert torch.equal(again.inputs([0, 7], "test"), data.inputs([0, 7], "test")), "the split does not move"
    small = open_dataset(DatasetSpec(kind="digits", size=100, test_size=10), ModelSpec(name="lenet5"))
    assert (small.train_size, small.test_size) == (100, 10)
    assert torch.equal(small.inputs([3]), data.inputs([3])), "a smaller size is a prefix, same normalisation"


@pytest.mark.parametrize("model", ["lenet5", "mlp"])
def test_digits_fit_and_train_the_zoo_models(model: str) -> None:
    """A few SGD steps on digits lower the loss: the data is shaped and normalised as the model needs."""
    spec = ModelSpec(name=model)
    data = open_dataset(DIGITS, spec)
    net = build_model(spec)
    torch.manual_seed(0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    x, y = data.batch(np.arange(256))
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0]


def test_digits_specs_and_mismatched_models_are_refused() -> None:
    with pytest.raises(ValidationError, match="takes no path"):
        DatasetSpec(kind="digits", path="/data")
    with pytest.raises(ValidationError, match="noise applies to the synthetic kinds only"):
        DatasetSpec(kind="digits", noise=0.1)
    with pytest.raises(ConfigError, match="data set 'digits' gives 8x8 grey images"):
        open_dataset(DIGITS, ModelSpec(name="lenet5", config={"num_classes": 7}))
    with pytest.raises(ConfigError, match="data set 'digits'"):
        open_dataset(DIGITS, ModelSpec(name="bert-small"))
    with pytest.raises(DataError, match="holds only 1438"):
        open_dataset(DatasetSpec(kind="digits", size=5000), ModelSpec(name="mlp"))
    three = open_dataset(DIGITS, ModelSpec(name="resnet18"))
    assert three.inputs([0]).shape == (1, 3, 32, 32)
