"""Counters, gauges and histograms of one service instance, published periodically as a MetricsReport."""

from __future__ import annotations

import bisect
import math
import threading
from collections import OrderedDict, defaultdict

from edgeswarm.messages.metrics import MAX_HISTOGRAMS, MAX_METRIC_NAME, Histogram


class _Series:
    """One histogram's buckets (per bucket, not cumulative; the last is +Inf), its sum and its count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: a value equal to a bound is in its bucket
        self.sum += value
        self.count += 1

    def snapshot(self) -> Histogram:
        cumulative, running = [], 0
        for n in self.counts[:-1]:
            running += n
            cumulative.append(running)
        return Histogram(bounds=self.bounds, counts=tuple(cumulative), sum=self.sum, count=self.count)


class Metrics:
    """Thread-safe named counters (monotonic totals), gauges (current values) and histograms (distributions with
    the fixed bucket bounds ``edgeswarm.observability.catalogue`` gives each name). At most MAX_HISTOGRAMS
    histograms are kept: a new one beyond that replaces the one observed least recently (a finished job's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: defaultdict[str, int] = defaultdict(int)
        self._gauges: dict[str, float] = {}
        self._histograms: OrderedDict[str, _Series] = OrderedDict()

    def count(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name``."""
        with self._lock:
            self._counters[name] += amount

    def gauge(self, name: str, value: float) -> None:
        """Set gauge ``name`` to ``value``."""
        with self._lock:
            self._gauges[name] = float(value)

    def forget_gauge(self, name: str) -> None:
        """Stop reporting gauge ``name`` (its value is no longer known)."""
        with self._lock:
            self._gauges.pop(name, None)

    def observe(self, name: str, value: float, bounds: tuple[float, ...]) -> None:
        """Add one observation ``value`` (in the histogram's unit, seconds for durations) to histogram ``name``,
        whose bucket upper bounds are ``bounds`` (ascending; read when the histogram is first observed). A value that
        is not finite, or a name too long for a report, is counted under ``histogram_refused``."""
        value = float(value)
        with self._lock:
            if not math.isfinite(value) or not 1 <= len(name) <= MAX_METRIC_NAME:
                self._counters["histogram_refused"] += 1
                return
            series = self._histograms.get(name)
            if series is None:
                if len(self._histograms) >= MAX_HISTOGRAMS:
                    self._histograms.popitem(last=False)
                    self._counters["histograms_evicted"] += 1
                series = self._histograms[name] = _Series(bounds)
            else:
                self._histograms.move_to_end(name)
            series.observe(value)
            if not math.isfinite(series.sum):  # a run of huge values: start the series again rather than lie
                del self._histograms[name]
                self._counters["histogram_refused"] += 1

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

    def histograms(self) -> dict[str, Histogram]:
        """Every histogram as it stands (cumulative counts, as a MetricsReport carries them)."""
        with self._lock:
            return {name: series.snapshot() for name, series in self._histograms.items()}
