"""``edgeswarm chaos kill|stop|cont|slow NODE``: fault injection on a local cluster.

A device that loses power, hangs or runs slow is emulated by signalling the processes of the node's
services on this machine:

* ``kill``: SIGKILL, as a power cut (the broker publishes each service's Last Will);
* ``stop``: SIGSTOP, a hung device that is alive but silent (its services turn *suspect*), optionally
  resumed after ``--for`` seconds; ``cont``: SIGCONT;
* ``slow``: duty-cycled SIGSTOP/SIGCONT, so the node gets ``1/F`` of the CPU time it would otherwise get
  for ``--for`` seconds, then is left running.

The processes are found in the cluster view (``edgeswarm.cluster_view``, the same one ``edgeswarm status``
reads), which carries every service instance's host and pid; no new wire message is involved.

Safety contract: a process is signalled only when all of these hold, checked right before signalling:

* the view's ``host`` of the instance is this machine's ``socket.gethostname()``;
* the pid is not ours, not our parent's, and greater than 1;
* ``/proc/PID`` exists, is not a zombie, and its command line contains ``edgeswarm`` and the service's
  name (a recycled pid, or a pid of another pid namespace on the same host, is never hit);
* the process started no later than the instance says it started (plus a few seconds' slack), which a
  recycled pid cannot satisfy.

Once verified, a process is held through a pidfd where the kernel offers one, so later signals (every
cycle of ``slow``) reach exactly that process even if it died and its pid was reused.

The node that runs the coordinator (the hub) is refused unless ``--service`` names what to signal.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeswarm.cli.console import console, err_console
from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.procfs import PROC, ProcStat, read_cmdline, read_stat

if TYPE_CHECKING:
    from edgeswarm.messages import ClusterView

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"
DEFAULT_PERIOD_S = 0.1  # the duty cycle of ``slow``: one SIGSTOP/SIGCONT pair per period
MIN_PERIOD_S = 0.01  # shorter periods are mostly signal overhead and scheduler noise
START_SLACK_S = 10.0  # how much later than its ``started_at`` a process may have started (clock granularity)
KILL_CONFIRM_S = 2.0  # how long ``kill`` waits to see the processes gone before it reports


class ChaosRefused(EdgeswarmError):
    """The command will not signal anything: unknown node or service, another host, the coordinator, no
    live process. The message says why and what would be accepted. Exit status 1."""


@dataclass(frozen=True)
class Target:
    """One service instance of the view that a chaos command is aimed at."""

    node: str
    service: str
    instance: str
    host: str
    pid: int
    started_at: float  # Unix seconds, as the instance reported it
    state: str  # online, suspect or offline, as the view saw it

    @property
    def label(self) -> str:
        return f"{self.node}/{self.service} (pid {self.pid})"


# --- choosing targets from the view (pure) ----------------------------------------------------------


def select_targets(view: ClusterView, node: str, services: Sequence[str] | None, *, hostname: str,
                   never: frozenset[int] = frozenset()) -> tuple[list[Target], list[str]]:
    """The instances of ``node`` (only ``services`` when given) that may be signalled, and notes on those
    left out (pid not known yet, or a pid in ``never``).

    Raises ChaosRefused for an unknown node (naming the known ones), an unknown service on the node
    (naming its services), a node running the coordinator when ``services`` is empty, an instance on a
    host other than ``hostname``, or nothing left to signal.
    """
    nv = view.node(node)
    if nv is None:
        known = ", ".join(n.node for n in view.nodes) or "none (is a cluster running at this hub?)"
        raise ChaosRefused(f"unknown node {node!r}; known nodes: {known}")
    on_node = sorted({s.service for s in nv.services})
    if services:
        missing = sorted(set(services) - set(on_node))
        if missing:
            raise ChaosRefused(f"node {node} runs no {', '.join(missing)}; its services: {', '.join(on_node)}")
        chosen = [s for s in nv.services if s.service in services]
    else:
        if COORDINATOR in on_node:
            raise ChaosRefused(f"node {node} runs the coordinator, which chaos only signals when asked by name: "
                               f"pass --service (one of {', '.join(on_node)}), e.g. --service {COORDINATOR}")
        chosen = list(nv.services)
    notes: list[str] = []
    targets: list[Target] = []
    for s in chosen:
        if s.pid <= 1 or s.host == "unknown":
            notes.append(f"{node}/{s.service} instance {s.instance}: no status seen yet, so no pid; left alone")
            continue
        if s.host != hostname:
            raise ChaosRefused(f"chaos works on a local cluster only: {node} runs on host {s.host} "
                               f"(this is {hostname})")
        if s.pid in never:
            notes.append(f"{node}/{s.service}: pid {s.pid} is this command or its parent; left alone")
            continue
        targets.append(Target(node=node, service=s.service, instance=s.instance, host=s.host, pid=s.pid,
                              started_at=s.started_at, state=s.state))
    if not targets:
        raise ChaosRefused(f"nothing to signal on node {node}: " + ("; ".join(notes) or "it has no services"))
    return targets, notes


# --- verifying and holding processes ----------------------------------------------------------------


def boot_time(proc: Path = PROC) -> float:
    """Unix seconds of this machine's boot (``btime`` of ``/proc/stat``)."""
    for line in (proc / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise EdgeswarmError("no btime in /proc/stat")


def check_process(target: Target, proc: Path = PROC) -> tuple[ProcStat | None, str | None]:
    """Whether ``target.pid`` is still the process the view describes: (its stat, None) when it is, else
    (stat or None, why it must not be signalled)."""
    st = read_stat(target.pid, proc)
    if st is None:
        return None, "not running"
    if st.state in ("Z", "X"):
        return st, "already exited"
    argv = read_cmdline(target.pid, proc)
    if argv is None:
        return None, "not running"
    if "edgeswarm" not in " ".join(argv) or target.service not in argv:
        return st, (f"pid {target.pid} is now {' '.join(argv)[:120]!r}, not edgeswarm's {target.service} "
                    "(a recycled pid, or another pid namespace); not signalled")
    started = boot_time(proc) + st.start_ticks / os.sysconf("SC_CLK_TCK")
    if started > target.started_at + START_SLACK_S:
        return st, (f"pid {target.pid} started {started - target.started_at:.0f} s after {target.service} "
                    "did: a recycled pid; not signalled")
    return st, None


@dataclass
class Held:
    """A verified process, held by a pidfd where available so signals never reach a recycled pid."""

    target: Target
    start_ticks: int
    pidfd: int | None = None
    gone: bool = field(default=False)

    def send(self, sig: int) -> bool:
        """Send ``sig``; False (and ``gone`` set) when the process no longer exists."""
        if self.gone:
            return False
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:
                st = read_stat(self.target.pid)
                if st is None or st.start_ticks != self.start_ticks or st.state in ("Z", "X"):
                    raise ProcessLookupError(self.target.pid)
                os.kill(self.target.pid, sig)
        except ProcessLookupError:
            log.info("%s is gone", self.target.label)
            self.gone = True
            return False
        log.debug("%s sent to %s", signal.Signals(sig).name, self.target.label)
        return True

    def stat(self) -> ProcStat | None:
        """The process's current stat; None once it is gone (or its pid belongs to another process)."""
        st = read_stat(self.target.pid)
        if st is None or st.start_ticks != self.start_ticks:
            return None
        return st

    def close(self) -> None:
        if self.pidfd is not None:
            with suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None


def hold(targets: Sequence[Target]) -> tuple[list[Held], list[str]]:
    """Verify every target (``check_process``) and hold the ones that pass; notes on the others.

    The pidfd is opened first and the process verified after, so the held handle is the verified process.
    Raises ChaosRefused when none passes.
    """
    held: list[Held] = []
    notes: list[str] = []
    for t in targets:
        pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(t.pid)
            except ProcessLookupError:
                notes.append(f"{t.label}: not running")
                continue
            except OSError:  # an old kernel or a seccomp filter: fall back to pid + start time
                pidfd = None
        st, why = check_process(t)
        if why is not None or st is None:
            notes.append(f"{t.label}: {why}")
            if pidfd is not None:
                os.close(pidfd)
            continue
        held.append(Held(t, st.start_ticks, pidfd))
    if not held:
        node = targets[0].node if targets else "?"
        raise ChaosRefused(f"no running process of node {node} to signal: " + "; ".join(notes))
    return held, notes


def signal_all(held: Sequence[Held], sig: int) -> list[Held]:
    """Send ``sig`` to every held process that still exists; the ones it reached.

    Raises ChaosRefused, naming the process, when one belongs to another user.
    """
    reached = []
    for h in held:
        try:
            if h.send(sig):
                reached.append(h)
        except PermissionError:
            raise ChaosRefused(f"not allowed to signal {h.target.label}: it belongs to another user") from None
    return reached


def resume(held: Sequence[Held]) -> list[Held]:
    """SIGCONT every held process, not to be interrupted by Ctrl-C or SIGTERM halfway (a signal that
    arrives meanwhile is raised as KeyboardInterrupt afterwards). The processes it reached."""
    with _uninterruptible():
        return signal_all(held, signal.SIGCONT)


@contextmanager
def _uninterruptible() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    wanted = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def note(signum: int, _frame: Any) -> None:
        received.append(signum)

    old = {s: signal.signal(s, note) for s in wanted}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if received:
        raise KeyboardInterrupt


def _interrupt_on_termination() -> None:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does, so stopped processes are resumed."""

    def interrupt(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, interrupt)


# --- the actions ------------------------------------------------------------------------------------


def _report(held: Sequence[Held], verb: str) -> None:
    for h in held:
        console.print(f"{verb} {h.target.service} on {h.target.node} (pid {h.target.pid})")


def _wait_gone(held: Sequence[Held], timeout_s: float) -> list[Held]:
    """Wait up to ``timeout_s`` seconds for every held process to exit (a zombie counts as exited); the
    ones still there."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [h for h in held if (st := h.stat()) is not None and st.state not in ("Z", "X")]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def do_kill(held: Sequence[Held]) -> int:
    """SIGKILL every held process and confirm they exit (within KILL_CONFIRM_S seconds). Exit status."""
    killed = signal_all(held, signal.SIGKILL)
    for h in killed:
        log.info("killed %s", h.target.label)
    _report(killed, "killed")
    for h in _wait_gone(killed, KILL_CONFIRM_S):
        err_console.print(f"[yellow]warning:[/yellow] {h.target.label} is still there {KILL_CONFIRM_S:g} s "
                          "after SIGKILL (uninterruptible sleep?)")
    return 0 if killed else 1


def do_stop(held: Sequence[Held], node: str, for_s: float | None) -> int:
    """SIGSTOP every held process; with ``for_s`` (seconds) wait that long and SIGCONT them, also on
    Ctrl-C, SIGTERM or an error. Exit status."""
    stopped: list[Held] = []
    try:
        for h in held:
            if signal_all([h], signal.SIGSTOP):
                stopped.append(h)
                log.info("stopped %s", h.target.label)
        _report(stopped, "stopped")
        if for_s is None:
            if stopped:
                console.print(f"{node} hangs until `edgeswarm chaos cont {node}` resumes it")
            return 0 if stopped else 1
        console.print(f"resuming in {for_s:g} s (Ctrl-C resumes now)")
        time.sleep(for_s)
    except BaseException:
        _report(resume(stopped), "resumed")
        raise
    _report(resume(stopped), "resumed")
    return 0 if stopped else 1


def do_cont(held: Sequence[Held]) -> int:
    """SIGCONT every held process. Exit status."""
    was = {id(h): (st.state if (st := h.stat()) else "?") for h in held}
    reached = resume(held)
    for h in reached:
        log.info("resumed %s", h.target.label)
        note = "" if was[id(h)] in ("T", "t") else " (it was not stopped)"
        console.print(f"resumed {h.target.service} on {h.target.node} (pid {h.target.pid}){note}")
    return 0 if reached else 1


def do_slow(held: Sequence[Held], factor: float, for_s: float, period_s: float = DEFAULT_PERIOD_S) -> int:
    """Make the held processes ``factor`` times slower for ``for_s`` seconds: every ``period_s`` seconds
    they run for ``period_s / factor`` and are stopped for the rest. They are left running (SIGCONT)
    afterwards, on Ctrl-C, SIGTERM or an error too. Returns the exit status after about ``for_s`` seconds.
    """
    run_s = period_s / factor
    stop_s = period_s - run_s
    deadline = time.monotonic() + for_s
    cycles = 0
    live = list(held)
    console.print(f"slowing {', '.join(h.target.label for h in live)} {factor:g}x for {for_s:g} s "
                  f"(period {period_s * 1e3:g} ms: {run_s * 1e3:.1f} ms running, {stop_s * 1e3:.1f} ms stopped)")
    try:
        while live:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            live = signal_all(live, signal.SIGSTOP)
            time.sleep(min(stop_s, left))
            live = signal_all(live, signal.SIGCONT)
            left = deadline - time.monotonic()
            if left > 0:
                time.sleep(min(run_s, left))
            cycles += 1
    finally:
        resumed = resume(held)
        _report(resumed, "left running")
    log.info("slowed %d processes %gx for %g s in %d cycles", len(held), factor, for_s, cycles)
    gone = [h.target.label for h in held if h.gone]
    if gone:
        err_console.print(f"[yellow]warning:[/yellow] exited meanwhile: {', '.join(gone)}")
    return 0 if resumed else 1


# --- the command line -------------------------------------------------------------------------------


def add_chaos_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``chaos kill|stop|cont|slow`` under the subparsers ``sub``."""
    from edgeswarm.cli.common import add_hub_arg

    chaos = sub.add_parser("chaos", help="fault injection: kill, stop, resume or slow a node's processes; on a "
                           "namespace cluster also cut, partition, restart a broker, pause")
    actions = chaos.add_subparsers(dest="chaos", required=True)
    helps = {
        "kill": "SIGKILL the node's service processes, as a device losing power",
        "stop": "SIGSTOP the node's service processes, as a hung device (alive, silent) until `chaos cont` "
                "or for --for seconds",
        "cont": "SIGCONT the node's service processes: resume a stopped node",
        "slow": "make the node --factor times slower for --for seconds by duty-cycling SIGSTOP/SIGCONT",
    }
    for name, text in helps.items():
        p = actions.add_parser(name, help=text, description=text)
        p.add_argument("node", metavar="NODE", help="a node of the view (`edgeswarm status`)")
        add_hub_arg(p)
        p.add_argument("--service", action="append", default=None, metavar="S",
                       help="only this service of the node, e.g. stage-worker (repeatable); required on the "
                       "node that runs the coordinator")
        if name == "stop":
            p.add_argument("--for", dest="for_s", type=float, default=None, metavar="SECONDS",
                           help="resume after this many seconds (the command waits); default: stay stopped")
        if name == "slow":
            p.add_argument("--factor", type=float, required=True, metavar="F", help="how many times slower (> 1)")
            p.add_argument("--for", dest="for_s", type=float, required=True, metavar="SECONDS",
                           help="how long (the command waits)")
            p.add_argument("--period", dest="period_s", type=float, default=DEFAULT_PERIOD_S, metavar="SECONDS",
                           help=f"one stop/run cycle (default {DEFAULT_PERIOD_S:g})")
    from edgeswarm.cli.chaos_net import add_network_actions

    add_network_actions(actions)


def validate(args: argparse.Namespace) -> None:
    """Reject impossible numbers before touching the cluster: ConfigError (exit status 2)."""
    for_s = getattr(args, "for_s", None)
    if for_s is not None and not for_s > 0:
        raise ConfigError(f"--for must be a positive number of seconds, not {for_s:g}")
    if args.chaos == "slow":
        if not args.factor > 1:
            raise ConfigError(f"--factor must be greater than 1, not {args.factor:g}")
        if not args.period_s >= MIN_PERIOD_S:
            raise ConfigError(f"--period must be at least {MIN_PERIOD_S:g} s, not {args.period_s:g}")


def fetch_view(hub: str | None) -> ClusterView:
    """The cluster view as ``edgeswarm status`` sees it: the coordinator's when fresh, else folded from the
    retained statuses and heartbeats. Raises an EdgeswarmError when the broker cannot be reached."""
    from edgeswarm.cli.common import cli_settings, hub_url
    from edgeswarm.runtime.client import ClusterWatcher, client_bus

    bus = client_bus(cli_settings(hub_url(hub)))
    try:
        view, source = ClusterWatcher(bus).wait(settle_s=1.0)
    finally:
        bus.stop()
    log.debug("view from %s: %d nodes", source, len(view.nodes))
    return view


def run_chaos(args: argparse.Namespace) -> int:
    """``edgeswarm chaos ...``: 0 done, 1 refused or nothing signalled, 2 usage (via ConfigError)."""
    from edgeswarm.cli.chaos_net import ACTIONS, run_network_chaos

    if args.chaos in ACTIONS:
        return run_network_chaos(args)
    validate(args)
    view = fetch_view(args.hub)
    targets, notes = select_targets(view, args.node, args.service, hostname=socket.gethostname(),
                                    never=frozenset({os.getpid(), os.getppid()}))
    held, more = hold(targets)
    for note in notes + more:
        err_console.print(f"[dim]skipped {note}[/dim]")
    try:
        if args.chaos == "kill":
            return do_kill(held)
        if args.chaos == "cont":
            return do_cont(held)
        _interrupt_on_termination()
        if args.chaos == "stop":
            return do_stop(held, args.node, args.for_s)
        return do_slow(held, args.factor, args.for_s, args.period_s)
    finally:
        for h in held:
            h.close()
