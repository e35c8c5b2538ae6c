"""The MEC's half of SmartSplit (the MEC Manager), hosted by the mec-manager: any number of train-splitfed jobs.

A SplitRoundStart (from the coordinator) hands the MEC its candidates for a round, their cuts and its quota; the
global weights follow as SplitGlobal from the coordinator the round names. The Importance Scheduler (Algorithm 2)
keeps ``quota`` of the candidates: the top by statistical utility from its Loss Cache, or with probability epsilon a
random draw. For each device it keeps a replica of the middle of the model (SplitFed-v1: one per device), sends the
device its part (SplitPartWeights) and serves its mini-batches: the cut activation in, the middle's output out,
the tail's gradient in, the cut gradient out. When a device's SplitDone comes the MEC reassembles its whole
local model, refuses
one with NaN or infinite values (counted), estimates its label distribution from its output layer (Algorithm 1) and
adds it to the round's sum weighted by its samples. A device whose tensors stop for ``wait_s`` is left out; the round
completes with the rest. Each finished device is checkpointed to the MEC's disk, so a restarted MEC given the round
again trains only the devices it had not finished. The weighted sum and every device's report go to the coordinator
(SplitUpdate).

Before the job's first round on it, a SplitPrepare has the MEC open the data-plane connections to its devices and
the coordinator, build the job's reassembly (the model traced) and run its label-distribution estimate once on
throwaway weights (the data's first read, the model's first backward here), so that round does not pay them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from edgeswarm.aggregation import FedAvg, UpdateRejectedError
from edgeswarm.devices.compute import use_device_threads
from edgeswarm.errors import EdgeswarmError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.splitfed import (
    DeviceReport,
    SplitCandidate,
    SplitDone,
    SplitEnrolled,
    SplitGlobal,
    SplitPartWeights,
    SplitPrepare,
    SplitRelease,
    SplitRoundStart,
    SplitTensor,
    SplitUpdate,
)
from edgeswarm.planning.splitfed.scheduling import pick
from edgeswarm.planning.splitfed.statistics import dis, stat_from_sums
from edgeswarm.runtime.exchange import ExchangeAborted, ExchangeFailed, ExchangeTimeout, TensorExchange
from edgeswarm.runtime.program import JobTable, WorkerContext
from edgeswarm.runtime.senders import count_stranger, stranger
from edgeswarm.service_registry import STAGE_WORKER
from edgeswarm.splitfed.compute import MecPart, Reassembly, point_of, trains_alone
from edgeswarm.splitfed.mec_state import RoundCheckpoint
from edgeswarm.splitfed.prepare import Preparer, reach
from edgeswarm.splitfed.weights import flatten
from edgeswarm.wire import Message

if TYPE_CHECKING:
    from edgeswarm.bus import Inbound

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

PROGRAM = "splitfed-mec"
MAX_JOBS = 16
ALONE_POLL_S = 0.2  # how often the wait for a device training alone looks at its status (seconds)


class TensorKey(NamedTuple):
    """A U-split tensor of one device's step in one round (``scope``: the round and the device, so a device that
    stops fails only its own waits)."""

    round: int
    device: str
    step: int
    kind: str

    @property
    def scope(self) -> tuple[int, str]:
        return (self.round, self.device)

    def __str__(self) -> str:
        return f"{self.kind} tensor of {self.device} (round {self.round}, step {self.step})"


@dataclass
class _Round:
    start: SplitRoundStart
    exchange: TensorExchange[TensorKey]
    selected: list[SplitCandidate] = field(default_factory=list)
    last_step: dict[str, int] = field(default_factory=dict)  # device -> the step its last activation has
    labels: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # a vanilla split's, by (device, step)
    done: dict[str, tuple[DeviceReport, torch.Tensor]] = field(default_factory=dict)
    done_events: dict[str, threading.Event] = field(default_factory=dict)
    lan_bytes: int = 0
    started: bool = False
    total: FedAvg | None = None  # the round's weighted sum of reassembled models
    reports: list[DeviceReport] = field(default_factory=list)
    refused: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    parts_at: float = 0.0  # when its devices' parts began to go out (monotonic seconds)
    served_at: float = 0.0  # when its last device's round ended here (its SplitDone in, or given up)

    def close(self) -> None:
        self.stop.set()
        self.exchange.close(timeout_s=1.0)


class MecProgram(JobTable[_Round]):
    """The MEC's half of every train-splitfed job on this mec-manager (see the module's docstring)."""

    handles: tuple[type[Message], ...] = (SplitPrepare, SplitRoundStart, SplitRelease)
    tensors: tuple[type[Message], ...] = (SplitGlobal, SplitTensor, SplitDone)

    ledger_name = PROGRAM
    refusal_counter = "splitfed_refused"

    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        self._stats: dict[tuple[str, str], float] = {}  # (job, device) -> Stat: the Loss Cache's utility
        self._checkpoints = RoundCheckpoint(ctx.bus.settings.checkpoint_dir / "mec" / ctx.node)
        self._preparer = Preparer(self)

    # --- requests -------------------------------------------------------------------------------------

    def on_request(self, msg: Inbound) -> None:
        body = msg.body
        if isinstance(body, SplitRelease):
            with self._lock:
                rnd = self._jobs.pop(body.job_id, None)
            if rnd is not None:
                rnd.close()
                self.ctx.ledger.release(PROGRAM, body.job_id)
            self._checkpoints.forget(body.job_id)
        elif isinstance(body, SplitRoundStart):
            self._start(msg, body)
        elif isinstance(body, SplitPrepare):
            self._preparer.submit(msg, body, partial(self._prepare, msg.envelope.sender_node, body))

    def _prepare(self, coordinator: str, body: SplitPrepare) -> tuple[float, float]:
        """SplitPrepare's work on the MEC (see the module's docstring): the seconds its reassembly took to build (and
        no step)."""
        reach(self.ctx.bus, [(coordinator, "coordinator"), *((d, STAGE_WORKER) for d in body.peers)])
        with self.ctx.gate.building():
            point_of(body.setup, 1)  # traces the model's units, once per model
            began = time.monotonic()
            rebuild = Reassembly(body.setup, compute=self.ctx.compute)
            took = time.monotonic() - began
        with self.ctx.gate.computing():
            rebuild.warm()
        return took, 0.0

    def _start(self, msg: Inbound, body: SplitRoundStart) -> None:
        with self._lock:
            old = self._jobs.get(body.job_id)
            if old is None and len(self._jobs) >= MAX_JOBS:
                self.refuse(msg, body.job_id, "busy", f"{self.ctx.node} serves {MAX_JOBS} split learning jobs")
                return
            if old is not None:
                old.close()  # the coordinator moved on: the old round's waits give up now
            exchange: TensorExchange[TensorKey] = TensorExchange(
                self.ctx.bus, STAGE_WORKER, wait_s=body.wait_s, name=f"splitfed {body.job_id} (MEC)",
                scope_name="device round", compute=self.ctx.compute)
            self._jobs[body.job_id] = _Round(start=body, exchange=exchange)
        ledger = self.ctx.ledger
        room = max(ledger.budget_bytes - ledger.reserved_bytes(exclude=(PROGRAM, body.job_id)), 0)
        self.ctx.bus.reply(msg, SplitEnrolled(job_id=body.job_id, round=body.round, node=self.ctx.node,
                                              budget_bytes=room))

    # --- tensors --------------------------------------------------------------------------------------

    def on_tensor(self, msg: Inbound) -> None:
        body = msg.body
        with self._lock:
            rnd = self._jobs.get(self.job_of(body))
        if rnd is None:
            self.ctx.metrics.count("data_refused.unknown_job")
            return
        # Who sent it first: the round's coordinator its global weights, the round's devices their tensors (a
        # stranger is refused whatever round it names); then whether it is of this round.
        allowed = rnd.start.coordinator if isinstance(body, SplitGlobal) else [c.node for c in rnd.selected]
        why = stranger(msg, allowed, type(body).__name__)
        if why is not None:
            count_stranger(self.ctx.metrics)
            _limited.warning("stranger", "splitfed job %s: %s", rnd.start.job_id, why)
            return
        if getattr(body, "round", -1) != rnd.start.round:
            self.ctx.metrics.count("data_refused.stale_round")
            return
        if isinstance(body, SplitGlobal):
            self._on_global(msg, rnd)
            return
        sender = msg.envelope.sender_node
        if msg.tensor is None:
            return
        value = msg.tensor.to_torch()
        if isinstance(body, SplitDone):
            if body.report.node != sender:  # a report speaks for its sender only
                count_stranger(self.ctx.metrics)
                return
            event = rnd.done_events.get(sender)
            if event is not None and not event.is_set():
                rnd.done[sender] = (body.report, value)
                event.set()
                if body.report.outcome != "trained":  # its mini-batches stop here: the waits for them end now
                    rnd.exchange.fail((rnd.start.round, sender), f"{sender} ended its round: {body.report.detail}")
            else:
                self.ctx.metrics.count("data_refused.duplicate")
            return
        assert isinstance(body, SplitTensor)
        if body.kind == "activation":
            if body.labels is not None and rnd.start.setup.training.mode != "vanilla":
                self.ctx.metrics.count("data_refused.labels")  # a U-split round never takes labels
                return
            if body.last:
                rnd.last_step[sender] = body.step
            if body.labels is not None:
                rnd.labels[(sender, body.step)] = body.labels
        elif body.kind != "tail_gradient":
            self.ctx.metrics.count("data_refused.kind")
            return
        rnd.lan_bytes += value.numel() * value.element_size()
        rnd.exchange.put(TensorKey(body.round, sender, body.step, body.kind), value)

    def _on_global(self, msg: Inbound, rnd: _Round) -> None:
        if msg.tensor is None:
            return
        with self._lock:
            if rnd.started:
                self.ctx.metrics.count("data_refused.duplicate")
                return
            rnd.started = True
        threading.Thread(target=self._run_round, args=(rnd, msg.tensor.to_torch()),
                         name=f"splitfed-mec-{rnd.start.job_id}", daemon=True).start()

    # --- the round ------------------------------------------------------------------------------------

    def _run_round(self, rnd: _Round, flat: torch.Tensor) -> None:
        start = rnd.start
        job, r = start.job_id, start.round
        try:
            with self.ctx.gate.building():
                rebuild = Reassembly(start.setup, compute=self.ctx.compute)
            global_state = rebuild.unflatten(flat)
            rnd.total = FedAvg(global_state)
            rnd.reports = self._checkpoints.resume(job, r, rnd.total)
            finished = {rep.node for rep in rnd.reports}
            remaining = [c for c in start.candidates if c.node not in finished]
            quota = max(start.quota - sum(rep.outcome == "trained" for rep in rnd.reports), 0)
            stats = [self._stats.get((job, c.node), float(c.samples)) for c in remaining]
            chosen = pick(stats, min(quota, len(remaining)), start.epsilon, np.random.default_rng(start.seed)).chosen
            rnd.selected = [remaining[i] for i in sorted(chosen)]
            rnd.done_events = {c.node: threading.Event() for c in rnd.selected}
            with self.ctx.gate.building():
                rebuild.prepare([c.cut for c in rnd.selected])
            rnd.reports += [DeviceReport(node=c.node, outcome="skipped", cut=c.cut, samples=c.samples)
                            for c in remaining if c not in rnd.selected]
            threads = [threading.Thread(target=self._serve_safely, args=(rnd, c, global_state, rebuild),
                                        name=f"splitfed-mec-{c.node}", daemon=True) for c in rnd.selected]
            rnd.parts_at = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except EdgeswarmError as exc:
            log.warning("splitfed job %s round %d failed on this MEC: %s", job, r, exc)
            done = {rep.node for rep in rnd.reports}
            rnd.reports += [DeviceReport(node=c.node, outcome="failed", cut=c.cut, detail=str(exc)[:1024])
                            for c in start.candidates if c.node not in done]
        except Exception:  # noqa: BLE001 - the round fails, never the service
            log.exception("splitfed job %s round %d failed on this MEC", job, r)
        if rnd.stop.is_set():
            return
        partial = rnd.total.partial() if rnd.total is not None else None
        sums = flatten(partial.sums, rebuild.layout) if partial and partial.count else torch.zeros(0)
        update = SplitUpdate(job_id=job, round=r, mec=self.ctx.node, samples=int(partial.weight) if partial else 0,
                             heaviest=int(partial.heaviest) if partial else 0, count=partial.count if partial else 0,
                             reports=rnd.reports, refused=rnd.refused, lan_bytes=rnd.lan_bytes,
                             devices_s=max(rnd.served_at - rnd.parts_at, 0.0) if rnd.served_at else 0.0)
        try:
            self.ctx.bus.send_tensor(start.coordinator, "coordinator", update, sums)
        except EdgeswarmError as exc:
            log.warning("splitfed job %s round %d: could not send the update: %s", job, r, exc)

    def _fold(self, rnd: _Round, cand: SplitCandidate, middle: dict[str, torch.Tensor] | None,
              global_state: dict[str, torch.Tensor], rebuild: Reassembly, wsum: FedAvg) -> tuple[DeviceReport, int]:
        """Add ``cand``'s reassembled model to the round's weighted sum; its report (with the MEC's estimates)
        and whether its update was refused."""
        job = rnd.start.job_id
        report, part = rnd.done.get(cand.node, (None, None))
        if report is None or part is None or middle is None:
            why = "its tensors stopped" if report is None else report.detail
            return (report or DeviceReport(node=cand.node, outcome="lost", cut=cand.cut, detail=why[:1024]),
                    0)
        if report.outcome != "trained":
            return report, 0
        try:
            local = rebuild.full_state(cand.cut, part, middle)
            wsum.add(local, cand.samples, who=f"{cand.node}'s update")
        except (UpdateRejectedError, EdgeswarmError) as exc:
            self.ctx.metrics.count("splitfed_refused.update")
            _limited.warning("refused", "splitfed job %s: refused %s's update: %s", job, cand.node, exc)
            return report.model_copy(update={"outcome": "refused", "detail": str(exc)[:1024]}), 1
        stat = stat_from_sums(cand.samples, report.loss_sq_sum)
        self._stats[(job, cand.node)] = stat
        skew = None
        if rnd.start.estimator != "off":
            with self.ctx.gate.computing():
                skew = dis(rebuild.label_distribution(global_state, local, cand.index, rnd.start.estimator))
        return report.model_copy(update={"samples": cand.samples, "stat": stat, "dis": skew}), 0

    def _serve_safely(self, rnd: _Round, cand: SplitCandidate, global_state: dict[str, torch.Tensor],
                      rebuild: Reassembly) -> None:
        """Serve ``cand``'s round, then fold its model into the round's sum and checkpoint the round: a device that
        fails leaves only itself out."""
        middle: dict[str, torch.Tensor] | None = None
        try:
            middle = self._serve(rnd, cand, global_state, rebuild)
        except (ExchangeTimeout, ExchangeFailed, ExchangeAborted) as exc:
            log.info("splitfed job %s round %d: %s left the round: %s", rnd.start.job_id, rnd.start.round,
                     cand.node, exc)
        except EdgeswarmError as exc:
            log.warning("splitfed job %s round %d: %s failed: %s", rnd.start.job_id, rnd.start.round, cand.node, exc)
        except Exception:  # noqa: BLE001 - one device's failure leaves the others' round going
            log.exception("splitfed job %s round %d: serving %s failed", rnd.start.job_id, rnd.start.round,
                          cand.node)
        finally:
            rnd.exchange.forget((rnd.start.round, cand.node))
        if rnd.stop.is_set() or rnd.total is None:
            return
        with rnd.lock:
            rnd.served_at = max(rnd.served_at, time.monotonic())
            report, refused = self._fold(rnd, cand, middle, global_state, rebuild, rnd.total)
            rnd.refused += refused
            rnd.reports.append(report)
            self._checkpoints.save(rnd.start.job_id, rnd.start.round, rnd.reports, rnd.total.partial())

    def _await_alone(self, rnd: _Round, device: str, done: threading.Event, bound_s: float) -> None:
        """Wait for ``device``, training alone, to send its SplitDone. It sends nothing before then, so its liveness
        is its stage-worker's status: a Last Will (offline) or a new instance ends the wait at once, as a tensor
        that stopped coming ends a split device's within ``wait_s``; so do the round's end and ``bound_s``
        seconds. Raises ExchangeFailed, ExchangeAborted or ExchangeTimeout."""
        peers = self.ctx.bus.peers
        first = peers.get(device, STAGE_WORKER)
        deadline = time.monotonic() + bound_s
        while not done.wait(ALONE_POLL_S):
            if rnd.stop.is_set():
                raise ExchangeAborted(f"the round ended while {device} trained alone")
            status = peers.get(device, STAGE_WORKER)
            if status is not None and (status.state == "offline" or
                                       (first is not None and status.instance != first.instance)):
                raise ExchangeFailed(f"{device}'s stage-worker went away during its local training "
                                     f"({status.reason or status.state})")
            if time.monotonic() > deadline:
                raise ExchangeTimeout(f"{device} did not finish its local training in time")

    def _serve(self, rnd: _Round, cand: SplitCandidate, global_state: dict[str, torch.Tensor],
               rebuild: Reassembly) -> dict[str, torch.Tensor]:
        """Send ``cand`` its part and serve its mini-batches until its last one and its SplitDone; the trained
        middle replica's state (empty for local training)."""
        start, ex, device = rnd.start, rnd.exchange, cand.node
        r, job, training = start.round, start.job_id, start.setup.training
        part_flat = rebuild.device_flat(global_state, cand.cut)
        rnd.lan_bytes += self.ctx.bus.send_tensor(device, STAGE_WORKER,
                                                  SplitPartWeights(job_id=job, round=r, cut=cand.cut), part_flat)
        done = rnd.done_events[device]
        with self.ctx.gate.building():  # the first split point of a model traces it
            alone = trains_alone(start.setup, point_of(start.setup, cand.cut))
        if alone:
            batches = -(-max(cand.samples, 1) // training.batch_size) * training.epochs
            self._await_alone(rnd, device, done, start.wait_s * (batches + 1))
            return {}
        with self.ctx.gate.building():
            part = MecPart(start.setup, cand.cut, compute=self.ctx.compute)
        part.load(global_state)
        use_device_threads(self.ctx.device)  # this thread computes as the edge server: its threads, its speed
        run = self.ctx.device.run
        step = 0
        while not rnd.stop.is_set():
            activation = ex.wait(TensorKey(r, device, step, "activation"))
            with self.ctx.gate.computing():
                if training.mode == "vanilla":
                    labels = rnd.labels.pop((device, step), None)
                    if labels is None or len(labels) != activation.shape[0]:
                        raise ExchangeFailed(f"{device}'s step {step} came without its labels")
                    cut_gradient = run(partial(part.vanilla_step, activation,
                                               torch.tensor(labels, device=activation.device)))
                else:
                    middle = run(partial(part.forward, activation))
            if training.mode != "vanilla":
                ex.send(device, (r, device), SplitTensor(job_id=job, round=r, step=step, kind="middle"), middle)
                tail_gradient = ex.wait(TensorKey(r, device, step, "tail_gradient"))
                with self.ctx.gate.computing():
                    cut_gradient = run(partial(part.backward, tail_gradient))
            ex.send(device, (r, device), SplitTensor(job_id=job, round=r, step=step, kind="cut_gradient"),
                    cut_gradient)
            rnd.lan_bytes += 2 * activation.numel() * activation.element_size()
            if rnd.last_step.get(device) == step:
                break
            step += 1
        if not done.wait(start.wait_s):
            raise ExchangeTimeout(f"{device} did not send its trained part")
        return part.state()
