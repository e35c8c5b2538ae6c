"""Preparing a party for a train-splitfed job before its rounds (SplitPrepare), the part the device and the MEC
share: each prepare runs on a thread of its own (a device's step computes as the device, and a connection to a
peer's broker takes round trips), one after another (each times a setup, and two would slow each other), at most
MAX_WAITING admitted at once; and the data-plane connections to the job's peers are opened, so the first tensor a
round sends there does not wait for the handshakes.

A party's own preparation (its throwaway step, its reassembly) is the caller's ``work``: it returns the setup and
step seconds the answer carries."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from edgeswarm.errors import EdgeswarmError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.splitfed import SplitPrepare, SplitPrepared
from edgeswarm.runtime.program import build_failure

if TYPE_CHECKING:
    from edgeswarm.bus import Bus, Inbound
    from edgeswarm.runtime.program import JobTable

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

MAX_WAITING = 16  # prepares admitted at once (a program holds at most 16 jobs); beyond, answered busy


class Preparer:
    """Runs one program's SplitPrepare requests (see the module's docstring)."""

    def __init__(self, program: JobTable[Any]) -> None:
        self.program = program
        self._waiting = threading.BoundedSemaphore(MAX_WAITING)
        self._running = threading.Lock()

    def submit(self, msg: Inbound, body: SplitPrepare, work: Callable[[], tuple[float, float]]) -> None:
        """Run ``work`` (the party's own preparation: the setup and step seconds it timed, SplitPrepared's) for
        ``msg`` on a thread, then answer SplitPrepared; StageFailed when ``work`` raises, or ``busy`` with
        MAX_WAITING prepares admitted."""
        ctx = self.program.ctx
        if not self._waiting.acquire(blocking=False):
            self.program.refuse(msg, body.job_id, "busy", f"{ctx.node} has {MAX_WAITING} split learning jobs to "
                                                          "prepare")
            return

        def run() -> None:
            try:
                with self._running:
                    setup_s, step_s = work()
            except Exception as exc:  # noqa: BLE001 - a failed preparation is answered, never raised into the bus
                reason, detail = build_failure(exc, f"preparing split learning job {body.job_id}", log)
                self.program.refuse(msg, body.job_id, reason, detail)
                return
            finally:
                self._waiting.release()
            ctx.bus.reply(msg, SplitPrepared(job_id=body.job_id, node=ctx.node, setup_s=setup_s,
                                           step_s=step_s))

        threading.Thread(target=run, name=f"splitfed-prepare-{body.job_id}", daemon=True).start()


def reach(bus: Bus, peers: Iterable[tuple[str, str]]) -> None:
    """Open the data-plane connections to each (node, service) of ``peers`` that is online now; one that is not,
    or whose broker cannot be reached, is left for the round's first tensor (logged at a bounded rate)."""
    for node, service in peers:
        status = bus.peers.get(node, service)
        if status is None or status.state != "online":
            continue
        try:
            bus.reach(node, service)
        except EdgeswarmError as exc:
            _limited.warning(f"reach.{node}", "could not open the data-plane connection to %s/%s: %s", node,
                             service, exc)
