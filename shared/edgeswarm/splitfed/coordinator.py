"""The coordinator's program for a train-splitfed job: SmartSplit's central manager and server, round by round.

Each round: read the cluster (the online stage-workers are the devices, the online mec-managers the edge servers),
ask the planner service for the central manager's selection (participants and cuts: ``planning.splitfed``), enrol
the candidates with their devices, start the round on each MEC with its candidates and the global weights, wait for
every MEC's weighted sum (a lost MEC is left out), finish FedAvg, evaluate the model on the held-out split, checkpoint
it to the checkpoint store as the whole model (so ``edgeswarm export`` reads it like any trained model) and publish
the round. A restarted coordinator resumes from the last checkpointed round.

The central manager plans every round afresh; with the rebalance setting on, it plans on the devices' speeds as the
rounds measured them (planning.refit's fit): each trained device reports the seconds its own computes took
(``DeviceReport.compute_s``), set against what its profiled speed gives for its cut and iterations; a device whose
fitted scale (from two rounds or more) moved more than 15% from 1 is planned at its profiled speed over that scale,
and a ``refit`` event says when the speeds the rounds plan on change. When the job stops, each device's scale is
saved in the profile cache (work ``split``), and the next job that profiles the device starts from it.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from statistics import median
from typing import TYPE_CHECKING

import torch

from edgeswarm import topics
from edgeswarm.aggregation import FedAvg, PartialSum, UpdateRejectedError
from edgeswarm.bus import Inbound
from edgeswarm.checkpoints.client import list_checkpoints, save_checkpoint
from edgeswarm.coordination.fanout import fan_out
from edgeswarm.coordination.program import RoundProgram
from edgeswarm.errors import BusError, CheckpointError, EdgeswarmError, JobError, ProfileError, ProfilerError
from edgeswarm.evaluation import held_out
from edgeswarm.messages.splitfed import (
    RoundSetup,
    SplitCandidate,
    SplitEnrol,
    SplitEnrolled,
    SplitGlobal,
    SplitPlanReply,
    SplitPlanRequest,
    SplitPrepare,
    SplitPrepared,
    SplitRelease,
    SplitRoundStart,
    SplitUpdate,
)
from edgeswarm.models.zoo import build_model
from edgeswarm.observability import record as metrics_record
from edgeswarm.planning.refit import ScaleFit, same_fit, speeds
from edgeswarm.planning.splitfed.cost import cut_costs, device_compute_s, parties_costs
from edgeswarm.planning.splitfed.scheduling import quotas
from edgeswarm.planning.splitfed.types import SplitOptions, SplitSelection
from edgeswarm.profiling.cache import ProfileCache
from edgeswarm.profiling.refits import save_measured, started_from
from edgeswarm.runtime.client import nodes_running
from edgeswarm.service_registry import MEC_MANAGER, STAGE_WORKER
from edgeswarm.splitfed import gather
from edgeswarm.splitfed.compute import input_bytes, partition_of
from edgeswarm.splitfed.prepare import reach
from edgeswarm.splitfed.profiling import model_cost
from edgeswarm.splitfed.spec import MAX_ROUND_RECORDS, ParticipantRecord, RoundRecord, SplitfedSpec
from edgeswarm.splitfed.weights import flatten, layout_of, unflatten
from edgeswarm.state.layout import load_layout_meta, load_stage, save_layout, stage_entry
from edgeswarm.stats import affine_fit
from edgeswarm.values.profiles import MAX_SCALE, MIN_SCALE

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from edgeswarm.messages.cluster import ClusterView
    from edgeswarm.values.profiles import LinkProfile
    from edgeswarm.workloads.base import JobContext

log = logging.getLogger(__name__)
KIND = "train-splitfed"  # the job kind (splitfed.workload's) in the metrics this program records

ENROL_TIMEOUT_S = 30.0
PROFILE_TIMEOUT_S = 300.0  # for the profilers of a round's new nodes to come up, and for each turn of profiling
POLL_S = 0.1
TWO_TIER = ("fedavg", "splitfed")  # the baselines whose devices talk to the cloud server (spec 10.4, 12.14)
# A device's round predicted to compute less than this says more of the runtime's per-call costs than of its speed.
MIN_FIT_S = 0.05
# Rounds a device's scale is fitted from before the rounds plan on it: its first round also builds its part.
MIN_FIT_ROUNDS = 2
FIXED_WINDOW = 5  # rounds a measured fixed cost (a device's setup, the round's own) is the median of
# The requests a round's coordinator waits on before its MECs start: the planner's, the enrolment, the start.
CONTROL_REQUESTS = 3


class SplitfedRunner(RoundProgram):
    """One train-splitfed job on the coordinator (see the module's docstring): a round program whose failure detector
    watches the MECs."""

    plan_noun = "selection"

    def __init__(self, ctx: JobContext, spec: SplitfedSpec) -> None:
        super().__init__(ctx.bus, name=spec.name, worker_service=MEC_MANAGER, cancel=ctx.cancel,
                         timeout_s=ENROL_TIMEOUT_S)
        self.ctx, self.spec = ctx, spec
        self.training = spec.local_training()
        self.setup = RoundSetup(model=spec.model, dataset=spec.data, partition=spec.partition, training=self.training)
        self.updates: queue.Queue[Inbound] = queue.Queue()
        self.estimates: dict[str, gather.Estimates] = {}
        self.previous_best: tuple[int, int] | None = None
        self.history: list[RoundRecord] = []
        self.refused = 0
        self.used: set[tuple[str, str]] = set()  # the (node, service) the job asked for, released when it ends
        # The closed loop: each device's measured compute over what its profiled speed predicts, and the scales the
        # rounds plan on (those that moved; ``_planned_speeds``).
        self.fit = ScaleFit(sliver=0.0, min_samples=MIN_FIT_ROUNDS)
        self.applied: dict[str, float] = {}
        # The first round planned on ``applied``: the rounds before it were predicted on other speeds, so a line
        # through them would count the change again (``refitted_s``).
        self.applied_since = 0
        self.base: dict[str, float] = {}  # what earlier jobs measured of each device, applied to its profiled speed
        self.measured = gather.Measured()
        # What the planner's model leaves out, as measured: each device's seconds before its first step (its first
        # round in the job may build more: 2-4x a later round's when it did not prepare, so those are a window of
        # their own, any device's, for the devices that have neither trained nor prepared) and the round's fixed
        # cost beyond its devices' rounds (``fixed_price``).
        self.setups: dict[str, deque[float]] = {}
        self.first_setups: deque[float] = deque(maxlen=FIXED_WINDOW)
        # Each device asked to prepare for the job (SplitPrepare): the setup it timed, None where it did not answer.
        self.prepared: dict[str, float | None] = {}
        self.fixed: deque[float] = deque(maxlen=FIXED_WINDOW)

    # --- the job: the skeleton's hooks ----------------------------------------------------------------

    def on_start(self) -> None:
        spec = self.spec
        self.ctx.on_data(self._on_data)
        torch.manual_seed(spec.seed)
        self.model = build_model(spec.model)
        self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.layout = layout_of(self.state)
        self.dataset, self.partition = partition_of(self.setup)
        self.round = self._resume(self.state)  # the next round to run
        self.had_mec = self.round > 0  # a resumed job's earlier rounds had one
        self.ctx.update("profiling", event=("profiling", f"measuring {spec.model.name}'s units at batch "
                                                         f"{self.training.batch_size}"))
        self.cost = model_cost(spec.model, self.training.batch_size, optimizer_states=1)

    def done(self) -> bool:
        return self.round >= self.spec.rounds

    def _view_with_a_mec(self) -> ClusterView:
        """The cluster view; once an earlier round of the job had a mec-manager, the view once one is online again,
        or after ``wait_s`` seconds without one: a restarted edge server imports torch before it says it is online,
        and a round should wait for it, not fail. (A job that never had one fails at once, naming what to start.)"""
        assert self.watcher is not None
        deadline = time.monotonic() + (self.spec.wait_s if self.had_mec else 0.0)
        view, _ = self.watcher.view()
        while not nodes_running(view, MEC_MANAGER) and time.monotonic() < deadline and not self.ctx.cancel.is_set():
            self.ctx.cancel.wait(0.2)
            view, _ = self.watcher.view()
        return view

    def step(self) -> None:
        """Run round ``self.round`` over the cluster as it is now (see the module's docstring)."""
        spec, ctx, r, setup = self.spec, self.ctx, self.round, self.setup
        view = self._view_with_a_mec()
        devices = [d for d in sorted(nodes_running(view, STAGE_WORKER)) if d not in spec.exclude]
        devices = devices[:spec.partition.devices]  # a device's partition is its index among these
        mecs = sorted(nodes_running(view, MEC_MANAGER))
        self.had_mec = self.had_mec or bool(mecs)
        if not mecs:
            raise JobError(f"job {spec.name}: no mec-manager is online; start an edge server "
                           "(edgeswarm up --local --edges 1)")
        if len(devices) < spec.participants:
            raise JobError(f"job {spec.name}: {len(devices)} devices are online, fewer than the {spec.participants} "
                           "participants a round needs")
        index = {d: i for i, d in enumerate(devices)}
        mec_of = gather.assign_mecs(devices, mecs)
        samples = {d: int(self.partition.sizes()[index[d]]) for d in devices}
        self._measure(devices, mecs, mec_of)
        self._prepare(devices, index, mec_of)
        started = time.monotonic()
        split_devices = gather.split_devices(view, devices, mec_of, samples, self.estimates, self._planned_speeds(),
                                             spec.memory_budget_bytes,
                                             setup_prices(devices, self.setups, self.prepared, self.first_setups))
        options = SplitOptions(
            participants=spec.participants, gamma=spec.gamma if spec.mode == "smartsplit" else 1.0, lam=spec.lam,
            tail=self.training.tail if self.training.mode == "usplit" else 0, epochs=self.training.epochs,
            latency_model="vanilla" if self.training.mode == "vanilla" else "usplit", solver=spec.solver,
            seed=spec.seed + r, fixed_cut=spec.fixed_cut if spec.mode == "splitfed" else None,
            local_only=spec.mode == "fedavg", previous_best=self.previous_best,
            overhead_bytes=input_bytes(spec.model, self.training.batch_size))
        ctx.update("planning")
        reply = self.ask_planner(SplitPlanRequest(model=self.cost, devices=split_devices,
                                                  mecs=gather.split_mecs(mecs, self.measured), options=options,
                                                  round=r), what=f"job {spec.name} round {r}")
        assert isinstance(reply, SplitPlanReply)
        selection = reply.selection
        self.previous_best = (selection.target_cut, selection.count)
        # Enrol the candidates: each takes its MEC's part and tensors for this round and no one else's.
        enrols = {c.node: SplitEnrol(job_id=spec.name, round=r, mec=c.mec, index=index[c.node], setup=setup,
                                     budget_bytes=spec.memory_budget_bytes, wait_s=spec.wait_s)
                  for c in selection.selected}
        fan = fan_out(self.bus, enrols, STAGE_WORKER, timeout_s=ENROL_TIMEOUT_S)
        self.used.update((n, STAGE_WORKER) for n in enrols)
        enrolled = [c for c in selection.selected if isinstance(fan.replies.get(c.node), SplitEnrolled)]
        left_out = sorted(set(enrols) - {c.node for c in enrolled})
        by_mec: dict[str, list[SplitCandidate]] = {}
        for c in enrolled:
            by_mec.setdefault(c.mec, []).append(SplitCandidate(node=c.node, cut=c.cut, index=index[c.node],
                                                               samples=samples[c.node]))
        names = sorted(by_mec)
        shares = quotas([len(by_mec[m]) for m in names], spec.participants)
        starts = {m: SplitRoundStart(job_id=spec.name, round=r, coordinator=ctx.node, setup=setup, candidates=by_mec[m],
                                     quota=k, epsilon=spec.epsilon if spec.mode == "smartsplit" else 1.0,
                                     seed=spec.seed * 7919 + r, estimator=spec.estimator, wait_s=spec.wait_s)
                  for m, k in zip(names, shares, strict=True) if k > 0}
        self.used.update((m, MEC_MANAGER) for m in starts)
        flat = flatten(self.state, self.layout)
        running = [m for m in starts if self._start_on(m, starts[m], flat)]
        ctx.update("running", plan=selection, event=("round_started", _describe(r, selection, running)))
        updates = self._collect(r, {m: starts[m] for m in running}, flat, selection)
        wan = self.layout.numel * 4 * (len(running) + self.restarts)
        self.state, record = self._aggregate(r, self.state, updates, selection, started, wan, left_out)
        self._learn(record, options)
        devices_s = max((u.devices_s for u, _ in updates.values()), default=0.0)
        if devices_s > 0:
            self.fixed.append(max(record.round_s - devices_s, 0.0))
        self.model.load_state_dict(self.state)
        accuracy, loss = held_out(self.model, self.dataset, batch_size=256)
        record = record.model_copy(update={"accuracy": accuracy, "loss": loss})
        self.history = (self.history + [record])[-MAX_ROUND_RECORDS:]
        metrics_record.round_done(self.bus.metrics, KIND, spec.name, record.round_s,
                                  sum(p.samples for p in record.participants))
        self._checkpoint(r, self.state)
        ctx.update("running", rounds_done=r + 1, rounds_total=spec.rounds, accuracy=accuracy, loss=loss,
                   refused=self.refused, history=self.history,
                   event=("round", _round_line(record)))
        self.round += 1

    def stop(self) -> None:
        """Say the job finished when every round ran, and release what it asked of every stage-worker and MEC."""
        if self.done():
            accuracy = _pct(self.history[-1].accuracy if self.history else None)
            self.ctx.update("running", event=("finished", f"{self.spec.rounds} rounds; held-out accuracy {accuracy}"))
        self._save_speeds()
        for node, service in sorted(self.used):
            try:
                self.bus.publish(topics.request(node, service), SplitRelease(job_id=self.name), qos=1)
            except BusError as exc:
                log.warning("job %s: could not release %s/%s: %s", self.name, node, service, exc)

    def _on_data(self, msg: Inbound) -> None:
        if isinstance(msg.body, SplitUpdate):
            self.updates.put(msg)

    # --- one round ------------------------------------------------------------------------------------

    def _start_on(self, mec: str, start: SplitRoundStart, flat: torch.Tensor) -> bool:
        """Start the round on ``mec``: its candidates, then the global weights. Whether it took the round."""
        fan = self.fan_out({mec: start})
        if not isinstance(fan.replies.get(mec), SplitEnrolled):
            log.warning("job %s round %d: %s did not take the round: %s", self.spec.name, start.round, mec,
                        fan.failures.get(mec) or fan.replies.get(mec))
            return False
        try:
            self.bus.send_tensor(mec, MEC_MANAGER, SplitGlobal(job_id=self.spec.name, round=start.round), flat)
        except EdgeswarmError as exc:
            log.warning("job %s round %d: the global weights did not reach %s: %s", self.spec.name, start.round, mec,
                        exc)
            return False
        return True

    def _collect(self, r: int, starts: dict[str, SplitRoundStart], flat: torch.Tensor,
                 selection: SplitSelection) -> dict[str, tuple[SplitUpdate, PartialSum | None]]:
        """Every running MEC's update of round ``r`` with its weighted sum (None when none of its devices trained).
        An MEC the failure detector confirms lost is given ``wait_s`` to come back, and then the round again (it
        resumes from its own checkpoint); one that does not is left out, and so is an update with NaN or infinite
        values (counted). Either way the MEC counts as a recovery."""
        mecs = list(starts)
        detector = self.detector
        assert detector is not None
        detector.watch(mecs)
        self.restarts = 0
        # An MEC answers even when its devices fail (each wait is bounded by wait_s): this bound is for an MEC that
        # hangs while it still sends heartbeats.
        give_up = time.monotonic() + self.spec.wait_s * 4 + 50 * max((c.round_s for c in selection.selected),
                                                                     default=1.0)
        got: dict[str, tuple[SplitUpdate, PartialSum | None]] = {}
        lost_at: dict[str, float] = {}
        instances: dict[str, str | None] = {m: detector.instance(m) for m in mecs}
        pending = set(mecs)
        while pending - set(got):
            self.check()
            now = time.monotonic()
            for m in sorted(pending - set(got)):
                current = detector.instance(m)
                if instances[m] is None:
                    instances[m] = current  # the first instance heard is the one the round started on
                # A restart can be quicker than the failure detector's confirmation (a forked service is back in
                # milliseconds): a new instance is one too.
                restarted = current is not None and current != instances[m]
                if detector.failed(m):
                    lost_at.setdefault(m, now)
                    if now - lost_at[m] > self.spec.wait_s:
                        log.warning("job %s round %d: %s is lost; the round goes on without its devices",
                                    self.spec.name, r, m)
                        pending.discard(m)
                        self.count_recovery(device_lost=True)
                elif m in lost_at or restarted:
                    confirmed = lost_at.pop(m, None) is not None
                    instances[m] = current
                    if self._start_on(m, starts[m], flat):
                        self.restarts += 1
                        self._came_back(r, m, confirmed=confirmed)
            if now > give_up:
                log.warning("job %s round %d: no update from %s in time", self.spec.name, r,
                            ", ".join(sorted(pending - set(got))))
                break
            try:
                msg = self.updates.get(timeout=POLL_S)
            except queue.Empty:
                continue
            body = msg.body
            assert isinstance(body, SplitUpdate)
            if body.round != r or body.mec not in mecs or msg.envelope.sender_node != body.mec or body.mec in got:
                log.info("job %s: dropped an update of round %d from %s", self.spec.name, body.round, msg.sender)
                continue
            if instances[body.mec] not in (None, msg.envelope.sender_instance):
                # Restarted and finished the round from its checkpoint before the detector heard the new instance.
                instances[body.mec] = msg.envelope.sender_instance
                self._came_back(r, body.mec, confirmed=lost_at.pop(body.mec, None) is not None)
            partial = None
            if body.count > 0:
                try:
                    sums = unflatten(msg.tensor.to_torch() if msg.tensor is not None else torch.zeros(0),
                                     self.layout, dtype=torch.float64)
                    partial = PartialSum(sums=sums, weight=float(body.samples), heaviest=float(body.heaviest),
                                         count=body.count)
                except EdgeswarmError as exc:
                    self.refused += 1
                    log.warning("job %s round %d: refused the update of %s: %s", self.spec.name, r, body.mec, exc)
            self.refused += body.refused
            got[body.mec] = (body, partial)
        return got

    def _came_back(self, r: int, mec: str, *, confirmed: bool) -> None:
        """``mec`` runs again as a new instance in round ``r``: an event, and a recovery counted (a lost device when
        its failure was ``confirmed``)."""
        self.ctx.update("running", event=("mec_restarted", f"round {r}: {mec} came back; it resumes the round "
                                                           "from its checkpoint"))
        self.count_recovery(device_lost=confirmed)

    def _aggregate(self, r: int, state: dict[str, torch.Tensor],
                   updates: dict[str, tuple[SplitUpdate, PartialSum | None]], selection: SplitSelection,
                   started: float, wan: int, left_out: list[str]) -> tuple[dict[str, torch.Tensor], RoundRecord]:
        """FedAvg of the MECs' weighted sums (the hierarchical form: each MEC summed its own devices), or the old
        weights when nobody trained; and the round's record."""
        total = FedAvg(state)
        for update, partial in updates.values():
            if partial is not None:
                try:
                    total.merge(partial, who=f"the update of {update.mec}")
                except UpdateRejectedError as exc:
                    self.refused += 1
                    log.warning("job %s round %d: refused %s", self.spec.name, r, exc)
        new_state = total.result() if total.count else state
        mec_of = {c.node: c.mec for c in selection.selected}
        participants = []
        for update, _ in updates.values():
            for rep in update.reports:
                participants.append(ParticipantRecord(node=rep.node, mec=update.mec, cut=rep.cut,
                                                      outcome=rep.outcome, peak_bytes=rep.peak_bytes, loss=rep.loss,
                                                      samples=rep.samples, recompute=rep.recompute,
                                                      iterations=rep.iterations, compute_s=rep.compute_s,
                                                      setup_s=rep.setup_s))
                if rep.dis is not None or rep.stat is not None:
                    old = self.estimates.get(rep.node)
                    self.estimates[rep.node] = gather.Estimates(
                        dis=rep.dis if rep.dis is not None else (old.dis if old else 0.0),
                        stat=rep.stat if rep.stat is not None else (old.stat if old else 0.0))
            wan += self.layout.numel * 4 if update.samples else 0  # the MEC's sum back (the global went out)
            if self.spec.mode in TWO_TIER:
                # The two-tier baselines have no MEC: their server is the cloud, so what the devices exchange with
                # it (whole models for FedAvg, every batch's activations and gradients for SplitFed) is WAN traffic.
                wan += update.lan_bytes
        lost_mecs = sorted(set(mec_of.values()) - set(updates))
        predicted = participants_s(selection, participants) + fixed_price(self.fixed, self.measured.links.values())
        record = RoundRecord(round=r, participants=participants, predicted_s=predicted,
                             refitted_s=refitted_s(self.history, predicted, since=self.applied_since),
                             round_s=time.monotonic() - started,
                             lan_bytes=sum(u.lan_bytes for u, _ in updates.values()), wan_bytes=wan,
                             refused=sum(u.refused for u, _ in updates.values()),
                             left_out=sorted(set(left_out) | {d for d, m in mec_of.items() if m in lost_mecs}))
        return new_state, record

    def _learn(self, record: RoundRecord, options: SplitOptions) -> None:
        """Each device that trained in ``record``: its measured compute over what its profiled speed predicts for its
        cut and iterations, into the fit (a device that recomputed, or whose round computes too little, is left
        out); its seconds before its first step, into its setup (from its second round in the job)."""
        predicted, measured = {}, {}
        costs = cut_costs(self.cost, options)
        for p in record.participants:
            if p.outcome == "trained":
                if p.node in self.setups:
                    self.setups[p.node].append(p.setup_s)
                else:  # its first round in the job: the part's first build, the data's first read
                    self.setups[p.node] = deque(maxlen=FIXED_WINDOW)
                    self.first_setups.append(p.setup_s)
            speed = self.measured.speeds.get(p.node)
            if p.outcome != "trained" or speed is None or p.compute_s <= 0 or p.recompute not in ("", "none"):
                continue
            mine = parties_costs(costs, self.cost, options, self.measured.shares.get(p.node, ()), ())
            seconds = device_compute_s(mine, p.cut, p.iterations, speed / self.base.get(p.node, 1.0))
            if seconds >= MIN_FIT_S:
                predicted[p.node], measured[p.node] = seconds, p.compute_s
        self.fit.add(predicted, measured)

    def _planned_speeds(self) -> gather.Measured:
        """What the round plans on: the profiled speeds over what earlier jobs measured and, where it moved and
        MIN_FIT_ROUNDS rounds measured it, each device's fitted scale (with the rebalance setting on); a ``refit``
        event when the fitted ones change."""
        if not self.bus.settings.rebalance:
            return self.measured
        moved = self.fit.moved()
        if moved.keys() != self.applied.keys() or not same_fit(self.applied, moved):
            self.applied, self.applied_since = moved, self.round
            said = (f"round {self.round} plans on the devices' speeds as measured: {speeds(moved)} (measured compute "
                    "over profiled)" if moved else f"round {self.round} plans on the profiled speeds again")
            self.ctx.update("running", event=("refit", said))
        return gather.Measured(speeds={n: s / (self.base.get(n, 1.0) * self.applied.get(n, 1.0))
                                       for n, s in self.measured.speeds.items()}, links=self.measured.links,
                              shares=self.measured.shares)

    def _started_from(self, nodes: list[str]) -> None:
        """The speeds earlier jobs saved for the newly measured ``nodes`` (with the rebalance setting on)."""
        cluster = self.measured.cluster(nodes)
        if not self.bus.settings.rebalance or cluster is None:
            return
        scales, _ = started_from(ProfileCache(self.bus.settings.profile_dir), cluster, "split")
        saved = {n: s for n, s in scales.items() if n in nodes}  # devices only: a link's saved scale is training's
        if saved:
            self.base.update(saved)
            self.ctx.update("profiling", event=("refit", f"starts from the speeds earlier jobs measured: "
                                                         f"{speeds(saved)}"))

    def _started_from_steps(self, steps: dict[str, float]) -> None:
        """Each device's step as it prepared (``steps``: seconds of the whole model's local iteration) over what its
        profiled speed prices it at, the scale its first rounds plan on, where no earlier job saved one (with the
        rebalance setting on): what an iteration pays beyond the forward and backward its profile timed (the loss,
        the optimizer's step, the part's own calls), which the closed loop fits only from its MIN_FIT_ROUNDS-th
        round on."""
        if not self.bus.settings.rebalance:
            return
        whole = sum(u.flops_fwd + u.flops_bwd for u in self.cost.units)
        seeded = step_scales({d: s for d, s in steps.items() if d not in self.base}, self.measured.speeds, whole)
        if seeded:
            self.base.update(seeded)
            self.ctx.update("profiling", event=("refit", f"starts from the steps the devices timed as they "
                                                         f"prepared: {speeds(seeded)}"))

    def _save_speeds(self) -> None:
        """Save each device's fitted scale over its profile for the next job (with the rebalance setting on)."""
        fitted = self.fit.scales()
        cluster = self.measured.cluster(sorted(fitted))
        if not self.bus.settings.rebalance or cluster is None:
            return
        said = save_measured(ProfileCache(self.bus.settings.profile_dir), cluster, self.base, fitted,
                             self.fit.rounds(), "split")
        if said:
            self.ctx.update(self.ctx.state().status, event=("refit", said))

    def _measure(self, devices: list[str], mecs: list[str], mec_of: dict[str, str]) -> None:
        """Profile the round's nodes and device-to-MEC links not measured yet. A node that cannot be measured now is
        left out of the round (the next round tries again)."""
        nodes, pairs = self.measured.missing(devices, mecs, mec_of)
        if not nodes and not pairs:
            return
        what = ([f"the speed of {', '.join(nodes)}"] if nodes else []) + (
            [f"the links {', '.join(f'{d}->{m}' for d, m in pairs)}"] if pairs else [])
        self.ctx.update("profiling", event=("profiling", f"round {self.round}: measuring {' and '.join(what)}"))
        started = time.monotonic()
        try:
            gather.measure(self.bus, self.spec.model, self.cost, self.measured, nodes, pairs, PROFILE_TIMEOUT_S)
            self._started_from(nodes)
            self.ctx.update("profiling", event=("profiling", f"round {self.round}: measured in "
                                                             f"{time.monotonic() - started:.1f} s"))
        except (ProfilerError, ProfileError) as exc:
            log.warning("job %s round %d: left out what could not be measured: %s", self.spec.name, self.round, exc)

    def _prepare(self, devices: list[str], index: dict[str, int], mec_of: dict[str, str]) -> None:
        """Have each of ``devices`` not asked yet, and each MEC for its new devices, prepare for the job
        (SplitPrepare: a device's throwaway step on its partition ``index[device]`` and its setup timed, the data-plane
        connections between each device and its MEC ``mec_of[device]``, and this coordinator's to the MECs), before
        the round's clock starts: the job's setup, as profiling is. A device that does not answer is planned without
        its timed setup."""
        new = [d for d in devices if d not in self.prepared]
        if not new:
            return
        self.ctx.update("profiling", event=("profiling", f"round {self.round}: preparing {', '.join(new)}"))
        mecs = sorted({mec_of[d] for d in new})
        reach(self.bus, ((mec, MEC_MANAGER) for mec in mecs))
        self._ask_to_prepare(MEC_MANAGER, {m: SplitPrepare(job_id=self.spec.name, setup=self.setup,
                                                           peers=[d for d in new if mec_of[d] == m]) for m in mecs})
        answers = self._ask_to_prepare(STAGE_WORKER, {d: SplitPrepare(job_id=self.spec.name, setup=self.setup,
                                                                      index=index[d], peers=[mec_of[d]]) for d in new})
        self.prepared.update({d: answers[d].setup_s if d in answers else None for d in new})
        self._started_from_steps({d: answers[d].step_s for d in new if d in answers and answers[d].step_s > 0})
        timed = sorted(v for v in (self.prepared[d] for d in new) if v is not None)
        if timed:
            said = (f"round {self.round}: {len(timed)} of {len(new)} devices prepared; a round's setup takes them "
                    f"{timed[0] * 1000:.0f}-{timed[-1] * 1000:.0f} ms")
            self.ctx.update("profiling", event=("profiling", said))

    def _ask_to_prepare(self, service: str, requests: dict[str, SplitPrepare]) -> dict[str, SplitPrepared]:
        """``requests`` (node -> SplitPrepare) to ``service`` at once: the nodes that answered SplitPrepared."""
        fan = fan_out(self.bus, requests, service, timeout_s=ENROL_TIMEOUT_S)
        answers = {n: r for n, r in fan.replies.items() if isinstance(r, SplitPrepared)}
        for node in sorted(set(requests) - set(answers)):
            log.warning("job %s: %s/%s did not prepare: %s", self.spec.name, node, service,
                        fan.failures.get(node) or fan.replies.get(node))
        return answers

    # --- checkpoints ----------------------------------------------------------------------------------

    def _checkpoint(self, r: int, state: dict[str, torch.Tensor]) -> None:
        """Save round ``r``'s global model as version r + 1: the whole model as one stage, with its layout, so
        ``edgeswarm export`` and a restarted coordinator read it. A store that cannot be reached costs the
        checkpoint, not the job."""
        store = self.ctx.store_node
        if not store:
            return
        try:
            save_checkpoint(self.bus, store, self.spec.name, stage_entry(0), r + 1,
                            {k: v.detach().cpu() for k, v in state.items()})
            save_layout(self.bus, store, self.spec.name, r + 1, [(0, len(self.cost.units))], model=self.spec.model,
                        extra={"round": str(r)})
        except CheckpointError as exc:
            log.warning("job %s: round %d's checkpoint was not saved: %s", self.spec.name, r, exc)

    def _resume(self, state: dict[str, torch.Tensor]) -> int:
        """The round to start from: after the last checkpointed round of a job an earlier coordinator left, whose
        weights are loaded into ``state``; 0 for a new job."""
        previous, store = self.ctx.previous, self.ctx.store_node
        if previous is None:
            return 0
        if not store:
            self.ctx.update("queued", event=("resumed", "a restarted coordinator runs the job again from round 0 "
                                                        "(no checkpoint store)"))
            return 0
        try:
            versions = list_checkpoints(self.bus, store, self.spec.name).get(self.spec.name, {}).get("layout", [])
            if not versions:
                self.ctx.update("queued", event=("resumed", "a restarted coordinator runs the job again from round 0 "
                                                            "(no round was checkpointed yet)"))
                return 0
            version = versions[-1]
            load_layout_meta(self.bus, store, self.spec.name, version)
            loaded = load_stage(self.bus, store, self.spec.name, 0, version)
        except CheckpointError as exc:
            self.ctx.update("queued", event=("resumed", f"a restarted coordinator runs the job again from round 0: "
                                                        f"its checkpoint cannot be read ({exc})"))
            return 0
        state.update({k: v.to(state[k].dtype) for k, v in loaded.items() if k in state})
        progress = previous.progress
        self.history = list(getattr(progress, "history", []))
        self.ctx.update("queued", event=("resumed", f"a restarted coordinator resumes after round {version - 1}"))
        return version


REFIT_WINDOW = 8  # the rounds the closed loop fits on: recent enough to follow a cluster that changes


def setup_prices(devices: list[str], own: Mapping[str, Sequence[float]], prepared: Mapping[str, float | None],
                 first: Sequence[float]) -> dict[str, float]:
    """What the planner prices each of ``devices``' seconds before its first step in a round at, as measured: the
    median of ``own`` (its rounds in the job after its first; a device in ``own`` has trained); before those, the
    setup it timed when it prepared (``prepared``: None where it did not answer); for a device that has neither and
    has not trained in the job yet, the median of ``first`` (the first rounds measured in the job, any device's: they
    build its part and read its data for the first time). Absent for a device with none of these."""
    out = {}
    for n in devices:
        mine, timed = own.get(n), prepared.get(n)
        if mine:
            out[n] = median(mine)
        elif timed is not None:
            out[n] = timed
        elif n not in own and first:
            out[n] = median(first)
    return out


def step_scales(steps: Mapping[str, float], speeds: Mapping[str, float], flops: float) -> dict[str, float]:
    """Each device's measured local step (``steps``, seconds) over what its profiled speed (``speeds``, FLOP/s)
    prices an iteration of ``flops`` FLOPs at, clipped to [MIN_SCALE, MAX_SCALE]; a device with no speed or no step
    is left out."""
    return {d: min(MAX_SCALE, max(MIN_SCALE, s * speeds[d] / flops)) for d, s in steps.items()
            if s > 0 and speeds.get(d, 0) > 0 and flops > 0}


def fixed_price(fixed: Sequence[float], links: Iterable[LinkProfile]) -> float:
    """A round's fixed cost beyond its devices' planned rounds (seconds): the coordinator's requests before the MECs
    start (the planner's, the enrolment, the start), the global model to the MECs and their sums back, the MECs'
    folding of their devices' models and the aggregation. The median of ``fixed``, what the rounds measured (each
    round less the longest of its MECs' ``devices_s``); before any, CONTROL_REQUESTS request round trips as the
    devices' profilers measured them (the median ``request_s`` over ``links``, their links to their MECs), the part
    the coordinator waits on; 0 with neither."""
    if fixed:
        return median(fixed)
    trips = [x.request_s for x in links if x.request_s > 0]
    return CONTROL_REQUESTS * median(trips) if trips else 0.0


def participants_s(selection: SplitSelection, participants: list[ParticipantRecord]) -> float:
    """The round ``selection`` planned, as it ran: the slowest planned round of the devices that trained (seconds).
    The planner prices every candidate it selects (``t_system_s``); with gamma > 1 the MECs' importance scheduling
    then trains only K of them, and a round whose slowest candidate was not picked takes a fraction of T_system.
    ``t_system_s`` when no planned device trained."""
    trained = {p.node for p in participants if p.outcome == "trained"}
    times = [c.round_s for c in selection.selected if c.node in trained]
    return max(times) if times else selection.t_system_s


def refitted_s(history: list[RoundRecord], predicted_s: float, since: int = 0) -> float | None:
    """A round the planner predicts at ``predicted_s`` seconds, as the measured rounds of ``history`` say it takes:
    a robust line (``stats.affine_fit``) through the last REFIT_WINDOW rounds' predicted and measured times, whose
    intercept is the fixed per-round cost the planner's model leaves out (the planner's request, enrolment, the
    round start and the aggregation) and whose slope is how much slower than estimated the devices and links ran.
    Round 0 is left out (its devices build and warm up), and so are rounds before ``since`` (planned on speeds the
    closed loop has since replaced: their gap is in the prediction now); None before such a round is measured."""
    past = [h for h in history if h.round > 0 and h.round >= since and h.predicted_s > 0 and h.round_s > 0]
    past = past[-REFIT_WINDOW:]
    fit = affine_fit([h.predicted_s for h in past], [h.round_s for h in past])
    return None if fit is None else fit[0] * predicted_s + fit[1]


def _round_line(record: RoundRecord) -> str:
    """A finished round for people: each participant's cut, measured peak training memory and loss, then the
    aggregated model's held-out accuracy and loss."""
    parts = []
    for p in record.participants:
        if p.outcome == "trained":
            loss = f", loss {p.loss:.3f}" if p.loss is not None else ""
            parts.append(f"{p.node} cut {p.cut} ({p.peak_bytes / 2**20:.2f} MiB peak{loss})")
        elif p.outcome != "skipped":
            parts.append(f"{p.node} {p.outcome}")
    return (f"round {record.round}: {'; '.join(parts) or 'nobody trained'}; held-out accuracy "
            f"{_pct(record.accuracy)}, loss {record.loss:.4f}; {record.round_s:.1f} s")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _describe(r: int, selection: SplitSelection, mecs: list[str]) -> str:
    cuts = ", ".join(f"{c.node}@{c.cut}" for c in selection.selected)
    return (f"round {r}: {len(selection.selected)} candidates ({cuts}) on {len(mecs)} MEC(s), predicted "
            f"{selection.t_system_s:.2f} s")
