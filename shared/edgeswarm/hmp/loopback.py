"""An in-memory ring transport for tests and benchmarks on one host: ranks in threads, one queue per message,
messages and bytes counted per sending rank and per collective, and an optional emulated link (bandwidth and
latency) with one outbox thread per sender, so that ``send`` returns at once as the platform's does.

The emulated link: a sender's messages leave one after another, each taking its bytes / ``bandwidth_bps``, and
each arrives ``latency_s`` after it left. The latency is in flight, not on the sender, so messages sent to several
peers at once (a direct collective's) overlap their latencies, as on the platform, where each goes through its
own outbox and broker."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from edgeswarm.runtime.collectives import Recv, Send

Key = tuple[int, int, int, int]  # scope, collective, step, sender
RECV_TIMEOUT_S = 30.0


@dataclass
class Counts:
    """Messages and bytes one rank sent."""

    messages: int = 0
    bytes: int = 0
    per_collective: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (scope, c) -> (msgs, B)
    steps: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # (scope, c) -> the steps it sent on


class Loopback:
    """``n`` ranks; ``ring(rank, scope)`` is the ``ring(collective) -> (send, recv)`` factory of one forward pass.
    ``bandwidth_bps`` (bits per second, per sending rank) and ``latency_s`` emulate a link; ``recv`` raises
    TimeoutError after ``timeout_s``."""

    def __init__(self, n: int, *, bandwidth_bps: float | None = None, latency_s: float = 0.0,
                 timeout_s: float = RECV_TIMEOUT_S) -> None:
        self.n = n
        self.bandwidth_bps = bandwidth_bps
        self.latency_s = latency_s
        self.timeout_s = timeout_s
        self.counts = [Counts() for _ in range(n)]
        self._lock = threading.Condition()
        self._held: dict[tuple[int, Key], torch.Tensor] = {}  # (to rank, key) -> tensor
        self._outboxes: list[queue.Queue[tuple[int, Key, torch.Tensor] | None]] = []
        self._threads: list[threading.Thread] = []
        if bandwidth_bps is not None or latency_s > 0:
            for r in range(n):
                box: queue.Queue[tuple[int, Key, torch.Tensor] | None] = queue.Queue()
                flight: queue.Queue[tuple[float, int, Key, torch.Tensor] | None] = queue.Queue()
                self._outboxes.append(box)
                self._threads += [threading.Thread(target=self._pump, args=(box, flight), name=f"link-{r}",
                                                   daemon=True),
                                  threading.Thread(target=self._land, args=(flight,), name=f"flight-{r}",
                                                   daemon=True)]
            for t in self._threads:
                t.start()

    def ring(self, rank: int, scope: int = 0) -> Callable[[int], tuple[Send, Recv]]:
        def factory(collective: int) -> tuple[Send, Recv]:
            def send(to: int, step: int, tensor: torch.Tensor) -> None:
                if tensor.numel() == 0:
                    raise AssertionError("an empty tensor was sent")
                if tensor.dim() != 1:
                    raise AssertionError(f"the wire carries 1-D tensors, not {list(tensor.shape)}")
                nbytes = tensor.numel() * tensor.element_size()
                key = (scope, collective, step, rank)
                with self._lock:
                    c = self.counts[rank]
                    c.messages += 1
                    c.bytes += nbytes
                    m, b = c.per_collective.get((scope, collective), (0, 0))
                    c.per_collective[(scope, collective)] = (m + 1, b + nbytes)
                    c.steps.setdefault((scope, collective), set()).add(step)
                copy = tensor.detach().to("cpu", copy=True)
                if self._outboxes:
                    self._outboxes[rank].put((to, key, copy))
                else:
                    self._deliver(to, key, copy)

            def recv(frm: int, step: int) -> torch.Tensor:
                slot = (rank, (scope, collective, step, frm))
                deadline = time.monotonic() + self.timeout_s
                with self._lock:
                    while slot not in self._held:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError(f"rank {rank}: nothing from {frm} for {slot[1]}")
                        self._lock.wait(left)
                    return self._held.pop(slot)
            return send, recv
        return factory

    def close(self) -> None:
        for box in self._outboxes:
            box.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _deliver(self, to: int, key: Key, tensor: torch.Tensor) -> None:
        with self._lock:
            self._held[(to, key)] = tensor
            self._lock.notify_all()

    def _pump(self, box: queue.Queue[tuple[int, Key, torch.Tensor] | None],
              flight: queue.Queue[tuple[float, int, Key, torch.Tensor] | None]) -> None:
        """Transmit one sender's messages in order, each for its bytes' time on the link, then put it in flight."""
        while True:
            item = box.get()
            if item is None:
                flight.put(None)
                return
            to, key, tensor = item
            if self.bandwidth_bps:
                time.sleep(tensor.numel() * tensor.element_size() * 8 / self.bandwidth_bps)
            flight.put((time.monotonic() + self.latency_s, to, key, tensor))

    def _land(self, flight: queue.Queue[tuple[float, int, Key, torch.Tensor] | None]) -> None:
        """Deliver one sender's messages in flight when each is due (in order: one latency for all)."""
        while True:
            item = flight.get()
            if item is None:
                return
            due, to, key, tensor = item
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._deliver(to, key, tensor)
