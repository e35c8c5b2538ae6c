"""Data sets the user already has on disk: CIFAR-10 python batches and folders of .npz arrays, held in memory.

Nothing is downloaded. Pickles are read with an unpickler that rebuilds numpy arrays and nothing else.
"""

import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeswarm.data.base import Dataset, ModelFit, Split, mismatch_error
from edgeswarm.errors import DataError
from edgeswarm.values.specs import DatasetSpec

log = logging.getLogger(__name__)

# The per-channel mean and standard deviation of the CIFAR-10 training images (pixels scaled to [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR10_TEST_FILE = "test_batch"
_CIFAR10_SHAPE = (3, 32, 32)
_CIFAR10_CLASSES = 10


# --- data sets held in memory ("cifar10", "npz") --------------------------------------------------------------


class ArrayDataset(Dataset):
    """Samples held in memory as arrays: ``x[split]`` (n, *input_shape) and ``y[split]`` (n, *label_shape),
    with ``transform`` turning stored inputs (for example uint8 pixels) into model inputs."""

    def __init__(self, *, kind: str, x: dict[str, np.ndarray], y: dict[str, np.ndarray], fit: ModelFit,
                 input_dtype: torch.dtype, transform: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        super().__init__(kind=kind, train_size=len(x["train"]), test_size=len(x["test"]),
                         input_shape=fit.input_shape, input_dtype=input_dtype, num_classes=fit.num_classes,
                         label_shape=fit.label_shape)
        self._x = x
        self._y = y
        self._transform = transform

    def _inputs(self, ids: np.ndarray, split: Split) -> np.ndarray:
        rows = self._x[split][ids]
        return self._transform(rows) if self._transform is not None else rows

    def _labels(self, ids: np.ndarray, split: Split) -> np.ndarray:
        return self._y[split][ids]


def _take(arrays: tuple[np.ndarray, np.ndarray], count: int | None, what: str, kind: str) -> tuple[np.ndarray, ...]:
    x, y = arrays
    if count is None:
        return x, y
    if count > len(x):
        raise DataError(f"{what} asks for {count} samples but the {kind!r} files hold only {len(x)}; "
                        "lower it or leave it unset to use them all")
    return x[:count], y[:count]


# CIFAR-10's python batches are pickles. Pickle can run any code it names, so only the globals that rebuild a
# numpy array (and Python 3's protocol-2 spelling of bytes) may be named; anything else is refused unread.
def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    if encoding not in ("latin1", "latin-1"):
        raise DataError(f"a pickle asked to encode text as {encoding!r}; only latin1 rebuilds bytes")
    return text.encode("latin1")


_ARRAY_RECONSTRUCT = np.zeros(1).__reduce__()[0]
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _ARRAY_RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _ARRAY_RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise DataError(f"refusing to unpickle {module}.{name}: a CIFAR-10 batch holds only dicts, lists, "
                            "bytes and numpy arrays, so this file is not one (or was tampered with)") from None


def _load_restricted_pickle(path: Path) -> Any:
    """Unpickle a file with only numpy-array globals allowed. Raises DataError for anything else."""
    try:
        with path.open("rb") as f:
            return _ArrayUnpickler(f, encoding="bytes").load()
    except DataError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, MemoryError) as exc:
        raise DataError(f"{path} is not a readable CIFAR-10 python batch: {exc}") from exc


def _cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    doc = _load_restricted_pickle(path)
    if not isinstance(doc, dict):
        raise DataError(f"{path} should hold a dict with keys data and labels, not a {type(doc).__name__}")
    data = doc.get(b"data", doc.get("data"))
    labels = doc.get(b"labels", doc.get("labels"))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = f"shape {data.shape} and dtype {data.dtype}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: 'data' should be a uint8 array of shape (N, 3072), not {got}")
    y = np.asarray(labels if labels is not None else [], dtype=np.int64).reshape(-1)
    if len(y) != len(data) or (len(y) and (y.min() < 0 or y.max() >= _CIFAR10_CLASSES)):
        raise DataError(f"{path}: 'labels' should hold {len(data)} class indices in 0..9")
    # The official row layout is 1024 red, then 1024 green, then 1024 blue values, each row-major: already CHW.
    return data.reshape(-1, *_CIFAR10_SHAPE), y


def _cifar10_dir(path: Path) -> Path:
    nested = path / "cifar-10-batches-py"
    # Accept the folder the official archive extracts into, or its parent.
    if not (path / _CIFAR10_TEST_FILE).exists() and nested.is_dir():
        return nested
    return path


