"""The "digits" data set: scikit-learn's bundled handwritten digits (``sklearn.datasets.load_digits``, installed
with scikit-learn, never downloaded): 1797 grey 8x8 images of the digits 0..9.

The held-out split is fixed (not ``DatasetSpec.seed``): DIGITS_TEST_SHARE of each class, chosen by a generator of
its own seed, so test figures compare across runs; both splits are stored in a fixed shuffled order, so that
``size`` / ``test_size`` (the first samples) are class-mixed. Pixels (0..16) are scaled to [0, 1] and standardised
by the training split's mean and standard deviation; the 8x8 images are resized bilinearly to the model's side and
repeated over its channels (1 or 3) when a batch is asked for, so a large model side costs no memory up front.
"""

from __future__ import annotations

import gzip
import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from edgeswarm.data.base import Dataset, ModelFit, mismatch_error
from edgeswarm.data.files import ArrayDataset
from edgeswarm.errors import DataError
from edgeswarm.values.specs import DatasetSpec

log = logging.getLogger(__name__)

DIGITS_SIDE = 8
DIGITS_CLASSES = 10
DIGITS_TEST_SHARE = 0.2
DIGITS_SPLIT_SEED = 0x44494749
_MAX_PIXEL = 16.0


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: images [1797, 8, 8] float32 (0..16) and labels [1797] int64. Read from the file
    scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``: 64 pixels and the label a row), found without
    importing scikit-learn, which costs a process a second of CPU; through ``load_digits`` where that file is not
    there."""
    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as rows:
                table = np.loadtxt(rows, delimiter=",", dtype=np.float32)
            return table[:, :-1].reshape(-1, DIGITS_SIDE, DIGITS_SIDE), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.asarray(bunch.images, dtype=np.float32), np.asarray(bunch.target, dtype=np.int64)


def split_digits(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (train, test) row indices of the fixed split of labels ``y``: per class, round(DIGITS_TEST_SHARE * n_c)
    rows go to test; each split is then shuffled. Depends on ``y`` alone."""
    rng = np.random.default_rng(DIGITS_SPLIT_SEED)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for c in range(DIGITS_CLASSES):
        rows = rng.permutation(np.flatnonzero(y == c))
        cut = int(round(DIGITS_TEST_SHARE * len(rows)))
        test.append(rows[:cut])
        train.append(rows[cut:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def _first(rows: np.ndarray, count: int | None, what: str) -> np.ndarray:
    if count is None:
        return rows
    if count > len(rows):
        raise DataError(f"{what} asks for {count} samples but the digits split holds only {len(rows)}; lower it or "
                        "leave it unset to use them all")
    return rows[:count]


def _resizer(fit: ModelFit, mean: float, std: float) -> Callable[[np.ndarray], np.ndarray]:
    channels, side = fit.input_shape[0], fit.input_shape[1]

    def transform(rows: np.ndarray) -> np.ndarray:
        x = (rows.astype(np.float32) / np.float32(_MAX_PIXEL) - np.float32(mean)) / np.float32(std)
        t = torch.from_numpy(np.ascontiguousarray(x)).reshape(-1, 1, DIGITS_SIDE, DIGITS_SIDE)
        if side != DIGITS_SIDE and len(t):
            t = torch.nn.functional.interpolate(t, size=(side, side), mode="bilinear", align_corners=False)
        return t.expand(-1, channels, side, side).numpy()

    return transform


def open_digits(spec: DatasetSpec, fit: ModelFit) -> Dataset:
    """The digits data set shaped for ``fit``: (C, S, S) float images with C in {1, 3} and S >= 8, 10 classes.
    Raises ConfigError (naming both shapes) for a model that takes anything else, DataError for a ``size`` or
    ``test_size`` above the split's."""
    channels = fit.input_shape[0] if len(fit.input_shape) == 3 else 0
    square = len(fit.input_shape) == 3 and fit.input_shape[1] == fit.input_shape[2]
    if fit.tokens or channels not in (1, 3) or not square or fit.input_shape[1] < DIGITS_SIDE or (
            fit.num_classes != DIGITS_CLASSES):
        raise mismatch_error("digits", f"8x8 grey images (resized to the model's side >= 8, 1 or 3 channels) with "
                             f"{DIGITS_CLASSES} classes", fit,
                             "use an image model with in_channels 1 or 3, image_size >= 8 and num_classes 10")
    images, y = digits_arrays()
    train_rows, test_rows = split_digits(y)
    # Statistics of the whole training split, so that a smaller ``size`` does not change what a pixel means.
    scaled = images[train_rows] / _MAX_PIXEL
    mean, std = float(scaled.mean()), float(scaled.std()) or 1.0
    train_rows = _first(train_rows, spec.size, "size")
    test_rows = _first(test_rows, spec.test_size, "test_size")
    x_train, y_train, x_test, y_test = images[train_rows], y[train_rows], images[test_rows], y[test_rows]
    log.info("opened scikit-learn's digits: %d training and %d test images resized to %s", len(x_train),
             len(x_test), "x".join(map(str, fit.input_shape)))
    return ArrayDataset(kind="digits", x={"train": x_train, "test": x_test}, y={"train": y_train, "test": y_test},
                        fit=fit, input_dtype=torch.float32, transform=_resizer(fit, mean, std))
