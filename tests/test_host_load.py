"""``profiling.host_load``: how busy the host's cores were over a benchmark cell, read from the kernel's counters."""

from __future__ import annotations

import time
from pathlib import Path

from edgeswarm.profiling.host_load import (
    SATURATED,
    CpuTicks,
    HostLoad,
    TickLog,
    busy_cell,
    busy_fraction,
    busy_text,
    read_cpu_ticks,
    saturated,
)


def _stat(path: Path, user: int, idle: int, iowait: int = 0, steal: int = 0) -> Path:
    # user nice system idle iowait irq softirq steal guest guest_nice, then a per-core line as the kernel writes it
    path.write_text(f"cpu  {user} 0 0 {idle} {iowait} 0 0 {steal} 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1 2\n")
    return path


def test_ticks_count_steal_busy_and_iowait_idle(tmp_path: Path) -> None:
    ticks = read_cpu_ticks(_stat(tmp_path / "stat", user=100, idle=300, iowait=50, steal=25))
    # guest (7) is inside user already: not added again
    assert ticks == CpuTicks(busy=125, total=475)


def test_busy_fraction_between_two_readings(tmp_path: Path) -> None:
    before = read_cpu_ticks(_stat(tmp_path / "a", user=100, idle=100))
    after = read_cpu_ticks(_stat(tmp_path / "b", user=190, idle=110))
    assert busy_fraction(before, after) == 0.9
    assert saturated(busy_fraction(before, after))
    assert busy_fraction(after, after) is None  # no tick passed
    assert busy_fraction(None, after) is None


def test_unreadable_or_foreign_counters_give_none(tmp_path: Path) -> None:
    assert read_cpu_ticks(tmp_path / "missing") is None
    (tmp_path / "odd").write_text("intr 1 2 3\n")
    assert read_cpu_ticks(tmp_path / "odd") is None
    (tmp_path / "short").write_text("cpu 1 2 3\n")
    assert read_cpu_ticks(tmp_path / "short") is None
    (tmp_path / "text").write_text("cpu a b c d e f g h\n")
    assert read_cpu_ticks(tmp_path / "text") is None
    with HostLoad(tmp_path / "missing") as load:
        pass
    assert load.busy is None and busy_cell(load.busy) == "-" and not saturated(load.busy)


def test_a_busy_window_on_this_host_reads_busy() -> None:
    """This process spinning on one core for 0.5 s keeps at least that core busy: on a host of n cores the window
    is at least about 1/n busy, whatever else runs."""
    import os

    with HostLoad() as load:
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
    cores = os.cpu_count() or 1
    assert load.busy is not None
    assert 0.8 / cores <= load.busy <= 1.0


def test_a_window_known_after_the_fact_reads_from_the_samples() -> None:
    """A round's window is known once its record arrives: the samples taken meanwhile bracket it."""
    import os

    with TickLog(interval_s=0.05) as ticks:
        start = time.monotonic()
        end = start + 0.5
        while time.monotonic() < end:
            pass
        time.sleep(0.1)  # a sample after the window's end
    cores = os.cpu_count() or 1
    busy = ticks.busy_between(start, end)
    assert busy is not None and 0.8 / cores <= busy <= 1.0
    assert ticks.busy_between(start - 60, end) is None  # before the first sample: nothing brackets it
    assert ticks.busy_between(start, end + 60) is None  # after the last


def test_the_tick_log_keeps_a_bounded_number_of_samples(tmp_path: Path) -> None:
    stat = _stat(tmp_path / "stat", user=1, idle=1)
    with TickLog(interval_s=0.01, path=stat, max_samples=5) as ticks:
        time.sleep(0.2)
    assert len(ticks) == 5


def test_cells_and_log_lines_say_when_the_host_was_saturated() -> None:
    assert busy_cell(0.42) == "42%"
    assert busy_cell(SATURATED) == "90% saturated"
    assert busy_text(0.42) == "host 42% busy"
    assert "saturated" in busy_text(0.97)
    assert busy_text(None) == "host load not read"
