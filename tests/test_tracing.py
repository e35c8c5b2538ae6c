"""Measured spans (issue 24): the recorder, the Chrome trace conversion, the round schedule, and the collector's
handling of hostile span batches and trace requests on a real broker. The end-to-end trace of a training job is in
test_zoo_training.py, on that module's cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from conftest import bus_settings
from edgeswarm import topics
from edgeswarm.bus import Bus
from edgeswarm.dashboard.trace_collector import TraceCollector
from edgeswarm.messages import JobState
from edgeswarm.messages.tracing import SpanBatch, SpanRecord, TraceReply, TraceRequest
from edgeswarm.metrics import Metrics
from edgeswarm.planning.hpp.schedule import simulate
from edgeswarm.tracing.chrome import chrome_trace_bytes
from edgeswarm.tracing.schedule import complete_rounds, measured_bars, schedule_view, timeline_bars
from edgeswarm.tracing.spans import RawSpan, SpanRecorder
from edgeswarm.values.schedule import lane_key
from edgeswarm.wire import Sender
from helpers import wait_until


def span(name: str = "forward", *, node: str = "d0", lane: str = "stage 0", round: int | None = 0,
         mb: int | None = 0, start: float = 1000.0, dur: float = 0.01, job: str = "j1",
         cat: str = "compute") -> SpanRecord:
    return SpanRecord(name=name, cat=cat, job_id=job, node=node, service="stage-worker", lane=lane, round=round,
                      micro_batch=mb, start=start, dur_s=dur)  # type: ignore[arg-type]


# --- recorder -----------------------------------------------------------------------------------------------------


def test_the_recorder_times_spans_on_the_wall_clock_and_batches_them_per_job() -> None:
    rec = SpanRecorder("d0", "stage-worker")
    lane = rec.lane("j1", "stage 1")
    before = time.time()
    with lane.span("forward", "compute", round=3, micro_batch=1):
        time.sleep(0.02)
    with pytest.raises(RuntimeError):  # a block that raises still records its span
        with rec.lane("j2", "shard 0").span("allgather", "collective"):
            raise RuntimeError("boom")
    batches = rec.batches()
    assert [b.job_id for b in batches] == ["j1", "j2"] and len(rec) == 0
    fwd = batches[0].spans[0]
    assert (fwd.name, fwd.lane, fwd.round, fwd.micro_batch, fwd.node, fwd.service) == \
        ("forward", "stage 1", 3, 1, "d0", "stage-worker")
    assert 0.015 <= fwd.dur_s < 5 and before - 1 <= fwd.start <= time.time()
    assert batches[1].spans[0].round is None and batches[1].spans[0].cat == "collective"
    assert fwd.samples is None  # not said
    lane.add("forward", "compute", 1.0, 1.5, micro_batch=2, samples=8)
    lane.add("forward", "compute", 2.0, 2.5, micro_batch=3, samples=0)  # no count of samples: the span stays
    assert [(s.micro_batch, s.samples) for b in rec.batches() for s in b.spans] == [(2, 8), (3, None)]
    assert rec.batches() == []


def test_a_full_recorder_drops_the_oldest_spans_and_counts_them_per_job() -> None:
    rec = SpanRecorder("d0", "stage-worker", capacity=10)
    lane = rec.lane("j1", "stage 0")
    for i in range(25):
        lane.add("forward", "compute", float(i), float(i) + 0.5, round=i)
    assert rec.spans_dropped == 15 and len(rec) == 10
    (batch,) = rec.batches()
    assert batch.dropped == 15 and [s.round for s in batch.spans] == list(range(15, 25))


def test_the_recorder_is_thread_safe_and_splits_big_jobs_into_batches() -> None:
    rec = SpanRecorder("d0", "stage-worker", capacity=100_000)

    def work(k: int) -> None:
        lane = rec.lane("j1", f"stage {k}")
        for i in range(700):
            with lane.span("backward", "compute", round=0, micro_batch=i):
                pass

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batches = rec.batches()
    assert sum(len(b.spans) for b in batches) == 2800 and rec.spans_dropped == 0
    assert all(len(b.spans) <= SpanBatch.MAX_SPANS for b in batches) and len(batches) == 3


def test_long_strings_are_cut_and_a_span_that_is_no_record_is_dropped() -> None:
    rec = SpanRecorder("d0", "stage-worker")
    rec.lane("j1", "x" * 500).add("y" * 500, "wait", 1.0, 2.0)
    rec.add(RawSpan("no/name", "stage 0", "forward", "compute", 0, 0, 1.0, 2.0))
    batches = rec.batches()
    (good,) = [b for b in batches if b.spans]
    assert len(good.spans[0].name) == 64 and len(good.spans[0].lane) == 64
    assert not [b for b in batches if b.job_id == "no/name"]


# --- chrome trace -------------------------------------------------------------------------------------------------


def test_the_chrome_trace_has_a_process_per_node_a_thread_per_lane_and_microsecond_events(tmp_path: Path) -> None:
    spans = [span(node="d1", lane="stage 1", start=1000.5, dur=0.25, mb=1),
             span(node="d0", lane="stage 0", start=1000.0, dur=0.125),
             span("activation", node="d0", lane="link 0→1", start=1000.2, dur=0.002, cat="transfer"),
             span("step", node="d0", lane="stage 0", start=1001.0, dur=0.001, mb=None)]
    path = tmp_path / "t.json"
    path.write_bytes(chrome_trace_bytes(spans, job_id="j1"))
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    procs = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {"d0": 1, "d1": 2}
    threads = {(e["pid"], e["args"]["name"]): e["tid"] for e in events if e["name"] == "thread_name"}
    assert threads == {(1, "stage 0"): 1, (1, "link 0→1"): 2, (2, "stage 1"): 1}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 4
    for e in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
    first = next(e for e in complete if e["pid"] == 2)
    assert first["ts"] == pytest.approx(500_000.0) and first["dur"] == pytest.approx(250_000.0)
    assert first["name"] == "forward 1" and first["args"]["round"] == 0
    assert trace["otherData"]["origin_unix_s"] == pytest.approx(1000.0)
    assert json.loads(chrome_trace_bytes([]))["traceEvents"] == []


def test_lanes_sort_by_their_numbers() -> None:
    lanes = ["stage 10", "link 1→2", "stage 1", "stage 2", "link 0→1", "stage 0"]
    assert sorted(lanes, key=lane_key) == ["stage 0", "link 0→1", "stage 1", "link 1→2", "stage 2", "stage 10"]


# --- schedule -----------------------------------------------------------------------------------------------------


def test_a_round_is_complete_once_every_device_has_stepped_or_moved_on() -> None:
    spans = [span(node="d0", round=0), span("step", node="d0", round=0, mb=None),
             span(node="d1", round=0), span(node="d1", round=1),  # d1 moved on to round 1: round 0 is all in
             span(node="d0", round=1)]
    assert complete_rounds(spans) == [0]
    assert complete_rounds(spans, ["d0", "d1", "d2"]) == []  # d2 never reported
    assert complete_rounds(spans + [span("step", node="d0", round=1, mb=None), span("step", node="d1", round=1,
                                                                                    mb=None)]) == [0, 1]


def test_measured_bars_start_at_the_round_and_a_shared_lane_is_shown_per_device() -> None:
    spans = [span(node="d0", lane="stage 0", round=2, start=50.0, dur=0.5),
             span(node="d1", lane="stage 0", round=2, start=50.25, dur=0.5),
             span(node="d2", lane="stage 1", round=2, start=51.0, dur=0.25),
             span(node="d2", lane="stage 1", round=1, start=10.0, dur=0.25)]
    bars = measured_bars(spans, 2)
    assert [(b.lane, b.start_s) for b in bars] == [("stage 0 (d0)", 0.0), ("stage 0 (d1)", 0.25), ("stage 1", 1.0)]
    assert all(b.source == "measured" for b in bars)


def test_a_simulated_round_becomes_planned_bars_on_stage_and_link_lanes() -> None:
    timeline = simulate([0.1, 0.02, 0.2], [0.2, 0.02, 0.4], 2, [2, 1], [0.05, 0.0, 0.0])
    bars = timeline_bars(timeline)
    assert {b.lane for b in bars} == {"stage 0", "link 0→1", "stage 1"}
    names = {(b.lane, b.name) for b in bars}
    assert {("stage 0", "forward"), ("stage 0", "backward"), ("stage 0", "allreduce"), ("link 0→1", "activation"),
            ("link 0→1", "gradient")} <= names
    assert sum(b.name == "forward" and b.lane == "stage 1" for b in bars) == 2
    view = schedule_view("j1", 0, measured_bars([span(lane="stage 0", round=0)], 0), bars)
    assert view.lanes == ("stage 0", "link 0→1", "stage 1")
    assert view.planned_s == pytest.approx(timeline.makespan_s) and view.measured_s == pytest.approx(0.01)


# --- collector on a real broker -----------------------------------------------------------------------------------


@pytest.fixture
def collector_bus(broker: Any) -> Iterator[tuple[TraceCollector, Bus, Bus, Metrics]]:
    """A collector on node hub (as the dashboard runs it) and a device's bus, both on the test broker."""
    settings = bus_settings(broker.url)
    metrics = Metrics()
    hub = Bus(settings, Sender(node="hub", service="dashboard", instance="h1"), metrics)
    device = Bus(settings, Sender(node="d0", service="stage-worker", instance="d1"))
    hub.start()
    device.start()
    collector = TraceCollector(hub, metrics, max_jobs=2, max_spans_per_job=5)
    collector.start(topics.request("hub", "dashboard"))
    time.sleep(0.2)
    try:
        yield collector, hub, device, metrics
    finally:
        device.stop()
        hub.stop()


