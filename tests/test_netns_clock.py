"""The clock-skew fault: processes started with edgeswarm.netns.clock's environment see the wall clock moved by the
skew set in their clock file, changed while they run, with monotonic time untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeswarm.errors import ConfigError
from edgeswarm.netns.clock import (
    ClockSkewUnavailableError,
    find_libfaketime,
    set_skew,
    skewable_env,
)
from helpers import wait_until

# A child's answer travels through a pipe and a loaded 2-core machine: the skew it reports is right to this much.
TOLERANCE_S = 0.5
REFRESH_S = 1


def read_skew(clock_file: Path) -> float:
    """The skew ``clock_file`` holds now, in seconds (0 when the file is missing)."""
    return float(clock_file.read_text()) if clock_file.exists() else 0.0


# Answers every line on stdin with its wall and monotonic clocks, so the parent can compare them with its own.
CLOCK_REPORTER = """
import json, sys, time
{setup}
print(json.dumps({{"ready": True, **{extra}}}), flush=True)
for _ in sys.stdin:
    print(json.dumps({{"wall": time.time(), "mono": time.monotonic()}}), flush=True)
"""


@pytest.fixture(scope="module")
def libfaketime() -> Path:
    try:
        return find_libfaketime()
    except ClockSkewUnavailableError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc} (.ci/run installs it)")
        pytest.skip(str(exc))


class Reporter:
    """A ``python -c`` child with a skewable clock, asked for its clocks on demand."""

    def __init__(self, clock_file: Path, setup: str = "", extra: str = "{}") -> None:
        env = {**os.environ, **skewable_env(clock_file, refresh_s=REFRESH_S)}
        self.proc = subprocess.Popen([sys.executable, "-c", CLOCK_REPORTER.format(setup=setup, extra=extra)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        self.started = json.loads(self.proc.stdout.readline() or "{}")
        assert self.started.get("ready"), f"the child did not start (exit {self.proc.poll()})"

    def offsets(self) -> tuple[float, float]:
        """(wall, monotonic) of the child minus the parent's, the parent's read halfway through the exchange."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        wall0, mono0 = time.time(), time.monotonic()
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        wall1, mono1 = time.time(), time.monotonic()
        return answer["wall"] - (wall0 + wall1) / 2, answer["mono"] - (mono0 + mono1) / 2

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def reporters() -> Iterator[list[Reporter]]:
    started: list[Reporter] = []
    try:
        yield started
    finally:
        for reporter in started:
            reporter.stop()


def wait_for_skew(reporter: Reporter, skew_s: float) -> tuple[float, float]:
    """Wait (bounded: the refresh interval and some) until the child's wall clock is ``skew_s`` ahead."""
    seen: list[tuple[float, float]] = []

    def close() -> bool:
        seen.append(reporter.offsets())
        return abs(seen[-1][0] - skew_s) < TOLERANCE_S

    wait_until(close, REFRESH_S + 10, interval_s=0.1, message=f"a skew of {skew_s} s (last seen: {seen[-1:]})")
    return seen[-1]


def test_skew_moves_a_running_process_wall_clock_only(libfaketime: Path, tmp_path: Path,
                                                      reporters: list[Reporter]) -> None:
    clock = tmp_path / "node-a.clock"
    set_skew(clock, 30.0)
    reporter = Reporter(clock)
    reporters.append(reporter)
    wall, mono = wait_for_skew(reporter, 30.0)
    assert abs(mono) < TOLERANCE_S, "monotonic time is not skewed"
    pid = reporter.proc.pid

    # Changed live: the same process follows, behind the real clock now, then back to none.
    for skew in (-7.5, 3600.25, 0.0):
        set_skew(clock, skew)
        wall, mono = wait_for_skew(reporter, skew)
        assert abs(mono) < TOLERANCE_S
        assert reporter.proc.pid == pid and reporter.proc.poll() is None
    assert read_skew(clock) == 0.0

    # A process started without the environment keeps the real clock meanwhile.
    set_skew(clock, 60.0)
    wait_for_skew(reporter, 60.0)
    before = time.time()
    plain = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], capture_output=True, text=True,
                           check=True, timeout=60)
    assert before - TOLERANCE_S < float(plain.stdout) < time.time() + TOLERANCE_S


def test_skewed_child_with_torch_and_its_children(libfaketime: Path, tmp_path: Path,
                                                  reporters: list[Reporter]) -> None:
    # torch loads many shared libraries and starts threads: it must import and compute under the preload. A child's
    # own child (a service's subprocess) inherits the skew.
    clock = tmp_path / "node-b.clock"
    set_skew(clock, -120.0)
    setup = ("import subprocess, torch\n"
             "total = float(torch.ones(3, 4).sum())\n"
             "grandchild = float(subprocess.run([sys.executable, '-c', 'import time; print(time.time())'], "
             "capture_output=True, text=True, check=True).stdout) - time.time()\n")
    reporter = Reporter(clock, setup=setup, extra='{"total": total, "grandchild": grandchild}')
    reporters.append(reporter)
    assert reporter.started["total"] == 12.0
    assert abs(reporter.started["grandchild"]) < 5, "the grandchild shares the child's skewed clock"
    wall, mono = wait_for_skew(reporter, -120.0)
    assert abs(mono) < TOLERANCE_S
    set_skew(clock, 45.0)
    wait_for_skew(reporter, 45.0)

    # A second node's clock is its own.
    other = tmp_path / "node-c.clock"
    set_skew(other, 5.0)
    second = Reporter(other)
    reporters.append(second)
    wait_for_skew(second, 5.0)
    wait_for_skew(reporter, 45.0)


def test_clock_file_and_errors(tmp_path: Path) -> None:
    clock = tmp_path / "sub" / "n.clock"
    assert read_skew(clock) == 0.0
    set_skew(clock, -1.5)
    assert clock.read_text() == "-1.500000\n" and read_skew(clock) == -1.5
    set_skew(clock, 2)
    assert clock.read_text() == "+2.000000\n", "always signed: libfaketime reads an unsigned value as a date"
    assert [p.name for p in clock.parent.iterdir()] == ["n.clock"], "no temporary file left behind"
    for bad in (float("nan"), float("inf"), 1e12):
        with pytest.raises(ConfigError, match="clock skew"):
            set_skew(clock, bad)
    with pytest.raises(ClockSkewUnavailableError, match="apt-get install -y faketime"):
        skewable_env(tmp_path / "x.clock", search=[tmp_path])
    with pytest.raises(ConfigError, match="refresh_s"):
        skewable_env(tmp_path / "x.clock", refresh_s=-1, search=[tmp_path])


def test_skewable_env_contents(libfaketime: Path, tmp_path: Path) -> None:
    clock = tmp_path / "fresh.clock"
    env = skewable_env(clock)
    assert env["LD_PRELOAD"] == str(libfaketime)
    assert env["FAKETIME_TIMESTAMP_FILE"] == str(clock.resolve())
    assert env["FAKETIME_DONT_FAKE_MONOTONIC"] == "1" and env["FAKETIME_CACHE_DURATION"] == "1"
    assert read_skew(clock) == 0.0, "created with no skew, so libfaketime never falls back to /etc/faketimerc"
    set_skew(clock, 9.0)
    skewable_env(clock)
    assert read_skew(clock) == 9.0, "an existing skew is kept"
    assert skewable_env(clock, refresh_s=0)["FAKETIME_NO_CACHE"] == "1"
