"""The queue worker that keeps slow work off the threads that take messages."""

from __future__ import annotations

import threading

from edgeswarm.metrics import Metrics
from edgeswarm.queue_worker import QueueWorker
from helpers import wait_until


def test_a_full_queue_says_no_and_a_failing_item_does_not_stop_the_worker() -> None:
    release = threading.Event()
    served: list[int] = []
    failed: list[tuple[int, str]] = []
    metrics = Metrics()

    def serve(item: int) -> None:
        release.wait(10)
        if item == 1:
            raise ValueError("bad item")
        served.append(item)

    worker = QueueWorker("test-worker", 2, serve, metrics, failed=lambda i, e: failed.append((i, str(e))),
                         depth_gauge="depth")
    try:
        assert worker.idle and worker.offer(0)
        wait_until(lambda: worker.depth == 0, 5, message="the first item taken")  # now being served, blocked
        assert not worker.idle
        assert worker.offer(1) and worker.offer(2)
        assert not worker.offer(3), "two wait already: the third is refused, not queued"
        release.set()
        wait_until(lambda: served == [0, 2], 10, message="the items after the failing one served")
        assert failed == [(1, "bad item")] and metrics.counter("handler_errors") == 1
        assert worker.offer(4)
        wait_until(lambda: served == [0, 2, 4], 10, message="the worker still serving")
        wait_until(lambda: worker.idle, 5, message="the worker idle")
    finally:
        worker.stop()
