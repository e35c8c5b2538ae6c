"""``tracing.explain``: planned operations lined up with measured spans, per round or item, the largest gap first."""

from __future__ import annotations

import pytest

from edgeswarm.messages.tracing import SpanRecord
from edgeswarm.tracing.explain import OUTSIDE, explain
from edgeswarm.values.schedule import ScheduleBar

T0 = 1_700_000_000.0


def bar(lane: str, name: str, start: float, dur: float, mb: int | None = None) -> ScheduleBar:
    cat = "transfer" if lane.startswith("link") else "compute"
    return ScheduleBar(lane=lane, name=name, cat=cat, start_s=start, dur_s=dur, source="planned", micro_batch=mb)


def span(lane: str, name: str, start: float, dur: float, *, node: str = "a", rnd: int | None = None,
         mb: int | None = None, cat: str | None = None) -> SpanRecord:
    return SpanRecord(name=name, cat=cat or ("transfer" if lane.startswith("link") else "compute"), job_id="j",
                      node=node, service="stage-worker", lane=lane, round=rnd, micro_batch=mb, start=T0 + start,
                      dur_s=dur)


# Two stages, two micro-batches: forward 10 ms and backward 20 ms a micro-batch on each stage, 5 ms activations.
PLANNED = [bar("stage 0", "forward", 0.000, 0.010, 0), bar("stage 0", "forward", 0.010, 0.010, 1),
           bar("link 0→1", "activation", 0.010, 0.005, 0), bar("stage 1", "forward", 0.015, 0.010, 0),
           bar("stage 1", "backward", 0.025, 0.020, 0), bar("stage 1", "forward", 0.035, 0.010, 1),
           bar("stage 1", "backward", 0.045, 0.020, 1), bar("stage 0", "backward", 0.065, 0.020, 0),
           bar("stage 0", "backward", 0.085, 0.020, 1)]


def round_spans(r: int, backward_1: float) -> list[SpanRecord]:
    """Round ``r`` as measured: as planned, but stage 1's backward takes ``backward_1`` s and stage 0 waits for
    its gradient."""
    base = 10.0 * r
    out = []
    for mb in (0, 1):
        out += [span("stage 0", "forward", base + 0.01 * mb, 0.010, rnd=r, mb=mb, node="a"),
                span("link 0→1", "activation", base + 0.01 + 0.01 * mb, 0.005, rnd=r, mb=mb, node="a"),
                span("stage 1", "forward", base + 0.02 + 0.01 * mb, 0.010, rnd=r, mb=mb, node="b"),
                span("stage 1", "backward", base + 0.04 + backward_1 * mb, backward_1, rnd=r, mb=mb, node="b"),
                span("stage 0", "wait gradient", base + 0.02, 0.02, rnd=r, mb=mb, node="a", cat="wait"),
                span("stage 0", "backward", base + 0.2 + 0.02 * mb, 0.020, rnd=r, mb=mb, node="a")]
    return out


def test_the_slow_operation_comes_first_with_its_gap_per_round_and_per_occurrence() -> None:
    spans = round_spans(1, 0.060) + round_spans(2, 0.060)
    result = explain("j", PLANNED, spans, "round", [1, 2], predicted_s=0.105, reported_s=0.3)
    first = result.operations[0]
    assert (first.lane, first.name) == ("stage 1", "backward")
    assert first.planned_s == pytest.approx(0.040) and first.measured_s == pytest.approx(0.120)
    assert first.planned_each_s == pytest.approx(0.020) and first.measured_each_s == pytest.approx(0.060)
    assert first.gap_s == pytest.approx(0.080) and first.ratio == pytest.approx(3.0)
    by = {(op.lane, op.name): op for op in result.operations}
    # As planned: no gap. Not planned (a wait): measured only.
    assert by[("stage 0", "forward")].gap_s == pytest.approx(0.0)
    assert by[("link 0→1", "activation")].measured_s == pytest.approx(0.010)
    wait = by[("stage 0", "wait gradient")]
    assert wait.planned_each_s is None and wait.ratio is None and wait.measured_s == pytest.approx(0.04)
    # What the job measured beyond its spans: the round's messages, aggregation and checkpoint.
    outside = by[("job", OUTSIDE)]
    assert result.spans_s == pytest.approx(0.24, abs=1e-6) and outside.measured_s == pytest.approx(0.3 - 0.24, abs=1e-6)
    assert result.units == [1, 2] and result.planned_s == pytest.approx(0.105)
    assert [op.name for op in result.operations[:3]] == ["backward", OUTSIDE, "wait gradient"]
    assert [abs(op.gap_s) for op in result.operations] == sorted((abs(op.gap_s) for op in result.operations),
                                                                 reverse=True)


