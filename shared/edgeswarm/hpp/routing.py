"""Which samples go where between two device groups of different sizes (spec 6.1).

Every device of stage p holds ``y_i`` samples of each micro-batch; stage p+1's devices hold ``y_j``. The
routing matrix X has X[i, j] samples going from sender i to receiver j, with row sums y_i and column sums
y_j: the proportional target y_i * y_j / B rounded down, the remainder filled by the north-west-corner rule
(always feasible, since both residual totals are equal). Example: [40, 24] -> [32, 16, 16] gives
[[20, 10, 10], [12, 6, 6]].

Sender i cuts its slice (in its own sample order) into consecutive pieces of X[i, 0], X[i, 1], ... rows;
receiver j concatenates the pieces it gets in sender order. In backward, receiver j returns to each sender
exactly the gradient rows of that sender's piece, so forward and backward of a sample stay on one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgeswarm.errors import PlanningError


def routing_matrix(senders: Sequence[int], receivers: Sequence[int]) -> np.ndarray:
    """X [len(senders), len(receivers)] of non-negative ints with the given row and column sums.

    Raises PlanningError when the two groups do not carry the same number of samples.
    """
    y_s = np.asarray(senders, dtype=np.int64)
    y_r = np.asarray(receivers, dtype=np.int64)
    total = int(y_s.sum())
    if total != int(y_r.sum()) or (y_s < 0).any() or (y_r < 0).any():
        raise PlanningError(f"cannot route {list(senders)} samples into {list(receivers)}: the shares must be "
                            "non-negative and add up to the same micro-batch size")
    x = (y_s[:, None] * y_r[None, :]) // max(total, 1)
    row_left = y_s - x.sum(axis=1)
    col_left = y_r - x.sum(axis=0)
    i = j = 0
    while i < len(y_s) and j < len(y_r):
        move = min(row_left[i], col_left[j])
        x[i, j] += move
        row_left[i] -= move
        col_left[j] -= move
        if row_left[i] == 0:
            i += 1
        else:
            j += 1
    return x


@dataclass(frozen=True)
class Piece:
    """Rows [sender_start, sender_start + rows) of sender ``sender``'s slice are rows
    [receiver_start, receiver_start + rows) of receiver ``receiver``'s slice."""

    sender: int
    receiver: int
    rows: int
    sender_start: int
    receiver_start: int


def pieces(matrix: np.ndarray) -> list[Piece]:
    """The non-empty pieces of a routing matrix, sender by sender, in sender order within each receiver."""
    receiver_fill = np.zeros(matrix.shape[1], dtype=np.int64)
    out = []
    for i in range(matrix.shape[0]):
        start = 0
        for j in range(matrix.shape[1]):
            rows = int(matrix[i, j])
            if rows:
                out.append(Piece(i, j, rows, start, int(receiver_fill[j])))
                receiver_fill[j] += rows
                start += rows
    return out


def route_ids(ids_by_sender: Sequence[np.ndarray], matrix: np.ndarray) -> list[np.ndarray]:
    """The sample ids each receiver holds, given each sender's ids in its own order."""
    chunks: list[list[np.ndarray]] = [[] for _ in range(matrix.shape[1])]
    for piece in pieces(matrix):
        ids = np.asarray(ids_by_sender[piece.sender])
        chunks[piece.receiver].append(ids[piece.sender_start:piece.sender_start + piece.rows])
    return [np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in chunks]


def stage_sample_ids(shares: Sequence[Sequence[int]], micro_batch_ids: np.ndarray) -> list[list[np.ndarray]]:
    """For one micro-batch: the sample ids every device of every stage holds, [stage][device].

    Stage 0's devices take consecutive runs of ``micro_batch_ids`` by their shares; later stages follow the
    routing between consecutive groups. The last stage's entry says which labels each last device needs.
    """
    ids = np.asarray(micro_batch_ids)
    first = np.cumsum([0, *shares[0]])
    held = [[ids[first[d]:first[d + 1]] for d in range(len(shares[0]))]]
    for p in range(1, len(shares)):
        held.append(route_ids(held[-1], routing_matrix(shares[p - 1], shares[p])))
    return held
