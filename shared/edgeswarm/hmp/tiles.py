"""Tile-based overlap of a ring collective with the GEMM beside it (spec section 4): ``ag_gemm`` (AllGather then
GEMM, Eqs. 7-8) and ``gemm_rs`` (GEMM then ReduceScatter, Eqs. 9-11), for any ring size, uneven tiles and tiles of
zero rows.

Both send and receive on the same ring steps, slices and tags as ``runtime.collectives``' ``ring_all_gather`` and
``ring_reduce_scatter`` (so they count the same messages on the wire), but post the send of a tile and the receive
of the next one *before* the GEMM of the current tile, on a ``CommThreads`` pair, so the network moves tile k+1
while tile k is multiplied. A tile both ends know to be empty is neither sent nor awaited. Tensors cross the
transport flattened (1-D); the transport owns what it is given, which is never modified after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from edgeswarm.hmp.trace import Recorder
from edgeswarm.runtime.collectives import Bounds, Recv, Send

Gemm = Callable[[torch.Tensor], torch.Tensor]


class CommThreads:
    """One sending and one receiving thread for a rank, so that a transport's blocking calls never hold up the GEMM
    (sends keep their order). Spans of both go to ``recorder`` as ``comm``."""

    def __init__(self, recorder: Recorder, name: str = "hmp") -> None:
        self.recorder = recorder
        self._send = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-send")
        self._recv = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-recv")

    def isend(self, send: Send, to: int, step: int, tensor: torch.Tensor) -> Future[None]:
        def run() -> None:
            t0 = time.perf_counter()
            send(to, step, tensor)
            self.recorder.comm_span(f"send step {step}", t0, time.perf_counter())
        return self._send.submit(run)

    def irecv(self, recv: Recv, frm: int, step: int) -> Future[torch.Tensor]:
        posted = time.perf_counter()

        def run() -> torch.Tensor:
            got = recv(frm, step)
            self.recorder.comm_span(f"recv step {step}", posted, time.perf_counter())
            return got
        return self._recv.submit(run)

    def close(self) -> None:
        self._send.shutdown(wait=False, cancel_futures=True)
        self._recv.shutdown(wait=False, cancel_futures=True)


def _rows(bounds: Bounds, j: int) -> int:
    return bounds[j][1] - bounds[j][0]


def _take(fut: Future[torch.Tensor], rows: int, cols: int, like: torch.Tensor, rec: Recorder) -> torch.Tensor:
    with rec.phase("wait", "wait tile"):
        got = fut.result()
    if got.numel() != rows * cols or got.dtype != like.dtype:
        raise ValueError(f"a tile of {rows}x{cols} {like.dtype} came as {got.numel()} {got.dtype} values")
    return got.reshape(rows, cols).to(like.device)


def _settle(sends: list[Future[None]], rec: Recorder) -> None:
    with rec.phase("wait", "wait sends"):
        for f in sends:
            f.result()  # an async transport returns at once; this surfaces its errors


def ag_gemm(own: torch.Tensor, rank: int, bounds: Bounds, gemm: Gemm, send: Send, recv: Recv, io: CommThreads,
            rec: Recorder, *, first_step: int = 0, name: str = "gemm") -> torch.Tensor:
    """``gemm(AllGather(own))`` [s, out] where rank j holds rows ``bounds[j]`` (``own`` is rank ``rank``'s
    [rows, in]); ``gemm`` maps row tiles independently. Ring steps ``first_step`` .. ``first_step + N - 2``."""
    n = len(bounds)
    cols = own.shape[1]
    right, left = (rank + 1) % n, (rank - 1) % n
    outs: list[torch.Tensor | None] = [None] * n
    cur = own
    sends: list[Future[None]] = []
    with rec.phase("sync", f"ag+{name}"):
        for k in range(n):
            r = (rank - k) % n
            nxt: Future[torch.Tensor] | None = None
            if k < n - 1:
                nr = (rank - k - 1) % n
                if _rows(bounds, nr):
                    nxt = io.irecv(recv, left, first_step + k)
                if _rows(bounds, r):
                    sends.append(io.isend(send, right, first_step + k, cur.reshape(-1)))
            with rec.phase("compute", name):
                outs[r] = gemm(cur)
            if k < n - 1:
                nr = (rank - k - 1) % n
                cur = own.new_empty((0, cols)) if nxt is None else _take(nxt, _rows(bounds, nr), cols, own, rec)
        _settle(sends, rec)
        return torch.cat([o for o in outs if o is not None], 0)


def gemm_rs(full: torch.Tensor, rank: int, bounds: Bounds, gemm: Gemm, send: Send, recv: Recv, io: CommThreads,
            rec: Recorder, *, first_step: int = 0, name: str = "gemm") -> torch.Tensor:
    """Rows ``bounds[rank]`` of the sum over ranks of ``gemm(full)`` (``full`` [s, in] is this rank's; ``gemm`` maps
    row tiles independently), [rows, out]. Ring steps ``first_step`` .. ``first_step + N - 2``."""
    n = len(bounds)
    right, left = (rank + 1) % n, (rank - 1) % n
    acc: torch.Tensor | None = None
    sends: list[Future[None]] = []
    with rec.phase("sync", f"{name}+rs"):
        for k in range(1, n + 1):
            r = (rank - k) % n
            a, b = bounds[r]
            incoming: Future[torch.Tensor] | None = None
            if k >= 2:
                if b > a:
                    incoming = io.irecv(recv, left, first_step + k - 2)
                pa, pb = bounds[(rank - k + 1) % n]
                if pb > pa:
                    assert acc is not None
                    sends.append(io.isend(send, right, first_step + k - 2, acc.reshape(-1)))
            with rec.phase("compute", name):
                part = gemm(full[a:b])
            if incoming is not None:
                part = part + _take(incoming, b - a, part.shape[1], part, rec)
            acc = part
        _settle(sends, rec)
        assert acc is not None
        return acc
