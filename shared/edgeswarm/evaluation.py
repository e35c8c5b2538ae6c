"""A model's held-out accuracy and loss on a data set's test split: what every training kind reports."""

from __future__ import annotations

import numpy as np
import torch

from edgeswarm.data.base import Dataset
from edgeswarm.devices.compute import to_compute


def held_out(model: torch.nn.Module, dataset: Dataset, batch_size: int = 256) -> tuple[float, float]:
    """The share of the test split's targets (samples, or tokens for sequence targets) ``model`` predicts right in
    evaluation mode, and its mean cross-entropy per target. The model's own device is used; its mode is left in
    evaluation."""
    model.eval()
    compute = next((p.device for p in model.parameters()), None)  # None: a model without weights runs anywhere
    correct = total = 0
    loss = 0.0
    with torch.no_grad():
        for start in range(0, dataset.test_size, batch_size):
            x, y = dataset.batch(np.arange(start, min(start + batch_size, dataset.test_size)), "test")
            out = model(to_compute(x, compute))
            y = to_compute(y, compute)
            correct += int((out.argmax(dim=-1) == y).sum())
            loss += float(torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="sum"))
            total += y.numel()
    return correct / max(1, total), loss / max(1, total)
