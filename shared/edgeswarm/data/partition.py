"""Federated partitions of a labelled training set over N devices, and the view a device reads its own part through.

Three kinds (``PartitionSpec.kind``), each a pure function of (labels, N, spec):

- "iid": a seeded permutation of the sample ids cut into N runs whose sizes differ by at most one.
- "dirichlet": for each class k, ``p_k ~ Dir_N(alpha)`` gives class k's proportions across the N devices (spec
  §10.2); the class's samples, shuffled, are cut at the rounded cumulative proportions. alpha 0.1 is strongly
  non-IID (most devices hold one or two classes), 1.0 mildly.
- "label-skew": every device holds exactly ``classes_per_device`` classes (the "#C=c" setting). Classes are dealt
  round-robin from a seeded permutation of the classes present, so that each class has ``floor(N*c/C)`` or
  ``ceil(N*c/C)`` holders, and each class's samples are shared among its holders in near-equal runs.

Every device gets at least one sample:

- "iid" and "label-skew" by construction, refusing (ConfigError) the inputs where that cannot hold: fewer samples
  than devices, or a class with fewer samples than devices holding it;
- "dirichlet" by a repair after the draw: each device left empty (in id order) takes one sample from the device
  that then holds the most (lowest id on ties), out of that donor's largest class (lowest class on ties), chosen by
  the same seeded generator. At most N samples move, the donor's class mix changes least, and the receiver holds a
  single class, as strongly skewed as the draw meant. It needs at least N samples (ConfigError otherwise).

A device computes the same partition from the spec and the training labels alone, and reads its samples through
``DeviceDataset``, which maps its local ids 0..n_i-1 to its global ids and never reads another device's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeswarm.data.base import Dataset, Split
from edgeswarm.errors import ConfigError, DataError
from edgeswarm.values.federated import PartitionSpec

# Leading words of the generator seeds, one per kind, so that two kinds with the same seed draw unrelated numbers.
_TAG = {"iid": 0x49494400, "dirichlet": 0x44495200, "label-skew": 0x534B4557}
# Partitions are computed in memory from the labels; a bound keeps a claimed device count from allocating N rows.
MAX_DEVICES = 100_000


@dataclass(frozen=True)
class Partition:
    """Which training samples each device holds.

    ``device_ids[d]`` is device d's sorted, read-only int64 array of global training ids (never empty; the arrays
    are disjoint). ``histograms[d, c]`` counts device d's samples of class c (shape (N, num_classes), read-only).
    """

    spec: PartitionSpec
    num_classes: int
    device_ids: tuple[np.ndarray, ...]
    histograms: np.ndarray

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    def ids(self, device: int) -> np.ndarray:
        """Device ``device``'s global training ids. Raises ConfigError for a device outside 0..N-1."""
        return self.device_ids[self._check(device)]

    def sizes(self) -> np.ndarray:
        """|D^i| of every device: an int64 array of shape (N,)."""
        return self.histograms.sum(axis=1)

    def histogram(self, device: int) -> np.ndarray:
        """Device ``device``'s label histogram: int64 counts of shape (num_classes,)."""
        return self.histograms[self._check(device)]

    def _check(self, device: int) -> int:
        if isinstance(device, bool) or not isinstance(device, int | np.integer) or not 0 <= device < self.num_devices:
            raise ConfigError(f"device {device!r} is not one of the partition's devices 0..{self.num_devices - 1}")
        return int(device)


