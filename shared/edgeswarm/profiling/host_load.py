"""How busy this host's cores were while a benchmark cell was measured, from the kernel's counters (``/proc/stat``).

An emulated device stretches each computation to its slow-down times the CPU time it took (``devices.emulation``).
That holds while the devices sharing the host leave its cores room: once every core is busy all the time, each device
also waits for a core, beyond its slow-down, and the cell measures the host rather than the plan (three Xavier
NX-like devices of slow-down 2 each need half a core while they compute; on two cores, with their brokers and
messages, a pipeline of them can keep both busy). Real devices compute on their own cores. The benchmarks report
this beside each cell so that a cell at risk of measuring the host says so, measured, not guessed from the device
classes (which no prediction reads: DESIGN.md principle 7).
"""

from __future__ import annotations

import bisect
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

# From this fraction of all the host's core time busy over a cell, the emulation may not hold (see above): a device's
# compute can wait for a core. Below it the scheduler mostly finds one within a slice of a computation.
SATURATED = 0.9
SATURATED_NOTE = (f"host busy: the host's cores busy over the cell; 'saturated' (at least {SATURATED:.0%}): the "
                  "emulated devices sharing them could wait for a core beyond their slow-down, so that cell may "
                  "measure this host rather than the plan (real devices compute on their own cores)")

PROC_STAT = Path("/proc/stat")


class CpuTicks(NamedTuple):
    """The host's cumulative core time in clock ticks since boot: ``busy`` (everything but idle and waiting on I/O;
    a virtual machine's stolen time counts, since those ticks were not ours to run on) out of ``total``."""

    busy: int
    total: int


def read_cpu_ticks(path: Path = PROC_STAT) -> CpuTicks | None:
    """The host's core time so far, from the first line of ``path`` (the kernel's ``cpu`` line: user, nice, system,
    idle, iowait, irq, softirq, steal; guest time is inside user and not added again); None where it cannot be read
    (not Linux, or a line of another shape)."""
    try:
        with open(path) as f:
            fields = f.readline().split()
        if not fields or fields[0] != "cpu" or len(fields) < 9:
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError):
        return None
    total = user + nice + system + idle + iowait + irq + softirq + steal
    return CpuTicks(busy=total - idle - iowait, total=total)


def busy_fraction(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    """The fraction (0 to 1) of all cores' time that was busy between two readings; None when either is missing or
    no tick passed between them."""
    if before is None or after is None or after.total <= before.total:
        return None
    return min(1.0, max(0.0, (after.busy - before.busy) / (after.total - before.total)))


class HostLoad:
    """``with HostLoad() as load:`` around a measured window; ``load.busy`` is then the fraction of the host's core
    time busy over it (None where the counters cannot be read)."""

    def __init__(self, path: Path = PROC_STAT) -> None:
        self._path = path
        self._before: CpuTicks | None = None
        self.busy: float | None = None

    def __enter__(self) -> HostLoad:
        self._before = read_cpu_ticks(self._path)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.busy = busy_fraction(self._before, read_cpu_ticks(self._path))


class TickLog:
    """The host's counters read every ``interval_s`` seconds on a thread of its own, for windows known only after the
    fact (a round whose end and length a job reports): ``with TickLog() as ticks:``, then ``ticks.busy_between(start,
    end)`` on the ``time.monotonic`` clock. Keeps at most ``max_samples`` readings (the oldest go first)."""

    def __init__(self, interval_s: float = 0.25, path: Path = PROC_STAT, max_samples: int = 100_000) -> None:
        self._interval_s = interval_s
        self._path = path
        self._max = max_samples
        self._times: list[float] = []
        self._ticks: list[CpuTicks] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-ticks", daemon=True)

    def __enter__(self) -> TickLog:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self._interval_s + 1.0)
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        ticks = read_cpu_ticks(self._path)
        if ticks is None:
            return
        with self._lock:
            self._times.append(time.monotonic())
            self._ticks.append(ticks)
            if len(self._times) > self._max:
                del self._times[0], self._ticks[0]

    def __len__(self) -> int:
        """Readings kept."""
        with self._lock:
            return len(self._times)

    def busy_between(self, start: float, end: float) -> float | None:
        """The busy fraction from the last reading at or before ``start`` to the first at or after ``end``
        (``time.monotonic`` seconds); None where no readings bracket the window."""
        with self._lock:
            first = bisect.bisect_right(self._times, start) - 1
            last = bisect.bisect_left(self._times, end)
            if first < 0 or last >= len(self._times) or last <= first:
                return None
            return busy_fraction(self._ticks[first], self._ticks[last])


def saturated(busy: float | None) -> bool:
    """Whether a cell measured at ``busy`` (a ``HostLoad.busy``) ran with the host's cores saturated."""
    return busy is not None and busy >= SATURATED


def busy_cell(busy: float | None) -> str:
    """A table cell for ``busy``: the percentage, marked where the host was saturated."""
    if busy is None:
        return "-"
    return f"{busy:.0%}" + (" saturated" if saturated(busy) else "")


def busy_text(busy: float | None) -> str:
    """A log line's clause for ``busy``."""
    if busy is None:
        return "host load not read"
    if saturated(busy):
        return f"host {busy:.0%} busy: saturated, the emulated devices could wait for cores"
    return f"host {busy:.0%} busy"
