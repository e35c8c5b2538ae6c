"""A part of one weight: the rows or columns of it a tensor-parallel rank holds, and what a loader reads for it."""

from __future__ import annotations

from typing import TypeVar

import torch
from pydantic import BaseModel, ConfigDict

from edgeswarm.models.text.quantized import QuantizedMatrix

M = TypeVar("M", torch.Tensor, QuantizedMatrix)


class WeightSlice(BaseModel):
    """Weight ``name`` restricted to rows [``rows[0]``, ``rows[1]``) and columns [``columns[0]``, ``columns[1]``)
    (None: all of them). A model folder reads only that part (``models.text.hf.ModelFolder.read_slice``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    rows: tuple[int, int] | None = None
    columns: tuple[int, int] | None = None

    def cut(self, full: M) -> M:
        """This slice of ``full`` (a view when nothing is cut or only rows are; a quantized matrix's columns must lie
        on its blocks)."""
        if isinstance(full, QuantizedMatrix):
            q = full.rows(*self.rows) if self.rows is not None else full
            return q.column_range(*self.columns) if self.columns is not None else q
        t = full
        if self.rows is not None:
            t = t[self.rows[0]:self.rows[1]]
        if self.columns is not None:
            t = t[:, self.columns[0]:self.columns[1]]
        return t

    def shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        dims = list(full_shape)
        if self.rows is not None:
            dims[0] = self.rows[1] - self.rows[0]
        if self.columns is not None:
            dims[1] = self.columns[1] - self.columns[0]
        return tuple(dims)