def partition_labels(labels: np.ndarray, num_devices: int, spec: PartitionSpec,
                     num_classes: int | None = None) -> Partition:
    """The partition ``spec`` describes of the training samples whose class labels are ``labels`` (shape (n,),
    integers in [0, num_classes); sample id = position) over ``num_devices`` devices.

    ``num_classes`` defaults to ``max(labels) + 1``. The result depends only on the arguments. Raises ConfigError
    for labels that are not a flat array of class indices, a device count outside 1..MAX_DEVICES, fewer samples
    than devices, ``classes_per_device`` above the number of classes present, or (label-skew) a class with fewer
    samples than the devices dealt it.
    """
    y = _check_labels(labels, num_classes)
    classes = int(num_classes) if num_classes is not None else (int(y.max()) + 1 if len(y) else 0)
    if isinstance(num_devices, bool) or not isinstance(num_devices, int | np.integer) or not (
            1 <= num_devices <= MAX_DEVICES):
        raise ConfigError(f"num_devices must be an integer in 1..{MAX_DEVICES}, not {num_devices!r}")
    n_dev = int(num_devices)
    if len(y) < n_dev:
        raise ConfigError(f"{len(y)} training samples cannot give each of {n_dev} devices one: use fewer devices "
                          "or a larger training set")
    rng = np.random.default_rng([_TAG[spec.kind], spec.seed, n_dev])
    if spec.kind == "iid":
        owner = _iid(len(y), n_dev, rng)
    elif spec.kind == "dirichlet":
        assert spec.alpha is not None
        owner = _dirichlet(y, classes, n_dev, spec.alpha, rng)
    else:
        assert spec.classes_per_device is not None
        owner = _label_skew(y, classes, n_dev, spec.classes_per_device, rng)
    return _build(spec, classes, y, owner, n_dev)


def partition_dataset(dataset: Dataset, num_devices: int, spec: PartitionSpec) -> Partition:
    """``partition_labels`` over ``dataset``'s training split. Reads every training label (only labels: for the
    file kinds that is an array lookup; the synthetic "teacher" kind generates the samples to label them).
    Raises ConfigError for data sets whose labels are not one class per sample (next-token targets)."""
    if dataset.label_shape != ():
        raise ConfigError(f"data set {dataset.kind!r} has labels of shape {dataset.label_shape} per sample: "
                          "partitions by class need one class label per sample")
    labels = dataset.labels(np.arange(dataset.train_size, dtype=np.int64), "train").numpy()
    return partition_labels(labels, num_devices, spec, dataset.num_classes)


def _check_labels(labels: np.ndarray, num_classes: int | None) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or (y.size and y.dtype.kind not in "iu"):
        raise ConfigError(f"labels must be a flat array of class indices, not shape {y.shape} dtype {y.dtype}")
    y = y.astype(np.int64, copy=False)
    if num_classes is not None and (isinstance(num_classes, bool) or num_classes < 1):
        raise ConfigError(f"num_classes must be an integer >= 1, not {num_classes!r}")
    if y.size and (y.min() < 0 or (num_classes is not None and y.max() >= num_classes)):
        raise ConfigError(f"labels range over {int(y.min())}..{int(y.max())}, outside 0..{(num_classes or 1) - 1}")
    return y


def _iid(n: int, n_dev: int, rng: np.random.Generator) -> np.ndarray:
    owner = np.empty(n, dtype=np.int64)
    for d, part in enumerate(np.array_split(rng.permutation(n), n_dev)):
        owner[part] = d
    return owner


def _dirichlet(y: np.ndarray, classes: int, n_dev: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    owner = np.empty(len(y), dtype=np.int64)
    for k in range(classes):
        idx = np.flatnonzero(y == k)
        rng.shuffle(idx)
        p = rng.dirichlet(np.full(n_dev, alpha))
        if not np.isfinite(p).all() or p.sum() <= 0:  # a draw that underflowed everywhere: give the class to one
            p = np.eye(n_dev)[int(rng.integers(n_dev))]
        cuts = np.round(np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
        for d, part in enumerate(np.split(idx, np.clip(cuts, 0, len(idx)))):
            owner[part] = d
    _fill_empty_devices(owner, y, classes, n_dev, rng)
    return owner


def _fill_empty_devices(owner: np.ndarray, y: np.ndarray, classes: int, n_dev: int,
                        rng: np.random.Generator) -> None:
    counts = np.bincount(owner, minlength=n_dev)
    for d in np.flatnonzero(counts == 0).tolist():
        donor = int(np.argmax(counts))  # argmax takes the lowest id on ties
        held = np.flatnonzero(owner == donor)
        largest = int(np.argmax(np.bincount(y[held], minlength=classes)))
        candidates = held[y[held] == largest]
        owner[candidates[int(rng.integers(len(candidates)))]] = d
        counts[donor] -= 1
        counts[d] = 1


def _label_skew(y: np.ndarray, classes: int, n_dev: int, per_device: int, rng: np.random.Generator) -> np.ndarray:
    present = np.flatnonzero(np.bincount(y, minlength=classes) > 0)
    if per_device > len(present):
        raise ConfigError(f"classes_per_device is {per_device} but the training labels hold only {len(present)} "
                          f"classes; use at most {len(present)}")
    order = present[rng.permutation(len(present))]
    holders: dict[int, list[int]] = {int(k): [] for k in present}
    for d in range(n_dev):
        for j in range(per_device):
            holders[int(order[(d * per_device + j) % len(order)])].append(d)
    owner = np.full(len(y), -1, dtype=np.int64)
    for k, devices in holders.items():
        idx = np.flatnonzero(y == k)
        if not devices:
            continue  # fewer devices x classes than classes: nobody holds k, so its samples go unused
        if len(idx) < len(devices):
            raise ConfigError(f"class {k} has {len(idx)} training samples but {len(devices)} devices hold it, so "
                              "some would get none; use fewer devices or fewer classes_per_device")
        rng.shuffle(idx)
        for d, part in zip(devices, np.array_split(idx, len(devices)), strict=True):
            owner[part] = d
    return owner


def _build(spec: PartitionSpec, classes: int, y: np.ndarray, owner: np.ndarray, n_dev: int) -> Partition:
    used = owner >= 0
    order = np.argsort(owner[used], kind="stable")
    ids_used = np.flatnonzero(used)[order]
    bounds = np.searchsorted(owner[used][order], np.arange(n_dev + 1))
    device_ids = []
    for d in range(n_dev):
        ids = np.array(ids_used[bounds[d]:bounds[d + 1]], dtype=np.int64)  # already ascending: stable sort
        ids.setflags(write=False)
        device_ids.append(ids)
    histograms = np.zeros((n_dev, classes), dtype=np.int64)
    np.add.at(histograms, (owner[used], y[used]), 1)
    histograms.setflags(write=False)
    assert all(len(ids) for ids in device_ids), "every device holds at least one sample"
    return Partition(spec=spec, num_classes=classes, device_ids=tuple(device_ids), histograms=histograms)


class DeviceDataset(Dataset):
    """One device's training partition of ``base``: local training id k is global training id ``ids[k]``, so
    ``train_size`` is |D^i| and everything that walks ids 0..train_size-1 (``round_sample_ids``, say) walks this
    device's samples only. Only the asked ids are read from ``base``. The test split is ``base``'s, whole: every
    device evaluates on the same held-out set."""

    def __init__(self, base: Dataset, ids: np.ndarray) -> None:
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise DataError(f"a device's sample ids must be a non-empty flat integer array, not shape {arr.shape} "
                            f"dtype {arr.dtype}")
        if int(arr.min()) < 0 or int(arr.max()) >= base.train_size:
            raise DataError(f"a device's sample ids must lie in 0..{base.train_size - 1}, the training split of "
                            f"{base.kind!r}")
        super().__init__(kind=base.kind, train_size=len(arr), test_size=base.test_size,
                         input_shape=base.input_shape, input_dtype=base.input_dtype,
                         num_classes=base.num_classes, label_shape=base.label_shape)
        self._base = base
        self._global = arr.astype(np.int64)
        self._global.setflags(write=False)

    def _map(self, ids: np.ndarray, split: Split) -> np.ndarray:
        return self._global[ids] if split == "train" else ids

    def _inputs(self, ids: np.ndarray, split: Split) -> np.ndarray:
        return self._base.inputs(self._map(ids, split), split).numpy()

    def _labels(self, ids: np.ndarray, split: Split) -> np.ndarray:
        return self._base.labels(self._map(ids, split), split).numpy()

    def _batch(self, ids: np.ndarray, split: Split) -> tuple[np.ndarray, np.ndarray]:
        x, y = self._base.batch(self._map(ids, split), split)
        return x.numpy(), y.numpy()


def device_view(dataset: Dataset, partition: Partition, device: int) -> DeviceDataset:
    """Device ``device``'s view of ``dataset``'s training split under ``partition`` (see ``DeviceDataset``).
    Raises ConfigError for an unknown device, DataError when the partition does not fit the data set."""
    return DeviceDataset(dataset, partition.ids(device))
