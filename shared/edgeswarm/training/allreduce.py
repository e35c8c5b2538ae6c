"""Ring AllReduce (SUM) over any transport: the gradient sum inside a data-parallel group (spec 6.2).

The flat vector is cut into ``size`` chunks. In ``size - 1`` reduce-scatter steps every rank sends one chunk
to its right neighbour and adds the chunk arriving from its left, so each rank ends up owning one fully
summed chunk; in ``size - 1`` all-gather steps the summed chunks travel once more around the ring. Each rank
sends 2 (size - 1) / size of the vector in total, the volume Eq. 5b prices.

The transport is two callables: ``send(to_rank, step, chunk)`` and ``recv(from_rank, step) -> chunk``
(blocking, with its own timeout). Steps are numbered 0 .. 2(size-1)-1 so a transport can keep messages of
different steps apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Send = Callable[[int, int, torch.Tensor], None]
Recv = Callable[[int, int], torch.Tensor]


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) ranges covering ``length`` elements, sizes differing by at most 1."""
    base, extra = divmod(length, parts)
    bounds = []
    start = 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_allreduce(flat: torch.Tensor, rank: int, size: int, send: Send, recv: Recv) -> torch.Tensor:
    """The element-wise sum of every rank's ``flat`` (same length everywhere), returned as a new tensor.

    With ``size`` 1 it is a copy. Raises ValueError for a rank outside [0, size) or a received chunk of the
    wrong length.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a ring of {size}")
    out = flat.detach().clone().reshape(-1)
    if size == 1:
        return out
    bounds = chunk_bounds(out.numel(), size)
    right, left = (rank + 1) % size, (rank - 1) % size

    def part(index: int) -> torch.Tensor:
        start, end = bounds[index % size]
        return out[start:end]

    def receive(step: int, index: int) -> torch.Tensor:
        chunk = recv(left, step)
        want = part(index).numel()
        if chunk.numel() != want:
            raise ValueError(f"step {step}: rank {left} sent {chunk.numel()} values for a chunk of {want}")
        return chunk.reshape(-1)

    for step in range(size - 1):  # reduce-scatter: rank r ends owning chunk r + 1
        send(right, step, part(rank - step).clone())
        part(rank - step - 1).add_(receive(step, rank - step - 1))
    for step in range(size - 1):  # all-gather
        send(right, size - 1 + step, part(rank + 1 - step).clone())
        part(rank - step).copy_(receive(size - 1 + step, rank - step))
    return out