def test_a_replicated_stage_counts_its_busiest_device_and_units_without_spans_are_left_out() -> None:
    spans = [span("stage 0", "forward", 0.0, 0.010, rnd=1, node="a"),
             span("stage 0", "forward", 0.0, 0.030, rnd=1, node="b"),
             span("stage 0", "forward", 1.0, 0.010, rnd=7, node="a")]  # a round not asked for
    result = explain("j", [bar("stage 0", "forward", 0.0, 0.010)], spans, "round", [1, 2])
    assert result.units == [1]
    (op,) = result.operations
    assert op.measured_s == pytest.approx(0.030) and op.measured_each_s == pytest.approx(0.020)


def test_serving_items_are_grouped_by_micro_batch_and_an_operation_that_never_ran_counts_as_zero() -> None:
    planned = [bar("stage 0", "forward", 0.0, 0.002), bar("link 0→1", "activation", 0.002, 0.001),
               bar("stage 1", "forward", 0.003, 0.002)]
    spans = [span("stage 0", "forward", 0.0, 0.004, mb=0), span("stage 0", "forward", 1.0, 0.004, mb=1),
             span("stage 1", "forward", 0.01, 0.002, mb=0, node="b"),
             span("stage 1", "forward", 1.01, 0.002, mb=1, node="b")]
    result = explain("s", planned, spans, "item", [0, 1], predicted_s=0.005, reported_s=0.030)
    by = {(op.lane, op.name): op for op in result.operations}
    assert result.units == [0, 1] and by[("stage 0", "forward")].ratio == pytest.approx(2.0)
    assert by[("link 0→1", "activation")].measured_s == 0.0  # planned, never measured
    assert by[("link 0→1", "activation")].measured_each_s is None
    assert by[("job", OUTSIDE)].measured_s == pytest.approx(0.030 - 0.012, abs=1e-6)


def test_a_serving_pipeline_lines_up_only_the_items_that_filled_the_plans_micro_batch() -> None:
    """The plan prices a micro-batch of 4 samples: items of one sample (a request of one row) forward in a fraction
    of that and are left out, so the stage's forward is compared like with like; without a full item none is."""
    from edgeswarm.messages import JobState
    from edgeswarm.pipeline_serve.workload import ServePipelineWorkload
    from edgeswarm.planning.serve.types import ServePlan, ServeStagePlan
    from edgeswarm.workloads import typed_state

    plan = ServePlan(model_fingerprint="m", micro_batch_size=4, method="test", units=2, bottleneck_s=0.02,
                     throughput_per_s=200.0, latency_s=0.032, stages=[
                         ServeStagePlan(index=i, start=i, end=i + 1, device=f"d{i}", compute_s=c, transfer_in_s=t,
                                        input_bytes=0, memory_bytes=0, memory_budget_bytes=0)
                         for i, (t, c) in enumerate([(0.0, 0.01), (0.002, 0.02)])])
    state = typed_state(JobState(job_id="j", kind="serve-pipeline", status="running", model="mlp", submitted_at=1.0,
                                 updated_at=2.0, plan=plan))

    def forward(lane: str, item: int, samples: int, dur: float) -> SpanRecord:
        return span(lane, "forward", item * 1.0, dur, mb=item).model_copy(update={"samples": samples})

    work = ServePipelineWorkload()
    one = [forward("stage 0", i, 1, 0.003) for i in (0, 1, 2)] + [forward("stage 1", i, 1, 0.006) for i in (0, 1, 2)]
    full = [forward("stage 0", i, 4, 0.011) for i in (3, 4)] + [forward("stage 1", i, 4, 0.022) for i in (3, 4)]
    spans, units = work.explained_spans(state, one + full)
    assert units == [3, 4]
    result = explain("j", work.planned_schedule(state), spans, "item", units)
    by = {(op.lane, op.name): op for op in result.operations}
    assert by[("stage 0", "forward")].ratio == pytest.approx(1.1)
    assert by[("stage 1", "forward")].ratio == pytest.approx(1.1)
    assert work.explained_spans(state, one)[1] == []


def test_no_spans_gives_an_empty_explanation_without_an_outside_row() -> None:
    result = explain("j", PLANNED, [], "round", [1], reported_s=0.2)
    assert result.units == [] and result.spans_s == 0.0
    assert all(op.name != OUTSIDE and op.measured_s == 0.0 for op in result.operations)


