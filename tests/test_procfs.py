"""``edgeswarm.procfs``: a process's stat and argument vector as the kernel gives them, a command name that holds
spaces and parentheses included, and None for a process that is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from edgeswarm.procfs import read_cmdline, read_stat, stat_fields


def test_a_command_name_with_parentheses_and_spaces_does_not_shift_the_fields(tmp_path: Path) -> None:
    # Fields as proc(5) numbers them: 1 pid, 2 (comm), 3 state, ..., 14 utime, 15 stime, ..., 22 starttime.
    rest = ["S", *map(str, range(4, 14)), "70", "5", *map(str, range(16, 22)), "123456", "0"]
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text(f"42 (a) b (c)) {' '.join(rest)}\n")
    (tmp_path / "42" / "cmdline").write_bytes(b"python\0-m\0edgeswarm\0service\0")
    stat = read_stat(42, tmp_path)
    assert stat is not None and (stat.state, stat.cpu_ticks, stat.start_ticks) == ("S", 75, 123456)
    assert read_cmdline(42, tmp_path) == ["python", "-m", "edgeswarm", "service"]
    assert read_stat(43, tmp_path) is None and read_cmdline(43, tmp_path) is None and stat_fields(43, tmp_path) is None
    (tmp_path / "44").mkdir()
    (tmp_path / "44" / "stat").write_text("44 (cut")  # no closing parenthesis: nothing to read
    assert stat_fields(44, tmp_path) is None and read_stat(44, tmp_path) is None


def test_a_live_process_reads_as_running_and_an_ended_one_as_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "marker-argument"])
    try:
        stat = read_stat(child.pid)
        assert stat is not None and stat.state in ("R", "S", "D") and stat.start_ticks > 0
        # Until the child has exec'd its command, its cmdline is empty or the forking parent's (a clean-clone CI run
        # read it empty).
        deadline = time.monotonic() + 10
        while (read_cmdline(child.pid) or [""])[-1] != "marker-argument" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (read_cmdline(child.pid) or [])[-1] == "marker-argument"
        own = stat_fields("self")
        assert own is not None and int(own[1]) == os.getppid()  # field 4 of proc(5): the parent's pid
    finally:
        child.kill()
        child.wait(10)
    assert read_stat(child.pid) is None and read_cmdline(child.pid) is None
