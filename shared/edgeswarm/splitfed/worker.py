"""The device's half of SmartSplit (the On-Device Manager), hosted by the stage-worker: any number of
train-splitfed jobs at once, each a round at a time.

Before a job plans a round on the device, a SplitPrepare (from the coordinator) has it open the data-plane connection
to its MEC, train one throwaway step of the job's model on its own data, time a few more (the whole model's step as
this device computes it) and time a round's setup: the job's setup, not its first round, pays the process's first
use of the model's operators and the connection's handshakes.

A SplitEnrol (from the coordinator) names the round's MEC and the device's partition; the device answers with the
training memory it has now (its ledger's room, capped by the round). Only that MEC's SplitPartWeights starts the round:
the device reserves its part in the node's memory ledger, reads its own partition, loads the part's weights and
trains E local epochs with the MEC through the U-split (spec section 7): the cut activation out, the MEC's output
in, the tail's loss and gradient on the device (labels never leave it), the cut gradient in. Its memory reducer
recomputes cheap layers' activations when its budget is short (Algorithm 3), and after every epoch it prunes samples
it has learned (spec 5.4). At the end it sends its trained part and the round's scalars (mean loss, sum of squared
losses, peak bytes) to the MEC. Tensors from any other node, or of another round, are dropped and counted.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from edgeswarm.devices.compute import use_device_threads
from edgeswarm.errors import ConfigError, EdgeswarmError, MemoryBudgetError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.splitfed import (
    DeviceReport,
    RoundSetup,
    SplitDone,
    SplitEnrol,
    SplitEnrolled,
    SplitPartWeights,
    SplitPrepare,
    SplitRelease,
    SplitTensor,
)
from edgeswarm.runtime.exchange import ExchangeAborted, ExchangeFailed, ExchangeTimeout, TensorExchange
from edgeswarm.runtime.program import JobTable
from edgeswarm.runtime.senders import count_stranger, stranger
from edgeswarm.service_registry import MEC_MANAGER
from edgeswarm.splitfed.compute import DeviceData, DevicePart, point_of, run_epochs
from edgeswarm.splitfed.prepare import Preparer, reach
from edgeswarm.values.limits import MAX_MEMORY_BYTES
from edgeswarm.wire import Message

if TYPE_CHECKING:
    from edgeswarm.bus import Inbound
    from edgeswarm.runtime.program import WorkerContext

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

PROGRAM = "splitfed-device"  # this program's name in the node's memory ledger
PREPARE = "prepare"  # the ledger part a job's warm-up step holds while it runs
# Local steps timed after the throwaway one when a device prepares: their median is what the job's first rounds
# price a step beyond its forward and backward at (the loss, the optimizer, the part's own calls) before they
# measure it. Five cost a few percent of a round; more do not steady it (the host's moment moves it 1.3x-2x on
# this project's VM whether 3 or 10 are timed).
PREPARE_STEPS = 5
MAX_JOBS = 16


class TensorKey(NamedTuple):
    """A U-split tensor of one round's step (``scope``: the round)."""

    round: int
    step: int
    kind: str

    @property
    def scope(self) -> int:
        return self.round

    def __str__(self) -> str:
        return f"{self.kind} tensor (round {self.round}, step {self.step})"


@dataclass
class _Job:
    enrol: SplitEnrol
    exchange: TensorExchange[TensorKey]
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        self.stop.set()
        self.exchange.close(timeout_s=1.0)