def batch(node: str = "d0", job: str = "j1", n: int = 2, service: str = "stage-worker", r: int = 0) -> SpanBatch:
    return SpanBatch(node=node, service=service, job_id=job, spans=[
        SpanRecord(name="forward", cat="compute", job_id=job, node=node, service=service, lane="stage 0", round=r,
                   micro_batch=i, start=1000.0 + i, dur_s=0.5) for i in range(n)])


def test_the_collector_keeps_spans_per_job_bounded_and_answers_trace_requests(collector_bus) -> None:  # type: ignore[no-untyped-def]
    collector, _, device, metrics = collector_bus
    device.publish(topics.spans("d0", "stage-worker"), batch(n=4))
    device.publish(topics.spans("d0", "stage-worker"), batch(n=3, r=1))
    wait_until(lambda: metrics.counter("spans_received") == 7, 10, message="both batches")
    reply = device.request(topics.request("hub", "dashboard"), TraceRequest(job_id="j1"), timeout_s=5).body
    assert isinstance(reply, TraceReply) and reply.found
    assert len(reply.spans) == 5 and reply.dropped == 2 and reply.spans[-1].round == 1  # the latest 5 kept
    trace = json.loads(collector.chrome_trace_json("j1"))
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 5
    missing = device.request(topics.request("hub", "dashboard"), TraceRequest(job_id="nope"), timeout_s=5).body
    assert isinstance(missing, TraceReply) and not missing.found and missing.jobs == ["j1"]
    with pytest.raises(KeyError):
        collector.chrome_trace_json("nope")
    for job in ("j2", "j3"):  # at most two jobs: the least recently active goes
        device.publish(topics.spans("d0", "stage-worker"), batch(job=job, n=1))
    wait_until(lambda: collector.jobs() == ["j2", "j3"], 10, message="j1 dropped")