def test_a_planned_cost_outside_every_span_lines_up_with_what_the_job_measured_beyond_its_spans() -> None:
    """A bar on lane ``job`` named ``outside spans`` (a round's fixed costs, priced) is the planned side of the
    outside row, not an operation of its own."""
    planned = [*PLANNED, ScheduleBar(lane="job", name=OUTSIDE, cat="other", start_s=0.105, dur_s=0.03,
                                     source="planned")]
    result = explain("j", planned, round_spans(1, 0.02), "round", [1], reported_s=0.30)
    outside = [op for op in result.operations if op.name == OUTSIDE]
    assert len(outside) == 1 and outside[0].planned_s == pytest.approx(0.03), outside
    assert outside[0].measured_s == pytest.approx(0.30 - result.spans_s)
    assert result.planned_s == pytest.approx(0.135)



def test_a_split_round_lines_up_its_slowest_trained_devices_compute_waits_sends_and_fixed_costs() -> None:
    """train-splitfed's plan prices each selected device's compute, its tensors' transfers and its MEC's half: the
    slowest device that trained last round is the planned one, its computes and its waits for the MEC are named as
    the plan names them, and the round's other predicted seconds line up with what no span covers."""
    from edgeswarm.messages import JobState
    from edgeswarm.planning.splitfed.types import DeviceCut, SplitSelection
    from edgeswarm.splitfed.workload import SplitfedWorkload
    from edgeswarm.workloads import typed_state

    plan = SplitSelection(selected=[
        DeviceCut(node="d0", mec="m", cut=2, round_s=1.0, memory_bytes=1, compute_s=0.3, transfer_s=0.2, mec_s=0.4),
        DeviceCut(node="d1", mec="m", cut=2, round_s=1.5, memory_bytes=1, compute_s=0.5, transfer_s=0.3, mec_s=0.5)],
        objective=1.0, t_system_s=1.5, target_cut=2, count=2, evaluations=1, solver="bo")
    def record(r: int, who: str, predicted_s: float, round_s: float) -> dict[str, object]:
        return {"round": r, "predicted_s": predicted_s, "round_s": round_s, "participants": [
            {"node": n, "mec": "m", "cut": 2, "outcome": "trained" if n == who else "not picked"}
            for n in ("d0", "d1")]}

    # Round 1 trained d1 alone: another plan's round, not lined up with the last round's schedule; rounds 2 and 3 are
    # the last plan's devices at its cuts.
    state = typed_state(JobState(job_id="j", kind="train-splitfed", status="running", model="lenet5", submitted_at=1.0,
                                 updated_at=2.0, plan=plan, progress={"rounds_done": 4, "history": [
                                     record(0, "d0", 1.05, 2.0), record(1, "d1", 1.55, 1.6),
                                     record(2, "d0", 1.1, 1.3), record(3, "d0", 1.05, 1.1)]}))
    work = SplitfedWorkload()
    planned = work.planned_schedule(state)
    by_name = {b.name: b for b in planned}
    assert by_name["compute"].dur_s == pytest.approx(0.3) and by_name["wait for the MEC"].dur_s == pytest.approx(0.6)
    assert by_name["send"].dur_s == pytest.approx(0.1) and by_name[OUTSIDE].dur_s == pytest.approx(0.15)

    def device(name: str, start: float, dur: float, r: int, lane: str = "device") -> SpanRecord:
        cat = "wait" if name.startswith("wait") else "transfer" if lane.startswith("link") else "compute"
        return SpanRecord(name=name, cat=cat, job_id="j", node="d0", service="stage-worker", lane=lane, round=r,
                          start=T0 + 10 * r + start, dur_s=dur)

    spans = [s for r in (0, 1, 2, 3) for s in (
        device("forward", 0.0, 0.1, r), device("activation", 0.1, 0.06, r, "link device→mec"),
        device("wait middle", 0.1, 0.2, r), device("tail", 0.3, 0.05, r),
        device("tail gradient", 0.35, 0.05, r, "link device→mec"), device("wait cut gradient", 0.35, 0.45, r),
        device("backward", 0.8, 0.15, r))]
    named, units = work.explained_spans(state, spans)
    assert units == [2, 3]  # round 0 builds the devices' halves
    assert work.unit_seconds(state) == (pytest.approx(1.05), pytest.approx(1.2))  # the last plan's, the rounds' mean
    result = explain("j", planned, named, "round", units, predicted_s=1.05, reported_s=1.2)
    ops = {op.name: op for op in result.operations}
    assert set(ops) == {"compute", "wait for the MEC", "send", OUTSIDE}, set(ops)
    assert ops["compute"].measured_s == pytest.approx(0.3) and ops["wait for the MEC"].measured_s == pytest.approx(0.65)
    assert ops["send"].measured_s == pytest.approx(0.11)
    assert ops[OUTSIDE].planned_s == pytest.approx(0.15) and ops[OUTSIDE].measured_s == pytest.approx(1.2 - 0.95)
    assert result.planned_s == pytest.approx(1.05)
