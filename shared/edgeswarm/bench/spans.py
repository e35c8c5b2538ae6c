"""``edgeswarm bench spans``: what recording one span costs a worker, against the same loop recording nothing.

Three ways a worker records (``tracing.spans``): a ``with lane.span(...)`` block, ``lane.add`` with two
``perf_counter`` readings taken by the caller, and the publishing side's ``batches()`` (turning the raw tuples into
validated SpanRecords, on the service's main thread, not the computing one). Each is timed over ``spans`` spans,
``repeats`` times, the best kept, beside the baseline: the same loop around an empty ``nullcontext`` block. Times are
this thread's CPU time (``time.thread_time``), in nanoseconds per span: on a shared machine the wall clock counts
other processes' turns too.
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
    cpu = time.thread_time
    for _ in range(max(1, repeats)):
        t0 = cpu()
        for _i in range(spans):
            with nullcontext():
                pass
        best["baseline"] = min(best["baseline"], cpu() - t0)

        rec = SpanRecorder("bench", "stage-worker", capacity=spans)
        lane = rec.lane("bench-job", "stage 0")
        t0 = cpu()
        for i in range(spans):
            with lane.span("forward", "compute", 0, i):
                pass
        best["span"] = min(best["span"], cpu() - t0)

        t0 = cpu()
        rec.batches()
        best["batch"] = min(best["batch"], cpu() - t0)

        clock = time.perf_counter
        t0 = cpu()
        for i in range(spans):
            a = clock()
            lane.add("backward", "compute", a, clock(), 0, i)
        best["add"] = min(best["add"], cpu() - t0)
    per = 1e9 / spans
    return SpanCost(spans=spans, baseline_ns=best["baseline"] * per, span_ns=best["span"] * per,
                    add_ns=best["add"] * per, batch_ns=best["batch"] * per)
