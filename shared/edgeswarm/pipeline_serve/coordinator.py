"""The coordinator's program for a serving job: deploy the pipeline, stream requests through it, survive a loss.

The job profiles the online stage-workers for its model at its micro-batch size, asks the planner service for a
ServePlan and deploys each stage (ServeAssign). From then on it takes InferRequest frames on the coordinator's
data topic: each is checked (dtype, sample shape, rows) and queued, at most ``spec.queue`` of them and
MAX_QUEUED_BYTES of inputs, one caller node at most half of each (``edgeswarm.shares``: one member flooding the job
cannot crowd out the others' requests; a request beyond is answered ``busy``). A dispatcher batches queued requests into
pipeline items of at most ``micro_batch_size`` samples and sends each to the first stage, with at most
``spec.window`` items in the pipeline: a full window holds requests in the queue, so memory never grows with the
load. The last stage sends each item's
outputs back; they are split per request and answered on each caller's reply topic (InferReply frames).

Exactly once: an item stays in flight until its outputs come back from the last stage of the current plan epoch;
outputs of another epoch, or of an item already answered, are dropped. When the failure detector confirms a stage
device lost (or the pipeline stalls), the job re-plans over the surviving devices, deploys the new plan as a new
epoch, and sends every unanswered item again, in order, so each request is answered once. A cancelled job answers
what it still holds with InferError ``not_serving`` and releases its stages.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgeswarm.bus import Inbound
from edgeswarm.coordination.planner_client import PLANNER_BUSY_PAUSE_S, PLANNER_NODE
from edgeswarm.errors import EdgeswarmError, JobError, ProfileError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.planning import ServePlanReply, ServePlanRequest
from edgeswarm.messages.serving import (
    InferErrorReason,
    InferReply,
    InferRequest,
    ServeAssign,
    ServeReady,
    ServeRelease,
    ServeTensor,
    WeightsSource,
)
from edgeswarm.observability import record
from edgeswarm.pipeline_serve.spec import ServeSpec
from edgeswarm.planning.refit import ClosedLoop, RefitPricing, link_fit_inputs, scaled
from edgeswarm.planning.serve.load import at_measured_load
from edgeswarm.planning.serve.plan import plan_serving
from edgeswarm.planning.serve.refit import predicted_compute_s, reprice
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.profiling.cache import ProfileCache
from edgeswarm.profiling.gather import profile_cluster
from edgeswarm.profiling.refits import save_measured, started_from
from edgeswarm.runtime.senders import count_stranger, stranger
from edgeswarm.service_registry import STAGE_WORKER
from edgeswarm.stats import percentile
from edgeswarm.values.profiles import ClusterProfile, LinkSample
from edgeswarm.wire import Message
from edgeswarm.workloads.base import JobContext
from edgeswarm.workloads.serving import QueuedRequest, ServingProgram

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

STALL_S = 30.0  # an item in flight this long with no device confirmed lost: re-deploy and replay anyway
RECENT = 2048  # answers the latency percentiles and the throughput are measured over
THROUGHPUT_WINDOW_S = 10.0
MAX_QUEUED_BYTES = 256 << 20  # inputs waiting for the window, whatever the spec's queue says: beyond, ``busy``


@dataclass
class _Request(QueuedRequest):
    inputs: torch.Tensor


@dataclass
class _Item:
    requests: list[_Request]
    inputs: torch.Tensor
    replayed: bool = False

    @property
    def rows(self) -> int:
        return int(self.inputs.shape[0])


@dataclass
class _Stats:
    answered: int = 0
    samples: int = 0
    replayed: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    done_at: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RECENT))  # (monotonic, rows)
    arrived_at: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RECENT))  # (monotonic, rows)


def _rate(events: deque[tuple[float, int]], now: float) -> float | None:
    """Rows a second over the (monotonic time, rows) events of the last THROUGHPUT_WINDOW_S seconds (the first one
    opens the span); None for fewer than two."""
    recent = [(t, rows) for t, rows in events if now - t <= THROUGHPUT_WINDOW_S]
    span = (now - recent[0][0]) if len(recent) > 1 else 0.0
    return sum(rows for _, rows in recent[1:]) / span if span > 0 else None


class PipelineRunner(ServingProgram[ServePlan, _Request]):
    """One serving job on the coordinator (see the module's docstring), on the serving skeleton."""

    ready = ServeReady
    release = ServeRelease
    part = "stage"
    plan_noun = "serving plan"
    too_large_advice = "In the job file: use a smaller micro_batch_size, or exclude devices (planner.exclude)"

    def __init__(self, ctx: JobContext, spec: ServeSpec, *, worker_service: str = STAGE_WORKER,
                 planner_node: str = PLANNER_NODE, busy_pause_s: float = PLANNER_BUSY_PAUSE_S) -> None:
        from edgeswarm.models.zoo import example_input

        super().__init__(ctx, spec, worker_service=worker_service, planner_node=planner_node,
                         busy_pause_s=busy_pause_s, queue_bytes=MAX_QUEUED_BYTES)
        self.spec: ServeSpec = spec
        sample = example_input(spec.model, 1)
        self.input_dtype = str(sample.dtype).removeprefix("torch.")
        self.input_shape = tuple(sample.shape[1:])
        self.weights: WeightsSource | None = None
        self._inflight: OrderedDict[int, _Item] = OrderedDict()
        self._next_item = 0
        self._stats = _Stats()
        # The closed loop (planning.refit): each stage device's measured forward of a full micro-batch against its
        # profile; re-plans only with the rebalance setting on.
        self.refit_loop = ClosedLoop(RefitPricing(
            reprice, lambda _plan, profile: plan_serving(profile, self.spec.options()), scaled),
            cost=lambda plan: plan.bottleneck_s)
        self.base_scales: dict[str, float] = {}  # what earlier jobs measured, applied to the profile (``measure``)
        # (plan epoch, profiled forward per device, the same without the call's cold cost)
        self._predicted: tuple[int, dict[str, float], dict[str, float]] = (-1, {}, {})

    # --- the job: the serving skeleton's hooks ----------------------------------------------------------

    def measure(self, nodes: list[str]) -> ClusterProfile:
        """The devices' profiles, each scaled by what earlier serving jobs measured of it (with the closed loop on)."""
        self.ctx.update("profiling", event=("profiling", f"profiling {self.spec.model.name} on {', '.join(nodes)}"))
        cluster = profile_cluster(self.bus, self.spec.model, [self.spec.micro_batch_size], nodes=nodes,
                                  timeout_s=self.ctx.timeout_s)
        if not self.closed_loop:
            return cluster
        self.base_scales, said = started_from(ProfileCache(self.bus.settings.profile_dir), cluster, "serve")
        if said:
            self.ctx.update("profiling", event=("refit", said))
        return scaled(cluster, self.base_scales)

    def stop(self) -> None:
        """Stop serving, and save what the job measured of each stage device's speed (with the closed loop on)."""
        fitted = self.refit_loop.measured()
        if self.closed_loop and self.cluster is not None and fitted:
            said = save_measured(ProfileCache(self.bus.settings.profile_dir), self.cluster, self.base_scales, fitted,
                                 self.refit_loop.rounds(), "serve")
            if said:
                self.ctx.update(self.ctx.state().status, event=("refit", said))
        super().stop()

    def plan_request(self, cluster: ClusterProfile, epoch: int) -> Message:
        if self.closed_loop:  # a re-plan after a loss prices the devices as they were measured
            cluster = scaled(cluster, self.refit_loop.scales())
        return ServePlanRequest(cluster=cluster, options=self.spec.options(), epoch=epoch)

    def gain(self, current: ServePlan, best: ServePlan) -> str:
        return (f"the running plan would serve {current.throughput_per_s:.1f} samples/s, the new one "
                f"{best.throughput_per_s:.1f} ({current.bottleneck_s / best.bottleneck_s - 1:.0%} more)")

    def plan_from(self, reply: Message) -> ServePlan:
        assert isinstance(reply, ServePlanReply)
        return reply.plan

    def on_planned(self, plan: ServePlan) -> None:
        self.weights = self._weights_source()
        super().on_planned(plan)

    def describe(self, plan: ServePlan) -> str:
        return (f"{len(plan.stages)} stages on {', '.join(plan.devices)}: {plan.throughput_per_s:.1f} samples/s and "
                f"{plan.latency_s * 1000:.1f} ms per micro-batch of {self.spec.micro_batch_size} predicted "
                f"({plan.method}), window {self.spec.window}")

    def plan_fields(self, plan: ServePlan) -> dict[str, Any]:
        return {"predicted_throughput_per_s": plan.throughput_per_s, "predicted_latency_s": plan.latency_s,
                "weights": _describe(self.weights)}

    def assignments(self, plan: ServePlan) -> dict[str, Message]:
        spec = self.spec
        return {s.device: ServeAssign(job_id=spec.name, epoch=plan.epoch, stage=s.index, model=spec.model,
                                      start=s.start, end=s.end, devices=plan.devices, coordinator=self.ctx.node,
                                      micro_batch_size=spec.micro_batch_size, weights=self.weights)
                for s in plan.stages}

    def stalled(self) -> str | None:
        """Whether the oldest item in flight has waited past STALL_S (beyond the plan's latency) for its outputs."""
        with self._changed:
            if self._plan is None or not self._inflight:
                return None
            oldest = next(iter(self._inflight.values()))
            waited = time.monotonic() - min(r.arrived for r in oldest.requests)
            stalled = waited > STALL_S + self._plan.latency_s
        return f"an item took longer than {STALL_S:.0f} s" if stalled else None

    def replay(self, plan: ServePlan, epoch: int) -> str:
        """Send every unanswered item again, in the order it was first sent, numbered afresh in epoch ``epoch``."""
        with self._changed:
            items = list(self._inflight.values())
            self._inflight = OrderedDict((k, item) for k, item in enumerate(items))
            for item in items:
                item.replayed = True
            self._epoch, self._next_item = epoch, len(items)
            self._stats.replayed += len(items)
        record.replayed(self.bus.metrics, self.spec.name, len(items))
        for k, item in enumerate(items):
            self._send(plan, epoch, k, item)
        return f"{len(items)} items replayed"

    def held(self) -> list[_Request]:
        requests = [r for item in self._inflight.values() for r in item.requests]
        self._inflight.clear()
        return requests

    # --- the checkpoint the weights come from ------------------------------------------------------

    def _weights_source(self) -> WeightsSource | None:
        """The checkpoint the spec's weights name, with the unit range of each of its stages."""
        from edgeswarm.checkpoints.client import list_checkpoints
        from edgeswarm.state.layout import LAYOUT, load_layout

        weights, store = self.spec.weights, self.ctx.store_node
        if weights is None:
            return None
        if store is None:
            raise JobError(f"job {self.spec.name}: weights from job {weights.job} need a checkpoint store")
        version = weights.version
        try:
            if version == "latest":
                versions = list_checkpoints(self.bus, store, weights.job).get(weights.job, {}).get(LAYOUT, [])
                if not versions:
                    raise JobError(f"job {self.spec.name}: the checkpoint store on {store} has no version of job "
                                   f"{weights.job}; train it first, or leave weights out to serve a fresh model")
                version = max(versions)
            stages = load_layout(self.bus, store, weights.job, version)
        except EdgeswarmError as exc:
            if isinstance(exc, JobError):
                raise
            raise JobError(f"job {self.spec.name}: cannot read version {version} of job {weights.job} from the "
                           f"checkpoint store on {store}: {exc}") from None
        return WeightsSource(store_node=store, job_id=weights.job, version=version, stages=stages)

    # --- requests in, items through, answers out ---------------------------------------------------

    def on_data(self, msg: Inbound) -> None:
        """An InferRequest from a caller, or a ServeTensor of outputs from the last stage (bus threads)."""
        if isinstance(msg.body, ServeTensor):
            self._on_outputs(msg, msg.body)
        elif isinstance(msg.body, InferRequest):
            self._on_request(msg, msg.body)

    def _on_request(self, msg: Inbound, body: InferRequest) -> None:
        problem = self._request_problem(msg)
        if problem is not None:
            self.refuse(msg, body.request_id, *problem)
            return
        assert msg.tensor is not None
        request = _Request(msg=msg, request_id=body.request_id, arrived=time.monotonic(),
                           inputs=msg.tensor.to_torch())
        with self._changed:
            self._stats.arrived_at.append((request.arrived, int(request.inputs.shape[0])))
        self.admit(request, _nbytes(request.inputs))

    def _request_problem(self, msg: Inbound) -> tuple[InferErrorReason, str] | None:
        tensor = msg.tensor
        if tensor is None:
            return "no_tensor", "an InferRequest carries its inputs as a tensor (docs/wire-format.md)"
        if tensor.dtype != self.input_dtype:
            return "bad_dtype", f"inputs of {self.spec.model.name} are {self.input_dtype}, not {tensor.dtype}"
        shape = tuple(tensor.shape)
        if len(shape) != len(self.input_shape) + 1 or shape[1:] != self.input_shape:
            return "bad_shape", (f"inputs must be [rows, {', '.join(map(str, self.input_shape))}], "
                                 f"not {list(shape)}")
        if not 1 <= shape[0] <= self.spec.micro_batch_size:
            return "too_large", (f"a request carries 1 to {self.spec.micro_batch_size} samples (the job's "
                                 f"micro_batch_size), not {shape[0]}: split it")
        return None

    def dispatch(self) -> None:
        """Batch queued requests into items and send them to the first stage while the window has room."""
        import torch

        while True:
            with self._changed:
                while not self._stopped and (self._plan is None or not self._queue or
                                             len(self._inflight) >= self.spec.window):
                    self._changed.wait(1.0)
                if self._stopped:
                    return
                requests, rows, now = [], 0, time.monotonic()
                while self._queue and rows + self._queue[0].inputs.shape[0] <= self.spec.micro_batch_size:
                    request = self._queue.popleft()
                    record.request_dispatched(self.bus.metrics, self.spec.name, now - request.arrived)
                    self._callers.release(request.caller, _nbytes(request.inputs))
                    requests.append(request)
                    rows += int(request.inputs.shape[0])
                item = _Item(requests, torch.cat([r.inputs for r in requests]))
                plan, epoch, number = self._plan, self._epoch, self._next_item
                self._inflight[number] = item
                self._next_item += 1
            self._send(plan, epoch, number, item)

    def _send(self, plan: ServePlan, epoch: int, number: int, item: _Item) -> None:
        try:
            self.bus.send_tensor(plan.devices[0], self.worker_service, ServeTensor(
                job_id=self.spec.name, epoch=epoch, item=number, stage=0), item.inputs)
        except EdgeswarmError as exc:
            # The item stays in flight: the failure detector (or the stall check) replays it on a new plan.
            _limited.warning("send", "job %s: item %d of epoch %d not sent to %s: %s", self.spec.name, number,
                             epoch, plan.devices[0], exc)

    def _on_outputs(self, msg: Inbound, body: ServeTensor) -> None:
        with self._changed:
            plan = self._plan
            last = plan.devices[-1] if plan is not None else None
            foreign = last is not None and stranger(msg, last, "") is not None
            current = (plan is not None and body.epoch == self._epoch and body.stage == len(plan.stages)
                       and not foreign)
            item = self._inflight.get(body.item) if current else None
            tensor = msg.tensor
            ok = item is not None and tensor is not None and tensor.shape[:1] == (item.rows,)
            if ok:
                del self._inflight[body.item]
                self._changed.notify_all()
        if not ok:
            self.bus.metrics.count("serve_outputs_dropped")
            if foreign:
                count_stranger(self.bus.metrics)
            _limited.warning("outputs", "job %s: dropped outputs of item %d (epoch %d, stage %d) from %s: not an "
                             "item in flight of the current plan's last stage", self.spec.name, body.item, body.epoch,
                             body.stage, msg.sender)
            return
        assert item is not None and tensor is not None
        if plan is not None and item.rows == self.spec.micro_batch_size and len(body.compute_s) == len(plan.stages):
            self._refit(plan, body)
        outputs = tensor.to_torch()
        start, now = 0, time.monotonic()
        for request in item.requests:
            rows = int(request.inputs.shape[0])
            record.request_answered(self.bus.metrics, self.spec.name, now - request.arrived)
            reply = InferReply(job_id=self.spec.name, request_id=request.request_id, latency_s=now - request.arrived,
                               epoch=body.epoch, replayed=item.replayed)
            try:
                self.bus.reply_tensor(request.msg, reply, outputs[start:start + rows])
            except EdgeswarmError as exc:
                _limited.warning("answer", "job %s: could not answer %s: %s", self.spec.name, request.msg.sender,
                                 exc)
            start += rows
        with self._changed:
            stats = self._stats
            stats.answered += len(item.requests)
            stats.samples += item.rows
            stats.latencies.extend(now - r.arrived for r in item.requests)
            stats.done_at.append((now, item.rows))

    def _refit(self, plan: ServePlan, body: ServeTensor) -> None:
        """One full micro-batch's measurements into the fit: each stage's forward (seconds, in stage order) and how
        its input arrived from the stage before (a sample whose sender is not that stage's is no link of the plan's:
        left out)."""
        assert self.cluster is not None
        with self._changed:
            if self._predicted[0] != plan.epoch:
                try:
                    self._predicted = (plan.epoch, predicted_compute_s(plan, self.cluster),
                                       predicted_compute_s(plan, self.cluster, cold=False))
                except KeyError:  # a device of the plan no longer in the profile: nothing to compare with
                    self._predicted = (plan.epoch, {}, {})
            predicted, units = self._predicted[1], self._predicted[2]
        senders = {before.device: after.device for before, after in zip(plan.stages, plan.stages[1:], strict=False)}
        received: dict[str, list[LinkSample]] = {}
        for sample in body.arrivals:
            if sample.src in senders:
                received.setdefault(senders[sample.src], []).append(sample)
        try:
            links = link_fit_inputs(self.cluster, received, min_s=0.0)  # the loop sums a link's items
        except ProfileError:  # a pair of the plan's devices with no link measurement: nothing to compare with
            links = None
        self.refit_loop.add(predicted, {s.device: t for s, t in zip(plan.stages, body.compute_s, strict=True)},
                            links, units)

    def progress(self) -> dict[str, Any]:
        """The progress fields of the job's state now (see ServeProgress)."""
        priced = self.refitted()
        with self._changed:
            s = self._stats
            latencies = sorted(s.latencies)
            now = time.monotonic()
            offered = _rate(s.arrived_at, now)
            plan = self._plan
            # Requests the coordinator holds: the pipeline's items and the queue's requests (a request is one item
            # when, as usual, it fills a micro-batch).
            held = len(self._inflight) + len(self._queue)
            at_load = (at_measured_load(plan, offered, held, self.spec.window)
                       if plan is not None and offered else None)
            return {"answered": s.answered, "samples": s.samples, "errors": self._errors, "replayed": s.replayed,
                    "in_flight": len(self._inflight), "queued": len(self._queue),
                    "reconfigurations": self._reconfigurations,
                    "throughput_per_s": _rate(s.done_at, now), "offered_per_s": offered, "at_load": at_load,
                    "latency_p50_s": percentile(latencies, 0.50), "latency_p99_s": percentile(latencies, 0.99),
                    "refitted_throughput_per_s": priced.current.throughput_per_s if priced is not None else None}


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def _describe(weights: WeightsSource | None) -> str:
    return f"job {weights.job_id} version {weights.version}" if weights else "fresh from the model's seed"