def _normalise_cifar(pixels: np.ndarray) -> np.ndarray:
    mean = np.asarray(CIFAR10_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(CIFAR10_STD, dtype=np.float32).reshape(1, 3, 1, 1)
    return (pixels.astype(np.float32) / np.float32(255.0) - mean) / std


def open_cifar10(spec: DatasetSpec, fit: ModelFit) -> Dataset:
    assert spec.path is not None
    expected = (f"the CIFAR-10 python batches {', '.join(_CIFAR10_TRAIN_FILES)} and {_CIFAR10_TEST_FILE} "
                "(cifar-10-python.tar.gz extracted); nothing is downloaded")
    if fit.tokens or fit.input_shape != _CIFAR10_SHAPE or fit.num_classes != _CIFAR10_CLASSES:
        raise mismatch_error("cifar10", f"3x32x32 float images with {_CIFAR10_CLASSES} classes", fit,
                        "use an image model with in_channels 3, image_size 32 and num_classes 10")
    root = Path(spec.path).expanduser()
    if not root.is_dir():
        raise DataError(f"CIFAR-10 directory {root} does not exist; it should hold {expected}")
    root = _cifar10_dir(root)
    missing = [name for name in (*_CIFAR10_TRAIN_FILES, _CIFAR10_TEST_FILE) if not (root / name).is_file()]
    if missing:
        raise DataError(f"CIFAR-10 directory {root} lacks {', '.join(missing)}; it should hold {expected}")
    parts = [_cifar10_batch(root / name) for name in _CIFAR10_TRAIN_FILES]
    train = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    test = _cifar10_batch(root / _CIFAR10_TEST_FILE)
    x_train, y_train = _take(train, spec.size, "size", "cifar10")
    x_test, y_test = _take(test, spec.test_size, "test_size", "cifar10")
    log.info("read CIFAR-10 from %s: %d training and %d test images", root, len(x_train), len(x_test))
    return ArrayDataset(kind="cifar10", x={"train": x_train, "test": x_test}, y={"train": y_train, "test": y_test},
                        fit=fit, input_dtype=torch.float32, transform=_normalise_cifar)


def _load_npz(path: Path, fit: ModelFit) -> tuple[np.ndarray, np.ndarray]:
    try:
        # allow_pickle=False: an object array in the file would otherwise unpickle arbitrary code.
        with np.load(path, allow_pickle=False) as doc:
            if "x" not in doc or "y" not in doc:
                raise DataError(f"{path} should hold arrays named x and y, not {', '.join(doc.files) or 'nothing'}")
            x, y = doc["x"], doc["y"]
    except DataError:
        raise
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not a readable .npz file of numeric arrays x and y: {exc}") from exc
    _check_npz_arrays(path, x, y, fit)
    if fit.tokens:
        return x.astype(np.int64), y.astype(np.int64)
    return x.astype(np.float32), y.astype(np.int64)


def _check_npz_arrays(path: Path, x: np.ndarray, y: np.ndarray, fit: ModelFit) -> None:
    want_x = "int" if fit.tokens else "float"
    if x.ndim != 1 + len(fit.input_shape) or tuple(x.shape[1:]) != fit.input_shape or (
            x.dtype.kind not in ("iu" if fit.tokens else "f")):
        raise mismatch_error("npz", f"x of shape {x.shape} and dtype {x.dtype} in {path}", fit,
                        f"x must be a {want_x} array of shape (N, {', '.join(map(str, fit.input_shape))})")
    if y.dtype.kind not in "iu" or tuple(y.shape) != (len(x), *fit.label_shape):
        raise mismatch_error("npz", f"y of shape {y.shape} and dtype {y.dtype} in {path}", fit,
                        f"y must be an integer array of shape ({len(x)}{''.join(f', {d}' for d in fit.label_shape)})")
    if len(y) and (y.min() < 0 or y.max() >= fit.num_classes):
        raise mismatch_error("npz", f"labels from {y.min()} to {y.max()} in {path}", fit,
                        f"labels must lie in 0..{fit.num_classes - 1}")
    if fit.tokens and len(x) and (x.min() < 0 or x.max() >= fit.vocab_size):
        raise mismatch_error("npz", f"token ids from {x.min()} to {x.max()} in {path}", fit,
                        f"token ids must lie in 0..{fit.vocab_size - 1}")
    if not fit.tokens and not np.isfinite(x).all():
        raise DataError(f"{path}: x holds NaN or infinite values")


def open_npz(spec: DatasetSpec, fit: ModelFit) -> Dataset:
    assert spec.path is not None
    root = Path(spec.path).expanduser()
    files = {split: root / f"{split}.npz" for split in ("train", "test")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise DataError(f"npz data set lacks {', '.join(missing)}: the directory must hold train.npz and test.npz, "
                        "each with arrays x (inputs) and y (labels); nothing is downloaded")
    train = _take(_load_npz(files["train"], fit), spec.size, "size", "npz")
    test = _take(_load_npz(files["test"], fit), spec.test_size, "test_size", "npz")
    log.info("read npz data from %s: %d training and %d test samples", root, len(train[0]), len(test[0]))
    return ArrayDataset(kind="npz", x={"train": train[0], "test": test[0]}, y={"train": train[1], "test": test[1]},
                        fit=fit, input_dtype=torch.int64 if fit.tokens else torch.float32)

