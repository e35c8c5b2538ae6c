"""Training's ring AllReduce (``runtime.collectives`` with even slices) over an in-process transport: every rank gets
the exact sum."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from edgeswarm.runtime.collectives import even_bounds, ring_all_reduce


def _run_ring(vectors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    size = len(vectors)
    boxes = {(src, dst): queue.Queue() for src in range(size) for dst in range(size)}
    sent = [0] * size
    results: list[torch.Tensor | None] = [None] * size
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        def send(to: int, step: int, chunk: torch.Tensor) -> None:
            sent[rank] += chunk.numel()
            boxes[(rank, to)].put((step, chunk))

        def recv(frm: int, step: int) -> torch.Tensor:
            got_step, chunk = boxes[(frm, rank)].get(timeout=5)
            assert got_step == step
            return chunk

        try:
            results[rank] = ring_all_reduce(vectors[rank], rank, even_bounds(vectors[rank].numel(), size), send, recv)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    return [r for r in results if r is not None], sent


@pytest.mark.parametrize(("size", "length"), [(1, 5), (2, 10), (3, 10), (4, 3), (5, 1001)])
def test_every_rank_gets_the_sum_and_sends_the_ring_volume(size: int, length: int) -> None:
    gen = torch.Generator().manual_seed(size * 100 + length)
    vectors = [torch.randn(length, generator=gen, dtype=torch.float64) for _ in range(size)]
    results, sent = _run_ring(vectors)
    want = torch.stack(vectors).sum(dim=0)
    assert len(results) == size
    for r in results:
        assert torch.allclose(r, want, rtol=0, atol=1e-12)
    # Eq. 5b's volume: 2 (size - 1) / size of the vector per rank (chunk sizes differ by at most one).
    assert all(abs(s - 2 * (size - 1) * length / size) <= 2 * (size - 1) for s in sent)
    assert all(torch.equal(v, vectors[i]) for i, v in enumerate(vectors)), "inputs are not modified"


def test_even_bounds_cover_the_vector() -> None:
    assert even_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert even_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
