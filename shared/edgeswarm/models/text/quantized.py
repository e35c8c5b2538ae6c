"""A weight matrix held in ggml's quantized blocks (GGUF's Q8_0 and Q4_0), multiplied without ever holding it
dequantized whole.

Each row of a [rows, columns] matrix is ``columns / BLOCK`` blocks of ``BLOCK`` consecutive weights; a block is its
scale (float16) and its quants: Q8_0, 32 signed bytes (weight = scale * q); Q4_0, 16 bytes of two 4-bit quants each,
the low nibbles the block's first 16 weights and the high ones its last 16 (weight = scale * (q - 8)). So a row range
is a range of block rows, and a column range on block boundaries a range of each row's bytes: a tensor-parallel
rank holds exactly its part, still quantized. ``linear`` dequantizes ``CHUNK_ELEMENTS`` weights at a time (a few
rows) and multiplies them, so what the matrix costs in memory is its quantized bytes and one chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgeswarm.values.text_model import BLOCK, BLOCK_BYTES, QuantType

CHUNK_ELEMENTS = 1 << 20  # weights dequantized at once in ``linear`` (4 MiB in float32)


class QuantizationError(ValueError):
    """A quantized matrix cannot be cut or built as asked (a column range off the block boundaries, a wrong size)."""


def dequantize(raw: torch.Tensor, kind: QuantType, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights of ``raw`` (uint8 [rows, blocks * BLOCK_BYTES[kind]]) as [rows, blocks * BLOCK] in ``dtype``,
    computed in float32 (as ggml dequantizes)."""
    rows, count = raw.shape[0], raw.shape[1] // BLOCK_BYTES[kind]
    blocks = raw.reshape(rows, count, BLOCK_BYTES[kind])  # explicit sizes: a rank's share may be empty
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [rows, n, 1]
    quants = blocks[..., 2:]
    if kind == "q8_0":
        values = quants.contiguous().view(torch.int8).float()
    else:
        low = (quants & 0x0F).to(torch.int8) - 8
        high = (quants >> 4).to(torch.int8) - 8
        values = torch.cat([low, high], dim=-1).float()
    return (values * scale).reshape(rows, count * BLOCK).to(dtype)


class QuantizedMatrix:
    """A [rows, columns] matrix of ``kind`` blocks (``raw``: uint8 [rows, columns / BLOCK * BLOCK_BYTES[kind]]),
    computing in ``dtype`` (the model's activations'). Raises QuantizationError when ``raw`` is not that size."""

    def __init__(self, raw: torch.Tensor, kind: QuantType, columns: int, dtype: torch.dtype = torch.float32) -> None:
        if columns % BLOCK:
            raise QuantizationError(f"a {kind} matrix has whole blocks of {BLOCK} columns, not {columns} columns")
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != columns // BLOCK * BLOCK_BYTES[kind]:
            raise QuantizationError(f"{kind} data of {columns} columns is uint8 [rows, "
                                    f"{columns // BLOCK * BLOCK_BYTES[kind]}], not {raw.dtype} {list(raw.shape)}")
        self.raw, self.kind, self.columns, self.dtype = raw, kind, columns, dtype

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.raw.shape[0]), self.columns

    @property
    def nbytes(self) -> int:
        """Bytes held (the quantized blocks)."""
        return self.raw.numel()

    def _like(self, raw: torch.Tensor, columns: int | None = None) -> QuantizedMatrix:
        return QuantizedMatrix(raw, self.kind, self.columns if columns is None else columns, self.dtype)

    def rows(self, start: int, stop: int) -> QuantizedMatrix:
        """Rows [``start``, ``stop``) (a view)."""
        return self._like(self.raw[start:stop])

    def column_range(self, start: int, stop: int) -> QuantizedMatrix:
        """Columns [``start``, ``stop``), both on block boundaries (a copy). Raises QuantizationError otherwise."""
        if start % BLOCK or stop % BLOCK or not 0 <= start <= stop <= self.columns:
            raise QuantizationError(f"columns [{start}, {stop}) of a {self.kind} matrix of {self.columns} columns "
                                    f"must lie on its blocks of {BLOCK}")
        width = BLOCK_BYTES[self.kind]
        return self._like(self.raw[:, start // BLOCK * width:stop // BLOCK * width].contiguous(), stop - start)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           copy: bool = False) -> QuantizedMatrix:
        """On ``device``, computing in ``dtype`` (the blocks themselves stay as they are)."""
        raw = self.raw.to(device) if device is not None else self.raw
        return QuantizedMatrix(raw.clone() if copy and raw is self.raw else raw, self.kind, self.columns,
                               dtype or self.dtype)

    def contiguous(self) -> QuantizedMatrix:
        return self if self.raw.is_contiguous() else self._like(self.raw.contiguous())

    def clone(self) -> QuantizedMatrix:
        return self._like(self.raw.clone())

    def dequantize(self) -> torch.Tensor:
        """The whole matrix in ``dtype`` (for references and tests; ``linear`` never builds it)."""
        return dequantize(self.raw, self.kind, self.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ self^T + bias`` for ``x`` [..., columns], dequantizing a chunk of rows at a time."""
        step = max(1, CHUNK_ELEMENTS // max(1, self.columns))
        rows = self.shape[0]
        if rows <= step:
            return F.linear(x, dequantize(self.raw, self.kind, x.dtype), bias)
        parts = [F.linear(x, dequantize(self.raw[r:r + step], self.kind, x.dtype)) for r in range(0, rows, step)]
        out = torch.cat(parts, dim=-1)
        return out if bias is None else out + bias

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` [s] names, dequantized: [s, columns]."""
        return dequantize(self.raw[ids], self.kind, self.dtype)

    @staticmethod
    def cat(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
        """The rows of ``parts`` one after another (all of one kind and width)."""
        first = parts[0]
        if any(p.kind != first.kind or p.columns != first.columns for p in parts):
            raise QuantizationError("only matrices of one quantization and width stack")
        return first._like(torch.cat([p.raw for p in parts]))

    def __repr__(self) -> str:
        return f"QuantizedMatrix({self.kind}, {list(self.shape)}, {self.nbytes} bytes)"
