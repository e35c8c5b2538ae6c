"""One rank's time split and trace spans: compute, sync (collective bookkeeping) and waiting for a peer's tensor,
per layer, and named (start, end, thread) spans a Chrome-trace writer draws (C-C4: comm spans beside GEMM spans).

Phases nest: a phase's own time is its duration less that of the phases inside it, so a collective's ``sync`` time
excludes the GEMMs and waits it runs. Times are ``time.perf_counter`` seconds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

Kind = Literal["compute", "sync", "wait"]
MAX_SPANS = 200_000  # the oldest half is dropped beyond this, so a long-lived rank's memory stays bounded
OUTSIDE = -1  # the "layer" of embeddings and the final norm/head


class Span(BaseModel):
    """``name`` ran from ``start`` to ``end`` (perf_counter seconds) on thread ``thread``; ``kind`` is the phase it
    was (``comm`` for the communication thread's send and receive spans); ``layer`` -1 outside the layers."""

    model_config = ConfigDict(frozen=True)

    name: str
    kind: Literal["compute", "sync", "wait", "comm"]
    layer: int
    start: float
    end: float
    thread: str


class LayerTime(BaseModel):
    """Seconds layer ``layer`` (-1: embeddings and head) spent computing, in collective bookkeeping (copies, sums,
    handing tensors to the transport) and waiting for a peer's tensor, over the passes since the last reset;
    ``norm_rows`` counts the rows it normalised (C-C3)."""

    layer: int
    compute_s: float = 0.0
    sync_s: float = 0.0
    wait_s: float = 0.0
    norm_rows: int = 0


class ChromeEvent(BaseModel):
    """A complete event ("ph": "X") of the Chrome trace format, times in microseconds."""

    name: str
    cat: str
    ph: str = "X"
    ts: float
    dur: float
    pid: int
    tid: str


class Recorder:
    """Per-rank time split and spans; phases are recorded by the thread that runs the layers, comm spans by the
    communication threads. Thread-safe.

    ``slowdown`` emulates a slower device: each compute phase (the outermost one of a nest) is stretched to
    ``slowdown`` times the CPU time the thread spent in it (``DeviceProfile.run``'s rule), there and then, so the
    waits and transfers around it keep their real timing and overlap stays what it would be on the device."""

    def __init__(self, spans: bool = True, fence: Callable[[], None] | None = None, slowdown: float = 1.0) -> None:
        self.layer = OUTSIDE
        self.keep_spans = spans
        self._fence = fence  # waits for an accelerator's queued kernels, so a compute phase ends when they do
        self.slowdown = slowdown
        self._lock = threading.Lock()
        self._local = threading.local()
        self._times: dict[int, LayerTime] = {}
        self._spans: list[Span] = []

    @contextmanager
    def phase(self, kind: Kind, name: str) -> Iterator[None]:
        stack: list[list[float]] = getattr(self._local, "stack", None) or []
        self._local.stack = stack
        emulate = kind == "compute" and self.slowdown > 1.0 and not getattr(self._local, "computing", False)
        if emulate:
            self._local.computing = True
            cpu_start = time.thread_time()
        frame = [time.perf_counter(), 0.0]
        stack.append(frame)
        try:
            yield
        finally:
            if kind == "compute" and self._fence is not None:
                self._fence()
            if emulate:
                self._local.computing = False
                left = (time.thread_time() - cpu_start) * self.slowdown - (time.perf_counter() - frame[0])
                if left > 0:
                    time.sleep(left)
            end = time.perf_counter()
            stack.pop()
            dur = end - frame[0]
            if stack:
                stack[-1][1] += dur
            own = dur - frame[1]
            layer = self.layer
            with self._lock:
                t = self._times.setdefault(layer, LayerTime(layer=layer))
                setattr(t, f"{kind}_s", getattr(t, f"{kind}_s") + own)
            self._span(name, kind, layer, frame[0], end)

    def comm_span(self, name: str, start: float, end: float) -> None:
        self._span(name, "comm", self.layer, start, end)

    def count_norm(self, rows: int) -> None:
        with self._lock:
            self._times.setdefault(self.layer, LayerTime(layer=self.layer)).norm_rows += rows

    def times(self) -> list[LayerTime]:
        """The split per layer, ``-1`` (outside the layers) first."""
        with self._lock:
            return [self._times[k].model_copy() for k in sorted(self._times)]

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def reset(self) -> None:
        with self._lock:
            self._times.clear()
            self._spans.clear()

    def _span(self, name: str, kind: str, layer: int, start: float, end: float) -> None:
        if not self.keep_spans:
            return
        span = Span(name=name, kind=kind, layer=layer, start=start, end=end,  # type: ignore[arg-type]
                    thread=threading.current_thread().name)
        with self._lock:
            self._spans.append(span)
            if len(self._spans) > MAX_SPANS:
                del self._spans[: MAX_SPANS // 2]


def chrome_events(spans: list[Span], pid: int, origin: float = 0.0) -> list[ChromeEvent]:
    """``spans`` as Chrome-trace complete events of process ``pid`` (one per rank), times from ``origin``."""
    return [ChromeEvent(name=s.name, cat=s.kind, ts=(s.start - origin) * 1e6, dur=(s.end - s.start) * 1e6, pid=pid,
                        tid=s.thread) for s in spans]


def write_chrome_trace(path: Path, ranks: list[list[Span]]) -> int:
    """Write every rank's spans (``ranks[r]`` as process ``r``; times from the earliest span) as a Chrome trace
    (``chrome://tracing``, Perfetto) to ``path``; returns the number of events."""
    starts = [s.start for spans in ranks for s in spans]
    origin = min(starts) if starts else 0.0
    events = [e.model_dump() for r, spans in enumerate(ranks) for e in chrome_events(spans, r, origin)]
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(events)
