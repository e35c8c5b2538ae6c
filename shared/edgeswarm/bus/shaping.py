"""Emulated links: a token bucket for bandwidth and a delay line for latency, enforced on send.

A message of ``n`` bytes occupies the link for ``n / bandwidth`` seconds and arrives ``latency``
seconds after its last byte left. The sender is held back while the link is busy (so a slow link
applies backpressure), and the delay line keeps messages in order while they are "in the air".
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from edgeswarm.settings import LinkSpec

log = logging.getLogger(__name__)

# What an idle emulated link sends at once, at most: enough that a control message (a few hundred bytes) is not held
# for a sleep shorter than the scheduler's granularity, and no more. A real link sends a tensor's every byte at its
# rate; at 64 KiB, a 150 KB tensor on an idle link went out in 0.57 of its time, and the predictions of SplitFed's
# and the serving pipelines' transfers missed by that (0.2x-0.8x) in-process but not on the kernel's links.
LINK_BURST_BYTES = 4 * 1024


class TokenBucket:
    """Paces bytes at ``rate_bps`` bytes per second with at most ``burst_bytes`` of credit.

    ``reserve(n)`` returns the time (``clock()`` units, seconds) at which the last of the ``n`` bytes has
    left the link; callers wait until then. Reservations are FIFO, so concurrent senders share the rate.
    """

    def __init__(self, rate_bps: float, burst_bytes: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_bps <= 0:
            raise ValueError("rate_bps must be positive")
        self.rate = rate_bps
        self.burst_s = burst_bytes / rate_bps
        self._clock = clock
        self._free_at = -float("inf")
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        with self._lock:
            now = self._clock()
            start = max(self._free_at, now - self.burst_s)
            self._free_at = start + nbytes / self.rate
            return self._free_at


class DelayLine:
    """Runs callables at given times on one background thread, in time order (FIFO among equal times)."""

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopped = False
        self._running = False  # a popped callable is running
        self._thread = threading.Thread(target=self._run, name=f"delay-{name}", daemon=True)
        self._thread.start()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at monotonic time ``when`` (seconds)."""
        with self._cv:
            heapq.heappush(self._heap, (when, next(self._seq), fn))
            self._cv.notify_all()  # stop() may wait on the same condition

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop the thread once what is queued has run, or after ``drain_s`` seconds (what is left is dropped)."""
        deadline = time.monotonic() + drain_s
        with self._cv:
            while (self._heap or self._running) and time.monotonic() < deadline:
                self._cv.wait(min(0.05, deadline - time.monotonic()))
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._running = False
                self._cv.notify_all()
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic())
                    self._cv.wait(wait)
                if self._stopped:
                    return
                _, _, fn = heapq.heappop(self._heap)
                self._running = True
            try:
                fn()
            except Exception:
                log.exception("delayed send failed")


class ShapedLink:
    """One emulated outgoing link. ``transmit`` blocks while the link is busy, then delivers after the latency.
    ``burst_bytes`` is what an idle link lets go at once; the bus gives it at most one chunk, so that a tensor's
    chunks after its first take their time on the link, which is what the closed loop's link fit measures."""

    def __init__(self, peer: str, spec: LinkSpec, burst_bytes: int = LINK_BURST_BYTES) -> None:
        self.peer = peer
        self.spec = spec
        self._bucket = TokenBucket(spec.bandwidth_bps, burst_bytes)
        self._delay = DelayLine(peer) if spec.latency_s > 0 else None
        self.bytes_sent = 0

    def transmit(self, nbytes: int, send: Callable[[], None]) -> None:
        """Occupy the link for ``nbytes`` and have ``send`` deliver the message ``latency`` later."""
        done_at = self._bucket.reserve(nbytes)
        self.bytes_sent += nbytes
        pause = done_at - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        if self._delay is None:
            send()
        else:
            # A message inside the burst allowance is done "in the past"; its latency still starts now.
            self._delay.at(max(done_at, time.monotonic()) + self.spec.latency_s, send)

    def close(self, drain_s: float = 0.0) -> None:
        """Stop the delay line, after up to ``drain_s`` seconds for the messages in the air to be delivered."""
        if self._delay is not None:
            self._delay.stop(drain_s)
