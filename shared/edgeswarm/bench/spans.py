"""``edgeswarm bench spans``: what recording one span costs a worker, against the same loop recording nothing.

Three ways a worker records (``tracing.spans``): a ``with lane.span(...)`` block, ``lane.add`` with two
``perf_counter`` readings taken by the caller, and the publishing side's ``batches()`` (turning the raw tuples into
validated SpanRecords, on the service's main thread, not the computing one). Each is timed over ``spans`` spans,
``repeats`` times, the best kept (the machine is shared), beside the baseline: the same loop around an empty
``nullcontext`` block. Times in nanoseconds per span.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

from pydantic import BaseModel, ConfigDict

from edgeswarm.tracing.spans import SpanRecorder


class SpanCost(BaseModel):
    """Nanoseconds per span: ``baseline_ns`` an empty nullcontext block, ``span_ns`` a ``with lane.span`` block,
    ``add_ns`` a ``lane.add`` with its two clock readings, ``batch_ns`` turning a held span into a published record."""

    model_config = ConfigDict(frozen=True)

    spans: int
    baseline_ns: float
    span_ns: float
    add_ns: float
    batch_ns: float

    @property
    def overhead_ns(self) -> float:
        """What a ``with lane.span`` block costs beyond the baseline."""
        return max(0.0, self.span_ns - self.baseline_ns)


def measure_span_cost(spans: int = 100_000, repeats: int = 5) -> SpanCost:
    """Time the three ways of recording ``spans`` spans (see the module's docstring), best of ``repeats``."""
    best = {"baseline": float("inf"), "span": float("inf"), "add": float("inf"), "batch": float("inf")}
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        for _i in range(spans):
            with nullcontext():
                pass
        best["baseline"] = min(best["baseline"], time.perf_counter() - t0)

        rec = SpanRecorder("bench", "stage-worker", capacity=spans)
        lane = rec.lane("bench-job", "stage 0")
        t0 = time.perf_counter()
        for i in range(spans):
            with lane.span("forward", "compute", 0, i):
                pass
        best["span"] = min(best["span"], time.perf_counter() - t0)

        t0 = time.perf_counter()
        rec.batches()
        best["batch"] = min(best["batch"], time.perf_counter() - t0)

        clock = time.perf_counter
        t0 = clock()
        for i in range(spans):
            a = clock()
            lane.add("backward", "compute", a, clock(), 0, i)
        best["add"] = min(best["add"], clock() - t0)
    per = 1e9 / spans
    return SpanCost(spans=spans, baseline_ns=best["baseline"] * per, span_ns=best["span"] * per,
                    add_ns=best["add"] * per, batch_ns=best["batch"] * per)
