"""``profiling.verdict``: a benchmark's cells counted against the 15 percent goal, each miss with what the run says
of it, and each benchmark's rows made into cells."""

from __future__ import annotations

from edgeswarm.hmp.bench_hmp import HmpRun
from edgeswarm.hpp.bench_training import StrategyRun
from edgeswarm.pipeline_serve.bench_serving import ServeRun
from edgeswarm.profiling.host_load import SATURATED_NOTE
from edgeswarm.profiling.verdict import Cell, verdict, verdict_lines, why_missed
from edgeswarm.splitfed.bench_splitfed import ClusterRow


def test_cells_within_the_tolerance_count_and_misses_keep_their_order() -> None:
    cells = [Cell(name="a", ratio=1.0), Cell(name="b", ratio=1.15), Cell(name="c", ratio=0.85),
             Cell(name="d", ratio=1.16, refitted_ratio=1.02), Cell(name="e", ratio=0.5)]
    v = verdict(cells)
    assert (v.cells, v.within) == (5, 3)
    assert [m.cell.name for m in v.misses] == ["d", "e"]
    lines = verdict_lines(v, "round-time cells")
    assert lines[0] == "round-time cells: measured / predicted within 15% in 3 of 5 (60%)"
    assert lines[1].startswith("  miss: d 1.16x (1.02x of its refitted prediction: the devices ran at other speeds")
    assert lines[2] == "  miss: e 0.50x (no refitted prediction to compare with)"
    assert len(lines) == 3  # no cell ran on a saturated host: nothing to say of one
    assert verdict_lines(verdict([])) == []


def test_a_cell_on_a_saturated_host_brings_the_note_on_what_that_means() -> None:
    v = verdict([Cell(name="a", ratio=1.0, host_busy=0.95), Cell(name="b", ratio=1.0, host_busy=0.3)])
    assert v.saturated and v.within == 2
    assert verdict_lines(v)[-1] == SATURATED_NOTE


def test_a_miss_is_put_down_to_the_host_first_then_the_devices_speeds_then_nothing() -> None:
    assert "host 95% busy" in why_missed(Cell(name="x", ratio=1.4, refitted_ratio=1.01, host_busy=0.95))
    assert "other speeds than profiled" in why_missed(Cell(name="x", ratio=1.4, refitted_ratio=0.91, host_busy=0.5))
    assert "not explained" in why_missed(Cell(name="x", ratio=1.4, refitted_ratio=1.3, host_busy=0.5))
    assert "no refitted prediction" in why_missed(Cell(name="x", ratio=1.4))


def test_each_benchmarks_rows_make_their_cells() -> None:
    training = StrategyRun(env="a", strategy="hpp", predicted_round_s=2.0, measured_round_s=2.6,
                           refitted_round_s=2.5, host_busy=0.4).cell()
    assert training == Cell(name="Env A hpp", ratio=1.3, refitted_ratio=1.04, host_busy=0.4)
    assert StrategyRun(env="a", strategy="dp", error="failed").cell() is None

    serving = ServeRun(env="b", variant="planned", predicted_per_s=200.0, measured_per_s=150.0,
                       refitted_per_s=160.0, host_busy=0.93).cell()
    assert serving is not None and serving.ratio == 0.75 and serving.refitted_ratio == 150.0 / 160.0
    assert serving.name == "Env B planned" and serving.host_busy == 0.93
    assert ServeRun(env="b", variant="single", error="not serving").cell() is None

    hmp = HmpRun(section="envs", env="f", bandwidth_mbps=125, model="distilbert", layers=1, seq_len=284,
                 mode="sp", devices=["a", "b", "c"], predicted_s=0.5, latency_s=0.6, refitted_s=0.6).cell()
    assert hmp is not None and hmp.name == "Env F 125 Mbps distilbert sp on 3"
    assert abs(hmp.ratio - 1.2) < 1e-9 and hmp.refitted_ratio == 1.0

    rounds = [ClusterRow(mode="fedavg", round=0, round_s=1.5, predicted_s=1.0),
              ClusterRow(mode="fedavg", round=1, round_s=1.0, predicted_s=1.0, refitted_s=0.8),
              ClusterRow(mode="splitfed", error="no devices")]
    cells = [r.cell() for r in rounds]
    assert cells[0] == Cell(name="fedavg round 0", ratio=1.5)
    assert cells[1] is not None and cells[1].refitted_ratio == 1.25
    assert cells[2] is None