def test_forged_and_malformed_span_batches_are_dropped(collector_bus) -> None:  # type: ignore[no-untyped-def]
    collector, _, device, metrics = collector_bus
    # Another node's batch on this node's topic: the bus drops it (the body speaks for d9).
    device.publish(topics.spans("d0", "stage-worker"), batch(node="d9"))
    # A batch for another service than the topic's.
    device.publish(topics.spans("d0", "stage-worker"), batch(service="profiler"))
    # A batch on another node's topic.
    device.publish(topics.spans("d9", "stage-worker"), batch(node="d9"))
    device.publish(topics.spans("d0", "stage-worker"), batch(n=1))  # the genuine one, last
    wait_until(lambda: collector.jobs() == ["j1"], 10, message="the genuine batch")
    time.sleep(0.3)
    assert len(collector.spans("j1")) == 1 and metrics.counter("spans_rejected.sender") == 1
    assert metrics.counter("rejected.forged_sender") >= 2
    # A span of another node, service or job inside a genuine batch is dropped, the batch's own kept.
    collector.add(SpanBatch(node="d0", service="stage-worker", job_id="j1",
                            spans=[span(node="d1"), span(job="j2"), span(node="d0", round=5)]))
    assert [s.round for s in collector.spans("j1")] == [0, 5] and metrics.counter("spans_rejected.foreign") == 2
    with pytest.raises(ValidationError):
        span(dur=float("inf"))
    with pytest.raises(ValidationError):
        SpanBatch(node="d0", service="stage-worker", job_id="j1", spans=[span(node="d0")] * 1001)
    with pytest.raises(ValidationError):
        TraceRequest(job_id="a/b")


def test_round_schedule_is_the_latest_complete_round_beside_the_plan(collector_bus) -> None:  # type: ignore[no-untyped-def]
    collector, _, _, _ = collector_bus
    for node, r in (("d0", 0), ("d0", 1)):
        collector.add(SpanBatch(node=node, service="stage-worker", job_id="j1", spans=[
            span(node=node, round=r, start=100.0 + r), span("step", node=node, round=r, mb=None, start=100.5 + r)]))
    state = JobState(job_id="j1", status="running", model="mlp", submitted_at=0.0, updated_at=0.0)
    view = collector.round_schedule(state)
    assert view is not None and view.round == 1 and view.lanes == ("stage 0",)
    assert {b.source for b in view.bars} == {"measured"} and len(view.bars) == 2
    assert collector.round_schedule(state.model_copy(update={"job_id": "other"})) is None


def test_trace_without_a_dashboard_says_how_to_start_one(broker: Any, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "edgeswarm", "trace", "j1", "--out", str(tmp_path / "t.json"),
                             "--hub", broker.url, "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "is the dashboard service running? `edgeswarm up --local` starts it" in result.stderr
    assert not (tmp_path / "t.json").exists()
