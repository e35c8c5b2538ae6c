"""A node's wall clock, skewed for its processes: the clock-skew fault.

Linux cannot give one process another CLOCK_REALTIME: time namespaces shift only CLOCK_MONOTONIC and
CLOCK_BOOTTIME, and setting the real clock moves every process on the machine. libfaketime (Debian's ``faketime``
package) can: preloaded into a process (LD_PRELOAD), it answers ``clock_gettime``, ``gettimeofday``, ``time`` and
``stat`` with the real time plus an offset it reads from a file, again every ``refresh_s`` seconds, so the skew of a
running node changes without a restart. Every process the node starts inherits the preload, so a node's services
and their children share one skewed clock.

What it costs (measured on this project's 2-core CI machine, Python 3.11): nothing measurable at start (``python
-c pass`` about 26 ms, importing torch about 1.5 s, both with and without it); ``time.time()`` 0.11 to 0.38 us
instead of 0.08 to 0.23 us with the default one-second refresh, 5 to 13 us with ``refresh_s=0`` (the file is read
on every call); ``time.monotonic()`` about 10 ns more (libfaketime intercepts the call and passes it through).

Monotonic time is left alone (FAKETIME_DONT_FAKE_MONOTONIC): timeouts, heartbeats' intervals and ``time.sleep``
keep real durations, as on a machine whose wall clock is merely wrong. Without that setting libfaketime shifts
CLOCK_MONOTONIC too, and a skew changed live would make every monotonic deadline jump.

Python's ``time.sleep`` is the one call that breaks under it (libfaketime's ``clock_nanosleep`` answers EINVAL when
monotonic time is left real): ``keep_sleep_working()``, run first by ``edgeswarm service``, makes it a condition
wait in a skewed process.

Limits: a statically linked program, or one that reads the clock through the vDSO or raw system calls without libc
(Go's runtime), is not skewed; a set-uid program ignores LD_PRELOAD.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from edgeswarm.errors import ConfigError
from edgeswarm.netns.host import NetnsUnavailableError

LIBRARY_NAME = "libfaketime.so.1"
# Where Debian/Ubuntu (multiarch), other distributions and a source build put the library.
SEARCH_DIRS: tuple[Path, ...] = (
    *sorted(Path("/usr/lib").glob("*-linux-gnu*/faketime")),
    Path("/usr/lib/faketime"),
    Path("/usr/lib64/faketime"),
    Path("/usr/local/lib/faketime"),
    Path("/usr/local/lib"),
)
DEFAULT_REFRESH_S = 1
# libfaketime's own multipliers go to years; a float of seconds covers any skew that matters and stays exact to the
# microsecond up to about 285 years.
MAX_SKEW_S = 100 * 365 * 86400.0


class ClockSkewUnavailableError(NetnsUnavailableError):
    """libfaketime is not installed: the message says how to install it."""


def find_libfaketime(search: Sequence[Path] = SEARCH_DIRS) -> Path:
    """The libfaketime preload library, from the first of ``search`` that has it. Raises ClockSkewUnavailableError
    naming the package to install."""
    for folder in search:
        candidate = folder / LIBRARY_NAME
        if candidate.is_file():
            return candidate
    raise ClockSkewUnavailableError(
        f"cannot skew a node's clock: {LIBRARY_NAME} (libfaketime) not found in "
        f"{', '.join(str(f) for f in search) or 'no folder'} (apt-get install -y faketime)")


def _format_skew(seconds: float) -> str:
    if not math.isfinite(seconds) or abs(seconds) > MAX_SKEW_S:
        raise ConfigError(f"clock skew {seconds!r} s is not a finite number within +-{MAX_SKEW_S:.0f} s")
    # Always signed: libfaketime reads an offset only with a leading + or -, and an absolute date otherwise. A '.'
    # for the fraction: the processes skewed here run in the C numeric locale (Python never sets LC_NUMERIC).
    return f"{seconds:+.6f}"


def set_skew(clock_file: Path, seconds: float) -> None:
    """Make every process started with ``skewable_env(clock_file)`` see the wall clock ``seconds`` ahead of the real
    one (behind when negative), from its next refresh on (at most ``refresh_s`` later). The file is replaced whole,
    so a process never reads half of it."""
    text = _format_skew(seconds) + "\n"
    clock_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{clock_file.name}.", dir=clock_file.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, clock_file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def skewable_env(clock_file: Path, *, refresh_s: int = DEFAULT_REFRESH_S,
                 search: Sequence[Path] = SEARCH_DIRS) -> dict[str, str]:
    """The environment variables that start a process (and its children) with a wall clock ``set_skew`` can move
    while it runs; merge them into the process's environment (LD_PRELOAD is replaced, not appended to).

    ``refresh_s``: how often, in whole seconds, a process re-reads the skew; 0 reads it on every clock call (5 to
    13 us each instead of 0.4 us). ``clock_file`` is created with no skew when missing: without it libfaketime would
    fall back to ~/.faketimerc or /etc/faketimerc. Raises ClockSkewUnavailableError when libfaketime is not
    installed.
    """
    if refresh_s < 0:
        raise ConfigError(f"refresh_s must be 0 or more, not {refresh_s}")
    library = find_libfaketime(search)
    clock_file = clock_file.resolve()
    if not clock_file.exists():
        set_skew(clock_file, 0.0)
    env = {
        "LD_PRELOAD": str(library),
        "FAKETIME_TIMESTAMP_FILE": str(clock_file),
        # Only the wall clock: monotonic deadlines keep real durations (see the module's docstring).
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    if refresh_s == 0:
        env["FAKETIME_NO_CACHE"] = "1"
    else:
        env["FAKETIME_CACHE_DURATION"] = str(refresh_s)
    return env


def _event_sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    threading.Event().wait(seconds)


def keep_sleep_working() -> bool:
    """In a process whose clock is skewed (``skewable_env``), make ``time.sleep`` a condition wait, and return True.

    libfaketime 0.9.10's ``clock_nanosleep`` fails with EINVAL when the monotonic clock is left real: Python sleeps
    on an absolute CLOCK_MONOTONIC deadline, which the library mistranslates. Condition waits, ``select`` and lock
    timeouts are not affected (measured), so a sleep through ``threading.Event.wait`` lasts as long as asked."""
    if "FAKETIME_TIMESTAMP_FILE" not in os.environ or LIBRARY_NAME not in os.environ.get("LD_PRELOAD", ""):
        return False
    time.sleep = _event_sleep
    return True
