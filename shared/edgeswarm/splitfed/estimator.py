"""The MEC's Distribution Estimator: Algorithm 1's ``Obtain_dis`` (spec §5.2), a device's label distribution
inferred from its model update, never from its labels.

``grad_nnls`` (the default): with ``W_g`` the round-start global model's output-layer weight and ``W_i`` device i's
after its probing epoch, ``ΔW_i = W_i - W_g``. Plain SGD on local data whose class shares are P moves the weight by
about ``-η·steps·Σ_c P_c·g_c``, where ``g_c`` is the mean gradient of the loss w.r.t. the output weight at ``W_g`` over
samples of class c. So ``q* = argmin_{q >= 0} ‖ΔW_i + Σ_c q_c g_c‖²`` (non-negative least squares) is proportional to
P, and ``P̂_i = q* / Σ q*`` (uniform when Σ q* = 0: the update says nothing). The ``g_c`` come from a small
class-balanced public auxiliary set (10 samples per class by default) and depend only on the global model, so they
are computed once per round and serve every device.

``oracle`` is the true label histogram normalised: for simulations, tests and upper bounds only.

The estimator takes the output layer's weights as tensors: the caller extracts them from wherever the split put
that layer (the device's tail under the U-split), so nothing here depends on how the model is cut.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from edgeswarm.data.base import Dataset, Split
from edgeswarm.devices.compute import to_compute
from edgeswarm.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

EstimatorMode = Literal["grad_nnls", "oracle"]
DEFAULT_AUX_PER_CLASS = 10
_TAG_AUX = 0x41555800
# NNLS holds a (numel, C) float64 matrix: this bounds its size (a 768x50k language-model head would need ~GBs).
MAX_NNLS_ENTRIES = 50_000_000
SUM_TOLERANCE = 1e-6


class LabelDistribution(BaseModel):
    """A device's (estimated) label distribution, as the MEC forwards it: ``probabilities[c]`` is the share of
    class c (non-negative, finite, summing to 1 within SUM_TOLERANCE); ``mode`` says how it was obtained;
    ``residual`` is the NNLS residual norm ‖ΔW + Σ q_c g_c‖ (grad_nnls only), ``scale`` is Σ q* (the update's
    size in units of class gradients: 0 means the update said nothing and the result is uniform)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    probabilities: tuple[float, ...] = Field(min_length=1, max_length=100_000)
    mode: EstimatorMode
    residual: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    scale: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    @field_validator("probabilities")
    @classmethod
    def _a_distribution(cls, p: tuple[float, ...]) -> tuple[float, ...]:
        if any(not math.isfinite(x) or x < 0 for x in p):
            raise ValueError("probabilities must be finite and non-negative")
        if abs(math.fsum(p) - 1.0) > SUM_TOLERANCE:
            raise ValueError(f"probabilities must sum to 1, not {math.fsum(p)}")
        return p


