"""Counting the bytes autograd keeps for backward while a module runs forward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain

import torch
from torch import nn


class SavedBytes:
    """Distinct tensor storages saved for backward inside a ``saved_for_backward`` block, and their bytes."""

    def __init__(self, excluded: set[int]) -> None:
        self._excluded = excluded
        self._storages: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr not in self._excluded and nbytes:
            self._storages[ptr] = nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages saved so far."""
        return sum(self._storages.values())


@contextmanager
def saved_for_backward(module: nn.Module) -> Iterator[SavedBytes]:
    """Count what autograd saves for backward in the block: distinct storages, ``module``'s parameters and
    buffers excluded (they are weights, not activations)."""
    excluded = {p.untyped_storage().data_ptr() for p in chain(module.parameters(), module.buffers())}
    counter = SavedBytes(excluded)

    def pack(t: torch.Tensor) -> torch.Tensor:
        counter.add(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter
