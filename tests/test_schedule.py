"""1F1B warm-ups, the analytic round latency and the event simulator (spec 3.2, 4.2-4.3, 4.9, AC-1/5/6, App. A)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from edgeswarm.errors import EdgeswarmError, ScheduleError
from edgeswarm.planning.hpp.render import render_plan_png
from edgeswarm.planning.hpp.schedule import (
    Operation,
    Timeline,
    analytic_latency,
    plan_timeline,
    simulate,
    stage_order,
    step_lower_bounds,
    warmup_counts,
)
from edgeswarm.planning.hpp.types import CommStepPlan, Plan, PlanOptions, StagePlan

# Spec 4.9 / Appendix A: P = 3, steps exec0, comm, exec1, comm, exec2.
WORKED_EF = [1.0, 0.5, 1.5, 0.5, 1.0]
WORKED_EB = [2.0, 0.5, 3.0, 0.5, 2.0]

# AC-6: uniform 4-stage pipeline, exec 1/2, comm 0.3/0.3, M = 16.
UNIFORM_EF = [1.0, 0.3, 1.0, 0.3, 1.0, 0.3, 1.0]
UNIFORM_EB = [2.0, 0.3, 2.0, 0.3, 2.0, 0.3, 2.0]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step_operations(timeline: Timeline, step: int) -> list[Operation]:
    """The operations of ``step`` in chronological order."""
    return [op for op in timeline.operations if op.step == step]


# --- AC-1: warm-up counts and the strict order ------------------------------------------------------


@pytest.mark.parametrize(
    ("stages", "micro_batches", "expected"),
    [
        (3, 100, [5, 3, 1]), (4, 100, [7, 5, 3, 1]), (1, 100, [1]),
        (4, 5, [5, 5, 3, 1]), (3, 5, [5, 3, 1]), (2, 1, [1, 1]),
    ],
)
def test_warmup_counts(stages: int, micro_batches: int, expected: list[int]) -> None:
    assert warmup_counts(stages, micro_batches) == expected


@pytest.mark.parametrize(("stages", "micro_batches"), [(0, 4), (3, 0), (-1, 1)])
def test_warmup_counts_rejects_empty_pipelines(stages: int, micro_batches: int) -> None:
    with pytest.raises(ScheduleError):
        warmup_counts(stages, micro_batches)


def test_stage_order_matches_figure_4() -> None:
    order = stage_order(3, 5)
    assert [f"{kind}{i}" for kind, i in order] == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4".split()


def test_stage_order_extremes() -> None:
    assert stage_order(1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    gpipe = [("F", i) for i in range(4)] + [("B", i) for i in range(4)]
    assert stage_order(4, 4) == gpipe
    assert stage_order(9, 4) == gpipe  # K is capped at M


@pytest.mark.parametrize("micro_batches", [1, 2, 3, 5, 8, 16, 32])
@pytest.mark.parametrize("warmup", [1, 2, 3, 4, 7, 11, 40])
def test_stage_order_is_a_valid_bounded_1f1b(warmup: int, micro_batches: int) -> None:
    order = stage_order(warmup, micro_batches)
    k = min(warmup, micro_batches)
    assert sorted(order) == sorted([("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)])
    assert order[:k] == [("F", i) for i in range(k)]
    position = {op: n for n, op in enumerate(order)}
    assert all(position[("B", i)] > position[("F", i)] for i in range(micro_batches))
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
        assert 0 <= live <= k
    assert peak == k


@pytest.mark.parametrize(("warmup", "micro_batches"), [(0, 4), (3, 0)])
def test_stage_order_rejects_bad_counts(warmup: int, micro_batches: int) -> None:
    with pytest.raises(ScheduleError):
        stage_order(warmup, micro_batches)


# --- the analytic step model (Eqs. 4-6, spec 4.9) ---------------------------------------------------


def test_analytic_worked_example() -> None:
    assert step_lower_bounds(WORKED_EF, WORKED_EB, 5) == pytest.approx([15, 8, 26.5, 13.5, 24.5], abs=1e-12)
    latency, dominant = analytic_latency(WORKED_EF, WORKED_EB, 5)
    assert latency == pytest.approx(26.5, abs=1e-9)
    assert dominant == 2


@pytest.mark.parametrize(
    ("allreduce", "expected"),
    [
        ([0, 0, 0.8, 0, 0], 26.5),  # spec 4.9: end(2) + 0.8 = 24.8 < 26.5, hidden
        ([0, 0, 3.0, 0, 0], 27.0),  # end(2) = 24
        ([0, 0, 0, 0, 7.0], 27.5),  # end(4) = 20.5: a late AllReduce overlaps the drain
        ([1.0, 0, 0, 0, 0], 27.5),  # end(0) = 26.5: nothing to overlap with
    ],
)
def test_analytic_allreduce_adds_per_step(allreduce: list[float], expected: float) -> None:
    latency, dominant = analytic_latency(WORKED_EF, WORKED_EB, 5, allreduce)
    assert latency == pytest.approx(expected, abs=1e-9)
    assert dominant == 2


def test_analytic_single_stage_is_serial() -> None:
    assert analytic_latency([0.25], [0.5], 8) == (pytest.approx(6.0), 0)


def test_analytic_dominant_step_is_first_on_ties() -> None:
    _, dominant = analytic_latency([1.0, 0.0, 1.0], [1.0, 0.0, 1.0], 1)
    assert dominant == 2  # V = [2, 2, 4]
    _, dominant = analytic_latency([1.0, 0.0, 0.0], [1.0, 0.0, 0.0], 1)
    assert dominant == 0  # V = [2, 2, 2]


# --- the event simulator (Appendix A) ---------------------------------------------------------------


def test_simulate_worked_example() -> None:
    timeline = simulate(WORKED_EF, WORKED_EB, 5)
    assert timeline.makespan_s == pytest.approx(27.5, abs=1e-9)
    assert timeline.warmups == (5, 3, 1)
    assert timeline.peak_live == (5, 3, 1)
    assert timeline.steps == 5 and timeline.stages == 3 and timeline.micro_batches == 5
    _check_timeline(timeline, WORKED_EF, WORKED_EB)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (lambda big_p, p: 2 * (big_p - p) - 1, 58.8),
        (lambda big_p, p: 2 * (big_p - p), 58.8),
        (lambda big_p, p: 2 * (big_p - p) + 1, 58.8),
        (lambda big_p, p: big_p - p, 65.4),
    ],
    ids=["ours 2(P-p)-1", "a 2(P-p)", "c 2(P-p)+1", "b P-p"],
)
def test_ac6_warmup_policies(policy: object, expected: float) -> None:
    warmups = [policy(4, p) for p in range(4)]  # type: ignore[operator]
    timeline = simulate(UNIFORM_EF, UNIFORM_EB, 16, warmups)
    assert timeline.makespan_s == pytest.approx(expected, abs=1e-9)
    assert list(timeline.peak_live) == [min(k, 16) for k in warmups]
    _check_timeline(timeline, UNIFORM_EF, UNIFORM_EB)


def test_ac6_ours_equals_analytic_and_p_minus_p_is_slower() -> None:
    ours = simulate(UNIFORM_EF, UNIFORM_EB, 16).makespan_s
    classic = simulate(UNIFORM_EF, UNIFORM_EB, 16, [4, 3, 2, 1]).makespan_s
    assert ours == pytest.approx(analytic_latency(UNIFORM_EF, UNIFORM_EB, 16)[0], abs=1e-9)
    assert classic >= 1.05 * ours


def test_peak_live_equals_effective_warmup_when_m_is_small() -> None:
    timeline = simulate(UNIFORM_EF, UNIFORM_EB, 5)
    assert timeline.warmups == (5, 5, 3, 1)
    assert timeline.peak_live == (5, 5, 3, 1)


def test_comm_ties_send_the_backward_first() -> None:
    # Hand-traced: at t=5 the link holds F2 (waiting since 3) and B0 (arrived at 5); Appendix A starts B0 first.
    # Sending F2 first would finish at 11; the rule as written gives 12.
    timeline = simulate([1.0, 2.0, 1.0], [1.0, 1.0, 1.0], 3)
    link = [(op.kind, op.micro_batch, op.start_s, op.end_s) for op in step_operations(timeline, 1)]
    assert link == [
        ("F", 0, 1.0, 3.0), ("F", 1, 3.0, 5.0), ("B", 0, 5.0, 6.0), ("F", 2, 6.0, 8.0), ("B", 1, 8.0, 9.0),
        ("B", 2, 10.0, 11.0),
    ]
    assert timeline.makespan_s == 12.0


def test_simulate_single_stage() -> None:
    timeline = simulate([0.25], [0.5], 8)
    assert timeline.warmups == (1,) and timeline.peak_live == (1,)
    assert timeline.makespan_s == pytest.approx(6.0)
    assert [(op.kind, op.micro_batch) for op in timeline.operations] == stage_order(1, 8)


def test_simulate_allreduce_runs_after_the_last_backward() -> None:
    timeline = simulate(WORKED_EF, WORKED_EB, 5, allreduce_s=[0, 0, 0.8, 0, 0])
    (allreduce,) = [op for op in timeline.operations if op.kind == "AR"]
    last_backward = max(op.end_s for op in step_operations(timeline, 2) if op.kind == "B")
    assert allreduce.step == 2 and allreduce.micro_batch is None
    assert allreduce.start_s == last_backward and allreduce.duration_s == pytest.approx(0.8)
    assert timeline.makespan_s == pytest.approx(27.5)  # hidden behind stage 0's drain, as in the analytic model

    late = simulate(WORKED_EF, WORKED_EB, 5, allreduce_s=[1.0, 0, 0, 0, 0])
    assert late.makespan_s == pytest.approx(28.5)
    _check_timeline(late, WORKED_EF, WORKED_EB)


def test_deadlocking_warmups_are_reported() -> None:
    # Stage 1 wants F0..F2 before its first backward, but stage 0 (K=1) sends F1 only after B0 comes back.
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([1.0, 0.1, 1.0], [1.0, 0.1, 1.0], 4, [1, 3])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"forward_s": [1.0, 1.0], "backward_s": [1.0, 1.0], "micro_batches": 2},
        {"forward_s": [], "backward_s": [], "micro_batches": 2},
        {"forward_s": [1.0], "backward_s": [1.0, 1.0], "micro_batches": 2},
        {"forward_s": [1.0], "backward_s": [-1.0], "micro_batches": 2},
        {"forward_s": [float("nan")], "backward_s": [1.0], "micro_batches": 2},
        {"forward_s": [1.0], "backward_s": [1.0], "micro_batches": 0},
        {"forward_s": [1.0, 1.0, 1.0], "backward_s": [1.0] * 3, "micro_batches": 2, "allreduce_s": [0, 0.5, 0]},
        {"forward_s": [1.0, 1.0, 1.0], "backward_s": [1.0] * 3, "micro_batches": 2, "allreduce_s": [0, 0]},
    ],
)
def test_malformed_steps_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ScheduleError):
        simulate(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError):
        analytic_latency(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("warmups", [[3], [3, 1, 1], [0, 1]])
def test_bad_warmups_are_rejected(warmups: list[int]) -> None:
    with pytest.raises(ScheduleError):
        simulate([1.0, 0.1, 1.0], [1.0, 0.1, 1.0], 4, warmups)


def test_schedule_error_is_an_edgeswarm_value_error() -> None:
    assert issubclass(ScheduleError, EdgeswarmError) and issubclass(ScheduleError, ValueError)


# --- AC-5: fidelity of the analytic model ------------------------------------------------------------


def _ac5_instance(rng: random.Random) -> tuple[list[float], list[float], int]:
    stages = rng.randint(2, 4)
    micro_batches = rng.choice([4, 8, 16])
    forward = [rng.uniform(0.2, 2.0) for _ in range(2 * stages - 1)]
    backward = [
        2 * f * rng.uniform(0.8, 1.2) if s % 2 == 0 else f * rng.uniform(0.9, 1.1) for s, f in enumerate(forward)
    ]
    return forward, backward, micro_batches


def test_ac5_simulation_never_beats_the_analytic_estimate() -> None:
    rng = random.Random(20240611)
    gaps: list[float] = []
    for _ in range(400):
        forward, backward, micro_batches = _ac5_instance(rng)
        analytic, _ = analytic_latency(forward, backward, micro_batches)
        timeline = simulate(forward, backward, micro_batches)
        assert timeline.makespan_s >= analytic - 1e-9
        assert list(timeline.peak_live) == warmup_counts(len(timeline.warmups), micro_batches)
        gaps.append(timeline.makespan_s / analytic - 1)
    # Measured with this seed: median 0.28%, mean 2.67%, max 29.4% (spec [O]: 1.0% / 3.2% / 20% on its own draw;
    # about half the instances have no gap at all, so the median of 400 moves a lot between seeds).
    assert statistics.median(gaps) <= 0.02
    assert statistics.mean(gaps) <= 0.05


def test_simulated_timelines_respect_dependencies_on_random_pipelines() -> None:
    rng = random.Random(7)
    for _ in range(60):
        stages = rng.randint(1, 4)
        steps = 2 * stages - 1
        # Coarse values make exact ties frequent, which is where tie-breaking bugs would hide.
        forward = [rng.choice([0.0, 0.1, 0.3, 1.0]) for _ in range(steps)]
        backward = [rng.choice([0.1, 0.3, 0.6, 2.0]) for _ in range(steps)]
        micro_batches = rng.choice([1, 2, 3, 8])
        warmups = [k + rng.randint(0, 2) for k in warmup_counts(stages, micro_batches)]
        timeline = simulate(forward, backward, micro_batches, warmups)
        _check_timeline(timeline, forward, backward)
        assert timeline.makespan_s >= analytic_latency(forward, backward, micro_batches)[0] - 1e-9


def _check_timeline(timeline: Timeline, forward: list[float], backward: list[float]) -> None:
    """Every operation once, durations, server exclusivity, strict order on exec steps, Appendix A readiness."""
    steps, m = timeline.steps, timeline.micro_batches
    ends: dict[tuple[int, str, int], float] = {}
    for step in range(steps):
        ops = [op for op in step_operations(timeline, step) if op.kind != "AR"]
        assert sorted((op.kind, op.micro_batch) for op in ops) == sorted(
            [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        )
        for before, after in zip(ops, ops[1:], strict=False):
            assert after.start_s >= before.end_s - 1e-12
        if step % 2 == 0:
            assert [(op.kind, op.micro_batch) for op in ops] == stage_order(timeline.warmups[step // 2], m)
        for op in ops:
            expected = forward[step] if op.kind == "F" else backward[step]
            assert op.duration_s == pytest.approx(expected, abs=1e-12)
            assert op.micro_batch is not None
            ends[(step, op.kind, op.micro_batch)] = op.end_s
    for op in timeline.operations:
        if op.kind == "F" and op.step > 0:
            assert op.start_s >= ends[(op.step - 1, "F", op.micro_batch)] - 1e-12  # type: ignore[index]
        if op.kind == "B":
            source = (op.step, "F", op.micro_batch) if op.step == steps - 1 else (op.step + 1, "B", op.micro_batch)
            assert op.start_s >= ends[source] - 1e-12  # type: ignore[index]
    assert timeline.makespan_s == max(op.end_s for op in timeline.operations)


# --- Plans: simulation and rendering ------------------------------------------------------------------


def _three_stage_plan(micro_batches: int = 6) -> Plan:
    """A hand-built plan: stage 0 on two devices, stage 1 on three, stage 2 on one."""
    layout = [
        (["nx-a", "nx-b"], [20, 12], 0.10, 0.20, 0.4),
        (["tx2-a", "tx2-b", "nano-a"], [12, 12, 8], 0.15, 0.30, 0.6),
        (["nano-b"], [32], 0.08, 0.16, 0.0),
    ]
    warmups = warmup_counts(3, micro_batches)
    stages = [
        StagePlan(
            index=p, start=4 * p, end=4 * p + 4, devices=devices, shares=shares,
            warmup=k, forward_s=ef, backward_s=eb, allreduce_s=ar,
            memory_bytes=[(1 + p) * 600_000_000] * len(devices), memory_budget_bytes=[4 * 2**30] * len(devices),
        )
        for p, ((devices, shares, ef, eb, ar), k) in enumerate(zip(layout, warmups, strict=True))
    ]
    links = [
        CommStepPlan(after=p, bytes_per_microbatch=800_000, bandwidth_bps=100e6, forward_s=0.064, backward_s=0.064)
        for p in range(2)
    ]
    ef = [0.10, 0.064, 0.15, 0.064, 0.08]
    eb = [0.20, 0.064, 0.30, 0.064, 0.16]
    latency, dominant = analytic_latency(ef, eb, micro_batches, [0.4, 0, 0.6, 0, 0])
    return Plan(
        strategy="hpp", model_fingerprint="test-mlp", units=12,
        options=PlanOptions(micro_batch_size=32, micro_batches=micro_batches),
        stages=stages, comm_steps=links, dominant_step=dominant, round_latency_s=latency,
        throughput_sps=32 * micro_batches / latency,
    )


def test_plan_timeline_simulates_the_plans_steps() -> None:
    plan = _three_stage_plan()
    timeline = plan_timeline(plan)
    ef, eb, ta = plan.step_times()
    assert timeline == simulate(ef, eb, 6, [5, 3, 1], ta)
    assert [op.step for op in timeline.operations if op.kind == "AR"] == [0, 2]
    assert timeline.makespan_s >= plan.round_latency_s - 1e-9
    _check_timeline(timeline, ef, eb)


@pytest.mark.parametrize("micro_batches", [6, 32])
def test_render_plan_png_writes_a_png_without_a_window(tmp_path: Path, micro_batches: int) -> None:
    import matplotlib
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend()
    figures = plt.get_fignums()
    path = tmp_path / "plan.png"
    render_plan_png(_three_stage_plan(micro_batches), path, title="three stages")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000
    assert plt.get_fignums() == figures  # nothing registered with pyplot, so no window could open
    assert matplotlib.get_backend() == backend
    image = plt.imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 1000


def test_render_plan_png_draws_a_measured_round_under_the_planned_one(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    from edgeswarm.planning.hpp.render import MeasuredRound
    from edgeswarm.tracing.schedule import timeline_bars

    plan = _three_stage_plan()
    # The plan's own simulated round, stretched by half, stands in for a measured one.
    bars = tuple(b.model_copy(update={"source": "measured", "start_s": 1.5 * b.start_s, "dur_s": 1.5 * b.dur_s})
                 for b in timeline_bars(plan_timeline(plan)))
    planned_only, both = tmp_path / "planned.png", tmp_path / "both.png"
    render_plan_png(plan, planned_only, measured_note="no measured round: the dashboard service did not answer")
    render_plan_png(plan, both, measured=MeasuredRound(round=3, bars=bars))
    assert both.read_bytes().startswith(PNG_SIGNATURE)
    assert plt.imread(both).shape[0] > plt.imread(planned_only).shape[0]  # a third panel below the planned one