@dataclass(frozen=True)
class AuxiliarySet:
    """The class-balanced auxiliary samples: ``inputs`` (n, *input_shape) and int64 ``labels`` (n,) of
    ``num_classes`` classes, ``per_class`` of each (fewer for a class the source holds fewer of)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    per_class: int


def auxiliary_ids(labels: np.ndarray, num_classes: int, per_class: int = DEFAULT_AUX_PER_CLASS,
                  seed: int = 0) -> np.ndarray:
    """Sample ids for a class-balanced auxiliary set from a split whose labels are ``labels``: ``per_class`` of
    each class chosen by a generator seeded with ``seed`` (all of a class that has fewer), ascending. Raises
    ConfigError for ``per_class`` < 1 or labels that are not flat class indices below ``num_classes``."""
    y = np.asarray(labels)
    if y.ndim != 1 or (y.size and (y.dtype.kind not in "iu" or y.min() < 0 or y.max() >= num_classes)):
        raise ConfigError(f"auxiliary labels must be flat class indices below {num_classes}")
    if isinstance(per_class, bool) or per_class < 1:
        raise ConfigError(f"per_class must be >= 1, not {per_class!r}")
    rng = np.random.default_rng([_TAG_AUX, seed])
    chosen = []
    for c in range(num_classes):
        rows = np.flatnonzero(y == c)
        chosen.append(rows if len(rows) <= per_class else rng.choice(rows, per_class, replace=False))
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def auxiliary_set(dataset: Dataset, *, per_class: int = DEFAULT_AUX_PER_CLASS, split: Split = "test",
                  seed: int = 0) -> AuxiliarySet:
    """A class-balanced auxiliary set drawn from ``dataset``'s ``split`` (default the held-out split, standing for
    the server's public data: it never trains a model, so evaluation on it stays fair). Reads every label of
    the split and the inputs of the chosen samples only. Raises ConfigError for next-token data sets or a class
    absent from the split."""
    if dataset.label_shape != ():
        raise ConfigError(f"data set {dataset.kind!r} has per-token labels: the class-wise estimator needs one class "
                          "per sample")
    labels = dataset.labels(np.arange(dataset.size(split), dtype=np.int64), split).numpy()
    ids = auxiliary_ids(labels, dataset.num_classes, per_class, seed)
    counts = np.bincount(labels[ids], minlength=dataset.num_classes)
    if counts.min() == 0:
        raise ConfigError(f"the {split} split of {dataset.kind!r} lacks class(es) "
                          f"{np.flatnonzero(counts == 0).tolist()}: the auxiliary set needs every class")
    x, y = dataset.batch(ids, split)
    return AuxiliarySet(inputs=x, labels=y, num_classes=dataset.num_classes, per_class=per_class)


def class_gradients(model: nn.Module, output_weight: str, aux: AuxiliarySet, *,
                    compute: torch.device | None = None) -> torch.Tensor:
    """``g_c`` for every class: the mean gradient of the cross-entropy loss w.r.t. the parameter named
    ``output_weight`` of ``model`` (the global model at the round start, whole) over the auxiliary samples of
    class c. Returns a float32 tensor of shape (num_classes, numel of that parameter) on ``compute`` (default:
    where the parameter is). The model's parameters are left unchanged and its gradients untouched; it runs in
    eval mode (BatchNorm and dropout as at inference) and is put back in the mode it was in. Raises ConfigError
    for an unknown parameter name."""
    import torch

    params = dict(model.named_parameters())
    if output_weight not in params:
        raise ConfigError(f"model has no parameter {output_weight!r}; its last ones are {list(params)[-4:]}")
    weight = params[output_weight]
    on = compute if compute is not None else weight.device
    was_training = model.training
    model.eval()
    rows = []
    try:
        for c in range(aux.num_classes):
            mask = aux.labels == c
            if not bool(mask.any()):
                raise ConfigError(f"the auxiliary set has no sample of class {c}")
            x = to_compute(aux.inputs[mask], weight.device)
            y = to_compute(aux.labels[mask], weight.device)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            (grad,) = torch.autograd.grad(loss, [weight])
            rows.append(to_compute(grad.detach().reshape(-1).float(), on))
    finally:
        model.train(was_training)
    return torch.stack(rows)


def obtain_dis(local_weight: torch.Tensor, global_weight: torch.Tensor,
               class_grads: torch.Tensor) -> LabelDistribution:
    """Device i's estimated label distribution (``grad_nnls``) from its output-layer weight after local training
    (``local_weight`` = W_i^out) and the round-start global one (``global_weight`` = W_g^out), with ``class_grads``
    from ``class_gradients`` at W_g (shape (C, numel)).

    Solves ``min_{q >= 0} ‖ΔW + Σ_c q_c g_c‖²`` with ``scipy.optimize.nnls`` in float64 on the host and returns
    q/Σq (uniform when Σq = 0). Raises ConfigError for mismatched shapes, non-finite inputs, or a problem larger
    than MAX_NNLS_ENTRIES."""
    from scipy.optimize import nnls

    if local_weight.shape != global_weight.shape:
        raise ConfigError(f"local output weight {tuple(local_weight.shape)} and global "
                          f"{tuple(global_weight.shape)} differ: pass the same layer of both models")
    numel = local_weight.numel()
    if class_grads.ndim != 2 or class_grads.shape[1] != numel or class_grads.shape[0] < 1:
        raise ConfigError(f"class gradients of shape {tuple(class_grads.shape)} do not fit an output weight of "
                          f"{numel} values: expected (num_classes, {numel})")
    if class_grads.numel() > MAX_NNLS_ENTRIES:
        raise ConfigError(f"NNLS over {class_grads.shape[0]} classes x {numel} weights exceeds {MAX_NNLS_ENTRIES} "
                          "entries: bucket the classes (spec §5.2) or use the oracle mode")
    # To the host first: NNLS runs there, and MPS has no float64.
    delta = (local_weight.detach().cpu().double() - global_weight.detach().cpu().double()).reshape(-1).numpy()
    grads = class_grads.detach().cpu().double().numpy()
    if not (np.isfinite(delta).all() and np.isfinite(grads).all()):
        raise ConfigError("the output weights or class gradients hold NaN or infinite values")
    q, residual = nnls(grads.T, -delta)
    total = float(q.sum())
    classes = grads.shape[0]
    p = q / total if total > 0 else np.full(classes, 1.0 / classes)
    return LabelDistribution(probabilities=_renormalised(p), mode="grad_nnls", residual=float(residual),
                             scale=total)


def oracle_distribution(histogram: Sequence[int] | np.ndarray) -> LabelDistribution:
    """The ``oracle`` mode: the true label histogram (counts per class, e.g. ``Partition.histogram(i)``)
    normalised. Raises ConfigError for negative counts or an empty histogram."""
    h = np.asarray(histogram, dtype=np.float64).reshape(-1)
    if h.size == 0 or not np.isfinite(h).all() or (h < 0).any() or h.sum() <= 0:
        raise ConfigError(f"a label histogram needs non-negative counts with a positive total, not {h.tolist()[:10]}")
    return LabelDistribution(probabilities=_renormalised(h / h.sum()), mode="oracle")


def _renormalised(p: np.ndarray) -> tuple[float, ...]:
    p = np.clip(p.astype(np.float64), 0.0, None)
    return tuple(float(x) for x in p / p.sum())
