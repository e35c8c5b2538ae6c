"""docs/data.md is enough to rebuild the digits split and the federated partitions: each is rebuilt here from the
page's description alone (numpy, torch and scikit-learn, no edgeswarm code) and compared with what edgeswarm
computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from edgeswarm.data import open_dataset
from edgeswarm.data.partition import partition_labels
from edgeswarm.values.federated import PartitionSpec
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec


def digits_as_documented(side: int, channels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    bunch = load_digits()
    images, y = np.asarray(bunch.images, dtype=np.float32), np.asarray(bunch.target, dtype=np.int64)
    rng = np.random.default_rng(0x44494749)
    train, test = [], []
    for c in range(10):
        rows = rng.permutation(np.flatnonzero(y == c))
        cut = round(0.2 * len(rows))
        test.append(rows[:cut])
        train.append(rows[cut:])
    train_rows, test_rows = rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))
    scaled = images[train_rows] / 16
    mean, std = scaled.mean(), scaled.std()

    def model_input(rows: np.ndarray) -> np.ndarray:
        x = torch.from_numpy((images[rows] / np.float32(16) - np.float32(mean)) / np.float32(std)).reshape(-1, 1, 8, 8)
        x = torch.nn.functional.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
        return x.expand(-1, channels, side, side).numpy()

    return model_input(train_rows), y[train_rows], model_input(test_rows), y[test_rows]


def test_the_digits_split_and_inputs_as_the_page_describes_them() -> None:
    model = ModelSpec(name="lenet5", config={"num_classes": 10})  # 1 channel, 32x32
    data = open_dataset(DatasetSpec(kind="digits"), model)
    x_train, y_train, x_test, y_test = digits_as_documented(32, 1)
    assert (data.train_size, data.test_size) == (1438, 359)
    got_x, got_y = data.batch(np.arange(data.train_size), "train")
    assert torch.equal(got_y, torch.from_numpy(y_train))
    np.testing.assert_allclose(got_x.numpy(), x_train, rtol=0, atol=1e-6)
    got_x, got_y = data.batch(np.arange(data.test_size), "test")
    assert torch.equal(got_y, torch.from_numpy(y_test))
    np.testing.assert_allclose(got_x.numpy(), x_test, rtol=0, atol=1e-6)


TAGS = {"iid": 0x49494400, "dirichlet": 0x44495200, "label-skew": 0x534B4557}


def partition_as_documented(y: np.ndarray, spec: PartitionSpec, classes: int) -> list[np.ndarray]:
    n, devices = len(y), spec.devices
    rng = np.random.default_rng([TAGS[spec.kind], spec.seed, devices])
    owner = np.full(n, -1)
    if spec.kind == "iid":
        for d, run in enumerate(np.array_split(rng.permutation(n), devices)):
            owner[run] = d
    elif spec.kind == "dirichlet":
        for k in range(classes):
            ids = np.flatnonzero(y == k)
            rng.shuffle(ids)
            p = rng.dirichlet([spec.alpha] * devices)
            for d, piece in enumerate(np.split(ids, np.round(np.cumsum(p)[:-1] * len(ids)).astype(int))):
                owner[piece] = d
        counts = np.bincount(owner, minlength=devices)
        for d in np.flatnonzero(counts == 0):
            donor = int(np.argmax(counts))
            held = np.flatnonzero(owner == donor)
            largest = int(np.argmax(np.bincount(y[held], minlength=classes)))
            candidates = held[y[held] == largest]
            owner[candidates[int(rng.integers(len(candidates)))]] = d
            counts[donor] -= 1
            counts[d] = 1
    else:
        c = spec.classes_per_device
        present = np.flatnonzero(np.bincount(y, minlength=classes) > 0)
        order = present[rng.permutation(len(present))]
        holders: dict[int, list[int]] = {int(k): [] for k in present}
        for d in range(devices):
            for j in range(c):
                holders[int(order[(d * c + j) % len(order)])].append(d)
        for k, ds in holders.items():
            ids = np.flatnonzero(y == k)
            if ds:
                rng.shuffle(ids)
                for d, piece in zip(ds, np.array_split(ids, len(ds)), strict=True):
                    owner[piece] = d
    return [np.flatnonzero(owner == d) for d in range(devices)]


@pytest.mark.parametrize("spec", [PartitionSpec(kind="iid", devices=4, seed=3),
                                  PartitionSpec(kind="dirichlet", devices=5, alpha=0.1, seed=1),
                                  PartitionSpec(kind="dirichlet", devices=40, alpha=0.05, seed=2),  # empty devices
                                  PartitionSpec(kind="label-skew", devices=6, classes_per_device=2, seed=4)])
def test_the_partitions_as_the_page_describes_them(spec: PartitionSpec) -> None:
    y = load_digits().target[:1438].astype(np.int64)
    ours = partition_labels(y, spec.devices, spec, 10)
    rebuilt = partition_as_documented(y, spec, 10)
    assert [a.tolist() for a in ours.device_ids] == [b.tolist() for b in rebuilt]
