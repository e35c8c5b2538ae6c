"""Slow work off the threads that take messages: one worker thread serving a bounded queue, in order.

Planning, profiling and checkpoint disk work can take seconds. Done on a handler thread, they would hold up
everything that shares its topic, probes included, so a service looks dead while it works. A service hands
such work to a ``QueueWorker``: ``offer`` never blocks (a full queue says no, and the service answers
``busy``), and one item that raises is logged and counted and the worker goes on with the next. With a
``share``, one sender node may have at most that many items offered and not yet served, so one member that sends
requests as fast as it can fills its share, not the queue, and the others' requests are still taken.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from edgeswarm.metrics import Metrics
from edgeswarm.shares import Refusal, SharedLimit

log = logging.getLogger(__name__)

T = TypeVar("T")


class QueueWorker(Generic[T]):
    """Serves items with ``serve`` on a daemon thread named ``name``, at most ``capacity`` waiting, and at most
    ``share`` (None: no share) offered by one sender and not yet served. ``failed`` (optional) hears of an item
    whose ``serve`` raised, to answer its requester."""

    def __init__(self, name: str, capacity: int, serve: Callable[[T], None], metrics: Metrics, *,
                 failed: Callable[[T, Exception], None] | None = None, depth_gauge: str | None = None,
                 share: int | None = None) -> None:
        self.capacity = capacity
        self._items: queue.Queue[tuple[str, T]] = queue.Queue(maxsize=capacity)
        # Offered and not yet served, per sender: the queue's waiting items plus the one being served.
        self._senders = SharedLimit(capacity + 1, share or capacity + 1)
        self._serve = serve
        self._failed = failed
        self._metrics = metrics
        self._gauge = depth_gauge
        self._stop = threading.Event()
        self._outstanding = 0  # offered and not yet served
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def offer(self, item: T) -> bool:
        """Queue ``item``; False (and nothing queued) when ``capacity`` items already wait."""
        return self.offer_from("", item) is None

    def offer_from(self, sender: str, item: T) -> Refusal | None:
        """Queue ``item`` of sender node ``sender``: None when queued, else why not (nothing queued): ``share``
        when the sender already has its share offered and not served, ``capacity`` when ``capacity`` items wait."""
        with self._count_lock:
            why = self._senders.take(sender, 1)
            if why is not None:
                return why
            try:
                self._items.put_nowait((sender, item))
            except queue.Full:
                self._senders.release(sender, 1)
                return Refusal("capacity", sender, 1, self.capacity, self.capacity)
            self._outstanding += 1
        self._measure()
        return None

    @property
    def depth(self) -> int:
        return self._items.qsize()

    @property
    def idle(self) -> bool:
        """True when nothing waits and nothing is being served."""
        with self._count_lock:
            return self._outstanding == 0

    def stop(self) -> None:
        """Serve nothing more; an item being served finishes on its own."""
        self._stop.set()

    def _measure(self) -> None:
        if self._gauge is not None:
            self._metrics.gauge(self._gauge, self._items.qsize())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sender, item = self._items.get(timeout=0.5)
            except queue.Empty:
                continue
            self._measure()
            try:
                self._serve(item)
            except Exception as exc:  # noqa: BLE001 - one item must never end the worker
                self._metrics.count("handler_errors")
                log.exception("%s failed on one item; going on with the next", self._thread.name)
                if self._failed is not None:
                    try:
                        self._failed(item, exc)
                    except Exception:  # noqa: BLE001 - answering is best effort
                        log.exception("%s could not report a failed item", self._thread.name)
            finally:
                with self._count_lock:
                    self._outstanding -= 1
                    self._senders.release(sender, 1)
