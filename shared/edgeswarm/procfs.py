"""What the kernel says of a process, from ``/proc`` (proc(5)): its state, CPU time and start time, and its argument
vector. Chaos checks a pid is still the service it names before signalling it, the fork server finds its own argument
and environment areas, namespaces tell their owner and delayers from a later process that reuses the pid."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` edgeswarm reads."""

    state: str  # R, S, D, T (stopped), t, Z (zombie), X, ...
    cpu_ticks: int  # clock ticks spent in user and kernel mode (utime + stime)
    start_ticks: int  # clock ticks after boot


def stat_fields(pid: int | str, proc: Path = PROC) -> list[str] | None:
    """Fields 3 onwards of ``/proc/PID/stat`` (index 0 is field 3, the state; ``pid`` "self" for this process), or
    None when there is no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2, in parentheses) may hold spaces and parentheses: count from the last ")".
    _, paren, rest = text.rpartition(")")
    return rest.split() if paren else None


def read_stat(pid: int, proc: Path = PROC) -> ProcStat | None:
    """``/proc/PID/stat`` parsed, or None when there is no such process."""
    fields = stat_fields(pid, proc)
    if fields is None or len(fields) < 20:
        return None
    return ProcStat(state=fields[0], cpu_ticks=int(fields[11]) + int(fields[12]), start_ticks=int(fields[19]))


def read_cmdline(pid: int, proc: Path = PROC) -> list[str] | None:
    """The argument vector of ``pid``, or None when there is no such process."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]