class DeviceProgram(JobTable[_Job]):
    """The device's half of every train-splitfed job on this stage-worker (see the module's docstring)."""

    handles: tuple[type[Message], ...] = (SplitPrepare, SplitEnrol, SplitRelease)
    tensors: tuple[type[Message], ...] = (SplitPartWeights, SplitTensor)

    ledger_name = PROGRAM
    refusal_counter = "splitfed_refused"

    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        self._preparer = Preparer(self)

    # --- requests -------------------------------------------------------------------------------------

    def on_request(self, msg: Inbound) -> None:
        body = msg.body
        if isinstance(body, SplitRelease):
            self._release(body.job_id)
        elif isinstance(body, SplitEnrol):
            self._enrol(msg, body)
        elif isinstance(body, SplitPrepare):
            self._preparer.submit(msg, body, partial(self._warm, body))

    def _warm(self, body: SplitPrepare) -> tuple[float, float]:
        """SplitPrepare's work on the device (see the module's docstring): the seconds a round's setup took, and the
        median seconds of PREPARE_STEPS local training iterations of the whole model after the throwaway one (0 for
        an empty partition)."""
        if body.index is None:
            raise ConfigError("a device prepares for a job on its partition: the prepare names no index")
        reach(self.ctx.bus, ((peer, MEC_MANAGER) for peer in body.peers[:1]))  # its MEC's broker
        # The whole model trained locally: every operator of the job's model at its batch size, whatever the cut.
        training = body.setup.training.model_copy(update={"mode": "local", "recompute": "off",
                                                          "sample_pruning": False})
        use_device_threads(self.ctx.device)
        ledger, what = self.ctx.ledger, f"split learning job {body.job_id}'s preparation"
        try:
            whole = DevicePart(body.setup.model_copy(update={"training": training}), 1, compute=self.ctx.compute,
                               gate=self.ctx.gate, run=self.ctx.device.run)
            ledger.reserve(PROGRAM, body.job_id, whole.static_bytes(), part=PREPARE, what=what)
            data = whole.partition_data(body.index)
            steps: list[float] = []
            if data.size:
                batch = data.batch(np.arange(min(training.batch_size, data.size)))
                whole.local_step(*batch)
                for _ in range(PREPARE_STEPS):
                    before = whole.compute_s
                    whole.local_step(*batch)
                    steps.append(whole.compute_s - before)
            # A round's setup in the job's mode, as _train times it (its deepest cut: the build is the part that
            # grows with the cut), its memory planned as if the budget had room (no recomputation).
            began = time.monotonic()
            point = point_of(body.setup, 1)
            self._set_up_part(body.setup, point.units - max(point.tail, 1), None, body.job_id, body.index,
                              MAX_MEMORY_BYTES, what=what, part=PREPARE)
            return time.monotonic() - began, statistics.median(steps) if steps else 0.0
        finally:
            ledger.release(PROGRAM, body.job_id, part=PREPARE)

    def _enrol(self, msg: Inbound, body: SplitEnrol) -> None:
        with self._lock:
            job = self._jobs.get(body.job_id)
            if job is None and len(self._jobs) >= MAX_JOBS:
                busy = True
            else:
                busy = False
                if job is not None and job.thread is not None and job.thread.is_alive():
                    # A new round while the old one still runs: the coordinator gave the old one up.
                    job.stop.set()
                    job.exchange.abort(job.enrol.round, f"round {body.round} replaces it")
                if job is None:
                    exchange: TensorExchange[TensorKey] = TensorExchange(
                        self.ctx.bus, MEC_MANAGER, wait_s=body.wait_s, name=f"splitfed {body.job_id}",
                        scope_name="round", compute=self.ctx.compute)
                    job = _Job(enrol=body, exchange=exchange)
                    self._jobs[body.job_id] = job
                else:
                    job.enrol, job.stop = body, threading.Event()
                    job.exchange.wait_s = body.wait_s
        if busy:
            self.refuse(msg, body.job_id, "busy", f"{self.ctx.node} holds {MAX_JOBS} split learning jobs")
            return
        self.ctx.bus.reply(msg, SplitEnrolled(job_id=body.job_id, round=body.round, node=self.ctx.node,
                                              budget_bytes=self._budget(body)))

    def _budget(self, enrol: SplitEnrol) -> int:
        """The training memory this device has for ``enrol``'s job now (bytes)."""
        ledger = self.ctx.ledger
        room = max(ledger.budget_bytes - ledger.reserved_bytes(exclude=(PROGRAM, enrol.job_id)), 0)
        return min(room, enrol.budget_bytes) if enrol.budget_bytes else room

    def _release(self, job_id: str) -> None:
        with self._lock:
            job = self._jobs.pop(job_id, None)
        if job is not None:
            job.close()
            self.ctx.ledger.release(PROGRAM, job_id)
            log.info("splitfed job %s: released", job_id)

    # --- tensors --------------------------------------------------------------------------------------

    def on_tensor(self, msg: Inbound) -> None:
        body = msg.body
        with self._lock:
            job = self._jobs.get(self.job_of(body))
        if job is None:
            self.ctx.metrics.count("data_refused.unknown_job")
            return
        why = stranger(msg, job.enrol.mec, type(body).__name__)
        if why is not None:
            count_stranger(self.ctx.metrics)
            _limited.warning("stranger", "splitfed job %s: %s", job.enrol.job_id, why)
            return
        if getattr(body, "round", -1) != job.enrol.round or msg.tensor is None:
            self.ctx.metrics.count("data_refused.stale_round")
            return
        if isinstance(body, SplitPartWeights):
            with self._lock:
                previous = job.thread if job.thread is not None and job.thread.is_alive() else None
                if previous is not None:
                    # The MEC sends the round again (it restarted): the run under way gives up, quietly.
                    job.stop.set()
                    job.exchange.abort(body.round, "the MEC started the round again")
                job.stop = threading.Event()
                job.thread = threading.Thread(target=self._train, args=(job, body, msg.tensor.to_torch(), job.stop,
                                                                        previous),
                                              name=f"splitfed-{body.job_id}", daemon=True)
                job.thread.start()
        elif isinstance(body, SplitTensor) and body.kind in ("middle", "cut_gradient"):
            job.exchange.put(TensorKey(body.round, body.step, body.kind), msg.tensor.to_torch())
        else:
            self.ctx.metrics.count("data_refused.kind")

    # --- the round ------------------------------------------------------------------------------------

    def _train(self, job: _Job, part_msg: SplitPartWeights, flat: torch.Tensor, stop: threading.Event,
               previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join(job.enrol.wait_s)
        enrol, r = job.enrol, part_msg.round
        report = DeviceReport(node=self.ctx.node, outcome="failed", cut=part_msg.cut)
        weights = torch.zeros(0)
        try:
            use_device_threads(self.ctx.device)  # this round's thread computes as the device: its threads, its speed
            began = time.monotonic()
            budget = self._budget(enrol)
            part, data = self._set_up_part(enrol.setup, part_msg.cut, flat, enrol.job_id, enrol.index, budget,
                                           what=f"split learning job {enrol.job_id}'s device part (cut "
                                                f"{part_msg.cut})")
            report = self._epochs(job, part, data, r, budget, stop, time.monotonic() - began)
            weights = part.flat()
        except (ExchangeTimeout, ExchangeFailed, ExchangeAborted) as exc:
            report = report.model_copy(update={"detail": f"the MEC's tensors stopped: {exc}"[:1024]})
        except MemoryBudgetError as exc:
            report = report.model_copy(update={"detail": str(exc)[:1024]})
        except EdgeswarmError as exc:
            report = report.model_copy(update={"detail": str(exc)[:1024]})
        except Exception as exc:  # noqa: BLE001 - a torch failure fails the round, never the service
            log.exception("splitfed job %s round %d failed", enrol.job_id, r)
            report = report.model_copy(update={"detail": f"{type(exc).__name__}: {exc}"[:1024]})
        finally:
            self.ctx.ledger.release(PROGRAM, enrol.job_id)
            job.exchange.forget(r)
        if stop.is_set():
            return  # replaced by a newer run of the round: nobody waits for this one's report
        if report.outcome != "trained":
            log.warning("splitfed job %s round %d failed here: %s", enrol.job_id, r, report.detail)
        try:
            self.ctx.bus.send_tensor(enrol.mec, MEC_MANAGER, SplitDone(job_id=enrol.job_id, round=r, report=report),
                                     weights)
        except EdgeswarmError as exc:
            log.warning("splitfed job %s round %d: could not send the trained part: %s", enrol.job_id, r, exc)

    def _set_up_part(self, setup: RoundSetup, cut: int, flat: torch.Tensor | None, job_id: str, index: int,
                     budget: int, *, what: str, part: str = "") -> tuple[DevicePart, DeviceData]:
        """A round's setup: the device's part of ``setup`` at ``cut`` built, held in the memory ledger (as ``part``
        of the job's holding), loaded with ``flat`` (None: the weights it was built with), its memory planned for
        ``budget`` bytes, and its partition ``index`` read. The caller releases the holding."""
        device_part = DevicePart(setup, cut, compute=self.ctx.compute, gate=self.ctx.gate, run=self.ctx.device.run)
        self.ctx.ledger.reserve(PROGRAM, job_id, device_part.static_bytes(), what=what, part=part)
        device_part.load(device_part.flat() if flat is None else flat)
        device_part.plan_memory(budget)
        return device_part, device_part.partition_data(index)

    def _epochs(self, job: _Job, part: DevicePart, data: DeviceData, r: int, budget: int, stop: threading.Event,
                setup_s: float) -> DeviceReport:
        """The round's epochs on ``data``; ``setup_s``: the seconds ``_set_up_part`` took, for the report."""
        enrol, training = job.enrol, job.enrol.setup.training
        done = run_epochs(part, data, enrol.index, r,
                          lambda step, x, y, last: self._iteration(job, part, r, step, x, y, last), stop)
        vanilla = training.mode == "vanilla"  # the server computed the loss: the device never sees it
        mean, squares = done.loss_sum / max(done.seen, 1), float((done.losses ** 2).sum())
        finite = math.isfinite(mean) and math.isfinite(squares)  # a diverged run still reports; its MEC refuses it
        return DeviceReport(node=self.ctx.node, outcome="trained", cut=part.cut, samples=data.size,
                            iterations=done.iterations, loss=None if vanilla or not finite else mean,
                            loss_sq_sum=squares if finite else 0.0, detail="" if finite else "its losses diverged",
                            peak_bytes=part.peak_bytes, budget_bytes=budget, recompute=part.recompute_summary,
                            pruned=done.pruned, compute_s=part.compute_s, setup_s=setup_s)

    def _iteration(self, job: _Job, part: DevicePart, r: int, step: int, x: torch.Tensor, y: torch.Tensor,
                   last: bool) -> np.ndarray:
        """One mini-batch with the MEC (or alone, at a cut that leaves the MEC nothing); the per-sample losses. Each
        part of it is a span of the round (the step as its micro-batch) on the device's lane, its transfers on the
        link's."""
        enrol, mode = job.enrol, job.enrol.setup.training.mode
        lane = self.ctx.tracer.lane(enrol.job_id, "device")
        if part.alone:
            with lane.span("local step", "compute", r, step):
                return part.local_step(x, y)
        link = lane.on("link device→mec")
        ex = job.exchange
        with lane.span("forward", "compute", r, step):
            activation = part.front_forward(x)
        labels = [int(v) for v in y.tolist()] if mode == "vanilla" else None
        ex.send(enrol.mec, r, SplitTensor(job_id=enrol.job_id, round=r, step=step, kind="activation", last=last,
                                          labels=labels),
                activation, span=link.span("activation", "transfer", r, step))
        if mode == "vanilla":
            losses = np.zeros(len(y))  # the MEC computes the loss; the device learns only its gradient
        else:
            with lane.span("wait middle", "wait", r, step):
                middle = ex.wait(TensorKey(r, step, "middle"))
            with lane.span("tail", "compute", r, step):
                losses, tail_gradient = part.tail_step(middle, y)
            ex.send(enrol.mec, r, SplitTensor(job_id=enrol.job_id, round=r, step=step, kind="tail_gradient"),
                    tail_gradient, span=link.span("tail gradient", "transfer", r, step))
        with lane.span("wait cut gradient", "wait", r, step):
            cut_gradient = ex.wait(TensorKey(r, step, "cut_gradient"))
        with lane.span("backward", "compute", r, step):
            part.front_backward(cut_gradient)
        return losses
