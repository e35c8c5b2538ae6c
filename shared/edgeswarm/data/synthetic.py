"""The synthetic data sets: a teacher-labelled image task and token tasks, every sample generated from its id.

See edgeswarm.data.base for the kinds and the guarantees every data set gives.
"""

import math

import numpy as np
import torch

from edgeswarm.data.base import (
    DEFAULT_SYNTHETIC_SIZE,
    DEFAULT_SYNTHETIC_TEST_SIZE,
    TAG_SAMPLE,
    Dataset,
    ModelFit,
    Split,
    mismatch_error,
    sample_rng,
    with_label_noise,
)
from edgeswarm.errors import DataError
from edgeswarm.values.specs import DatasetSpec

_TAG_TEACHER = 0x54454143
_TAG_CALIBRATION = 0x43414C49

_TEACHER_HIDDEN = 64
# The share of each teacher image pixel's variance that comes from its block's coarse value (the rest is
# independent pixel noise). Labels depend on the coarse values only; a strong share makes them stand out of the
# pixel noise, so that a few thousand samples teach a student instead of letting it memorise noise.
_BLOCK_SHARE = 0.5
_CALIBRATION_SAMPLES = 8192
_RESTART_PROBABILITY = 1 / 8


# --- "teacher" -----------------------------------------------------------------------------------------------


def _teacher_grid(image_size: int) -> int:
    # Quadrants rather than a finer grid: CNNs that end in global pooling see position only coarsely, and learn a
    # quadrant teacher within a few hundred steps where a 4x4 one takes many epochs. Blocks must tile the image so
    # that every block mean is exactly normal, which lets the teacher be calibrated on sampled features.
    return 2 if image_size % 2 == 0 else 1


class TeacherDataset(Dataset):
    """Images of N(0, 1) float32 pixels labelled by a fixed random teacher.

    Each channel is cut into a grid of g x g blocks (quadrants, g = 2, or the whole channel, g = 1, for an odd
    image side). A pixel is
    sqrt(1/2) times its block's coarse N(0, 1) value plus sqrt(1/2) times its own N(0, 1) noise, so every pixel is
    N(0, 1) and the image carries a coarse pattern. The teacher averages each block, scales each average to unit
    variance, and applies a random tanh MLP (hidden width 64) whose logits are
    standardised and shifted by per-class biases fitted on 8192 sampled features so that every class gets about
    the same share of samples (within a few percent for ten classes; for a hundred, within about a third, the
    sampling error of 82 calibration samples per class). Teacher weights, calibration and samples all derive from
    ``seed``.
    """

    def __init__(self, spec: DatasetSpec, fit: ModelFit) -> None:
        super().__init__(kind="teacher", train_size=spec.size or DEFAULT_SYNTHETIC_SIZE,
                         test_size=DEFAULT_SYNTHETIC_TEST_SIZE if spec.test_size is None else spec.test_size,
                         input_shape=fit.input_shape, input_dtype=torch.float32, num_classes=fit.num_classes,
                         label_shape=())
        self._seed = spec.seed
        self._noise = spec.noise
        channels, side, _ = fit.input_shape
        self._grid = _teacher_grid(side) if spec.teacher_grid is None else spec.teacher_grid
        if side % self._grid:
            raise DataError(f"teacher_grid {self._grid} does not tile images of side {side}; use 1")
        features = channels * self._grid ** 2
        rng = np.random.default_rng([_TAG_TEACHER, spec.seed])
        self._w1 = rng.standard_normal((features, _TEACHER_HIDDEN)) / math.sqrt(features)
        self._w2 = rng.standard_normal((_TEACHER_HIDDEN, fit.num_classes)) / math.sqrt(_TEACHER_HIDDEN)
        calibration = np.random.default_rng([_TAG_CALIBRATION, spec.seed]).standard_normal(
            (_CALIBRATION_SAMPLES, features))
        raw = self._raw_logits(calibration)
        self._centre = raw.mean(axis=0)
        self._scale = raw.std(axis=0) + 1e-12
        self._bias = _balancing_bias((raw - self._centre) / self._scale)

    def _raw_logits(self, features: np.ndarray) -> np.ndarray:
        return np.tanh(features @ self._w1) @ self._w2

    def _features(self, images: np.ndarray) -> np.ndarray:
        n, channels, side, _ = images.shape
        block = side // self._grid
        blocks = images.astype(np.float64).reshape(n, channels, self._grid, block, self._grid, block)
        # A block's mean is its coarse value plus the mean of block*block independent pixel terms: a normal
        # variable with this variance, scaled here to exactly N(0, 1).
        variance = _BLOCK_SHARE + (1.0 - _BLOCK_SHARE) / block ** 2
        return blocks.mean(axis=(3, 5)).reshape(n, -1) / math.sqrt(variance)

    def _inputs(self, ids: np.ndarray, split: Split) -> np.ndarray:
        channels, side, _ = self.input_shape
        grid, block = self._grid, side // self._grid
        coarse_weight = np.float32(math.sqrt(_BLOCK_SHARE))
        pixel_weight = np.float32(math.sqrt(1.0 - _BLOCK_SHARE))
        out = np.empty((len(ids), *self.input_shape), dtype=np.float32)
        for row, sample_id in enumerate(ids.tolist()):
            rng = sample_rng(TAG_SAMPLE, self._seed, split, sample_id)
            coarse = rng.standard_normal((channels, grid, 1, grid, 1), dtype=np.float32)
            pixels = rng.standard_normal((channels, grid, block, grid, block), dtype=np.float32)
            out[row] = (coarse_weight * coarse + pixel_weight * pixels).reshape(self.input_shape)
        return out

    def _labels_of(self, images: np.ndarray, ids: np.ndarray, split: Split) -> np.ndarray:
        logits = (self._raw_logits(self._features(images)) - self._centre) / self._scale + self._bias
        labels = logits.argmax(axis=1).astype(np.int64)
        return with_label_noise(labels, ids, split, self._seed, self._noise, self.num_classes)

    def _labels(self, ids: np.ndarray, split: Split) -> np.ndarray:
        return self._labels_of(self._inputs(ids, split), ids, split)

    def _batch(self, ids: np.ndarray, split: Split) -> tuple[np.ndarray, np.ndarray]:
        images = self._inputs(ids, split)
        return images, self._labels_of(images, ids, split)


