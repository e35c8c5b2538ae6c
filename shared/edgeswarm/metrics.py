"""Counters and gauges of one service instance, published periodically as a MetricsReport."""

from __future__ import annotations

import threading
from collections import defaultdict


class Metrics:
    """Thread-safe named counters (monotonic totals) and gauges (current values)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: defaultdict[str, int] = defaultdict(int)
        self._gauges: dict[str, float] = {}

    def count(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name``."""
        with self._lock:
            self._counters[name] += amount

    def gauge(self, name: str, value: float) -> None:
        """Set gauge ``name`` to ``value``."""
        with self._lock:
            self._gauges[name] = float(value)

    def counter(self, name: str) -> int:
        """The current total of counter ``name`` (0 if never counted)."""
        with self._lock:
            return self._counters.get(name, 0)

    def total(self, prefix: str) -> int:
        """Sum of every counter whose name starts with ``prefix``."""
        with self._lock:
            return sum(v for k, v in self._counters.items() if k.startswith(prefix))

    def snapshot(self) -> tuple[dict[str, int], dict[str, float]]:
        """Copies of (counters, gauges)."""
        with self._lock:
            return dict(self._counters), dict(self._gauges)