def _balancing_bias(logits: np.ndarray, tolerance: float = 0.01) -> np.ndarray:
    """Per-class biases that make argmax(logits + bias) pick every class about equally often on these rows.

    This is the dual of assigning the rows to classes in equal shares (semi-discrete optimal transport). Nudging
    biases by hard argmax shares oscillates when the logits span few dimensions (a grey image gives the teacher
    four features), so each class's bias is rescaled by its softmax share at a falling temperature: Sinkhorn's
    iteration, which converges at every temperature and ends close to the hard assignment.
    """
    classes = logits.shape[1]
    bias = np.zeros(classes)
    for temperature in (1.0, 0.3, 0.1, 0.03):
        for _ in range(100):
            scaled = (logits + bias) / temperature
            scaled -= scaled.max(axis=1, keepdims=True)
            weights = np.exp(scaled)
            share = (weights / weights.sum(axis=1, keepdims=True)).mean(axis=0) * classes
            if np.abs(share - 1.0).max() < tolerance:
                break
            bias -= temperature * np.log(np.maximum(share, 1e-12))
    return bias


# --- "tokens" ------------------------------------------------------------------------------------------------


class TokenDataset(Dataset):
    """Token ids uniform in [0, vocab_size) of the model's sequence length, with a learnable target.

    Classifiers: each token has a fixed random integer weight in [-1000, 1000]; a sequence's label is the
    quantile bucket (of num_classes equal shares, cut on 8192 sampled sequences) of its summed weights. Integer
    weights make the label exact on every machine. Next-token models: each sequence of seq_len + 1 tokens starts
    at a random token and follows t[i+1] = (a * t[i] + b) mod vocab_size, restarting at a random token with
    probability 1/8 per position, with a coprime to vocab_size; inputs are the first seq_len tokens and labels the
    last seq_len.
    """

    def __init__(self, spec: DatasetSpec, fit: ModelFit) -> None:
        super().__init__(kind="tokens", train_size=spec.size or DEFAULT_SYNTHETIC_SIZE,
                         test_size=DEFAULT_SYNTHETIC_TEST_SIZE if spec.test_size is None else spec.test_size,
                         input_shape=fit.input_shape, input_dtype=torch.int64, num_classes=fit.num_classes,
                         label_shape=fit.label_shape)
        self._seed = spec.seed
        self._noise = spec.noise
        self._vocab = fit.vocab_size
        self._seq_len = fit.input_shape[0]
        self._next_token = fit.next_token
        rng = np.random.default_rng([_TAG_TEACHER, spec.seed])
        if self._next_token:
            self._a, self._b = _affine_rule(rng, self._vocab)
        else:
            self._weights = rng.integers(-1000, 1001, self._vocab, dtype=np.int64)
            calibration = np.random.default_rng([_TAG_CALIBRATION, spec.seed]).integers(
                0, self._vocab, (_CALIBRATION_SAMPLES, self._seq_len), dtype=np.int64)
            scores = self._weights[calibration].sum(axis=1)
            self._cuts = np.quantile(scores, np.arange(1, fit.num_classes) / fit.num_classes)

    def _sequences(self, ids: np.ndarray, split: Split) -> np.ndarray:
        length = self._seq_len + 1 if self._next_token else self._seq_len
        draws = np.empty((len(ids), length), dtype=np.int64)
        restarts = np.empty((len(ids), length), dtype=bool)
        for row, sample_id in enumerate(ids.tolist()):
            rng = sample_rng(TAG_SAMPLE, self._seed, split, sample_id)
            draws[row] = rng.integers(0, self._vocab, length, dtype=np.int64)
            if self._next_token:
                restarts[row] = rng.random(length) < _RESTART_PROBABILITY
        if not self._next_token:
            return draws
        seq = draws
        # Position by position across the whole batch: seq_len vector steps instead of a Python loop per token.
        for pos in range(1, length):
            follow = (self._a * seq[:, pos - 1] + self._b) % self._vocab
            seq[:, pos] = np.where(restarts[:, pos], draws[:, pos], follow)
        return seq

    def _inputs(self, ids: np.ndarray, split: Split) -> np.ndarray:
        seq = self._sequences(ids, split)
        return seq[:, : self._seq_len]

    def _labels_of(self, seq: np.ndarray, ids: np.ndarray, split: Split) -> np.ndarray:
        if self._next_token:
            labels = seq[:, 1:]
        else:
            labels = np.searchsorted(self._cuts, self._weights[seq].sum(axis=1), side="right").astype(np.int64)
        return with_label_noise(labels, ids, split, self._seed, self._noise, self.num_classes)

    def _labels(self, ids: np.ndarray, split: Split) -> np.ndarray:
        return self._labels_of(self._sequences(ids, split), ids, split)

    def _batch(self, ids: np.ndarray, split: Split) -> tuple[np.ndarray, np.ndarray]:
        seq = self._sequences(ids, split)
        return seq[:, : self._seq_len], self._labels_of(seq, ids, split)


def _affine_rule(rng: np.random.Generator, vocab: int) -> tuple[int, int]:
    """(a, b) with a coprime to ``vocab``, so that t -> (a*t + b) mod vocab is a permutation of the tokens."""
    if vocab < 3:
        return 1, int(rng.integers(0, vocab))
    while True:
        a = int(rng.integers(2, vocab))
        if math.gcd(a, vocab) == 1:
            return a, int(rng.integers(0, vocab))



def open_teacher(spec: DatasetSpec, fit: ModelFit) -> Dataset:
    """The ``teacher`` task for an image model. Raises ConfigError for a token model."""
    if fit.tokens:
        raise mismatch_error("teacher", "float images", fit, "use kind 'tokens' for token models")
    return TeacherDataset(spec, fit)


def open_tokens(spec: DatasetSpec, fit: ModelFit) -> Dataset:
    """The ``tokens`` task for a token model. Raises ConfigError for an image model."""
    if not fit.tokens:
        raise mismatch_error("tokens", "sequences of int64 token ids", fit,
                             "use kind 'teacher', 'cifar10' or 'npz' for image models")
    return TokenDataset(spec, fit)
