"""The stage-worker's program for serving jobs: one forward-only pipeline stage per job, any number of jobs.

A ServeAssign builds units [start, end) of the zoo model (from the model's seed, or loading a training job's
checkpoint), in evaluation mode, after reserving its weights and buffers, measured on torch's meta device, in the
node's memory ledger (``runtime.ledger``) beside every other job on the node: idle training jobs give way, else the
assignment is refused naming what holds the memory. ServeRelease, a failed assignment and closing give it back.
Items of the job arrive as ServeTensor frames numbered from 0 in each plan epoch; the stage's thread takes them in
order through the library's TensorExchange, runs the forward pass under ``torch.inference_mode`` as its device class
(``DeviceProfile.run``), and sends the result to the next stage's device (the last stage: to the coordinator). The
coordinator's window bounds the items in flight, and the stage holds at most ``MAX_PENDING`` items beyond the one it
computes: more is dropped and counted, never held. A newer assignment of the same job replaces its stage;
ServeRelease drops it. Items of another epoch, from a device that is not the previous stage, or of the wrong dtype
or shape are dropped with a rate-limited log line and a counter.

The module lives on the worker's compute device (``WorkerContext.compute``): it is built and loaded on the CPU, then
moved; items reach it through the exchange, which moves them there, and results leave it at the wire.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from edgeswarm.errors import EdgeswarmError, MemoryBudgetError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.serving import MAX_STAGE_S, ServeAssign, ServeReady, ServeRelease, ServeTensor
from edgeswarm.runtime.exchange import ExchangeAborted, ExchangeTimeout, TensorExchange, tensor_problem
from edgeswarm.runtime.program import JobTable, build_failure
from edgeswarm.runtime.senders import count_stranger, stranger
from edgeswarm.values.profiles import LinkSample
from edgeswarm.wire import Message

if TYPE_CHECKING:
    from edgeswarm.bus import Inbound

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

MIB = 1 << 20
MAX_PENDING = 64  # items a stage holds beyond the one it computes (the coordinator's window is far smaller)
IDLE_WAIT_S = 1.0  # how often an idle stage looks whether it was released
PROGRAM = "serving"  # this program's name in the node's memory ledger


class ServeKey(NamedTuple):
    """Item ``item`` of plan epoch ``epoch``: the epoch is the scope (a re-plan gives every item a new one)."""

    epoch: int
    item: int

    @property
    def scope(self) -> int:
        return self.epoch

    def __str__(self) -> str:
        return f"item {self.item} of epoch {self.epoch}"


@dataclass
class _Stage:
    spec: ServeAssign
    module: Any  # torch.nn.Module, in evaluation mode
    in_dtype: str
    in_shape: tuple[int, ...]  # one sample's input to this stage
    static_bytes: int
    exchange: TensorExchange[ServeKey]
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    items: int = 0
    compute_s: float = 0.0  # seconds in the forward pass (the device's emulated time included)
    # Each waiting item's measurements on the stages before (ServeTensor.compute_s and .arrivals, this stage's
    # arrival among them), passed on with its outputs.
    upstream: dict[int, tuple[list[float], list[LinkSample]]] = field(default_factory=dict)

    @property
    def last(self) -> bool:
        return self.spec.stage == len(self.spec.devices) - 1

    @property
    def source(self) -> str:
        """The node this stage's items come from: the previous stage's device, or the coordinator."""
        return self.spec.devices[self.spec.stage - 1] if self.spec.stage else self.spec.coordinator

    def close(self) -> None:
        self.stop.set()
        self.exchange.close(timeout_s=1.0)
        if self.items:
            log.info("serving job %s epoch %d: stage %d computed %d items, %.1f ms each, and waited %.1f s for them",
                     self.spec.job_id, self.spec.epoch, self.spec.stage, self.items, 1000 * self.compute_s / self.items,
                     self.exchange.blocked_s)


class ServeStageProgram(JobTable[_Stage]):
    """The serving stages this worker holds, by job id (see the module's docstring)."""

    handles: tuple[type[Message], ...] = (ServeAssign, ServeRelease)
    tensors: tuple[type[Message], ...] = (ServeTensor,)
    ledger_name = PROGRAM
    refusal_counter = "serve_failed"

    # --- requests -----------------------------------------------------------------------------------

    def on_request(self, msg: Inbound) -> None:
        body = msg.body
        if isinstance(body, ServeRelease):
            with self._lock:
                stage = self._jobs.pop(body.job_id, None)
            if stage is not None:
                log.info("serving job %s: released stage %d", body.job_id, stage.spec.stage)
                stage.close()
                self.ctx.ledger.release(PROGRAM, body.job_id)
            return
        assert isinstance(body, ServeAssign)
        # Building (and loading weights from the store) runs apart from the request topic's thread.
        threading.Thread(target=self._assign, args=(msg, body), name="serve-assign", daemon=True).start()

    def _assign(self, msg: Inbound, spec: ServeAssign) -> None:
        started = time.monotonic()
        with self._lock:
            old = self._jobs.get(spec.job_id)
        if old is not None:
            old.exchange.retire(f"serving job {spec.job_id} re-planned to epoch {spec.epoch}")
        try:
            stage = self._build(spec)
        except Exception as exc:  # noqa: BLE001 - the requester must hear of it rather than wait out its timeout
            self._unreserve(spec.job_id)
            self.refuse(msg, spec.job_id, *build_failure(exc, f"building serving stage {spec.stage} of job "
                                                              f"{spec.job_id}", log))
            return
        with self._lock:
            old = self._jobs.get(spec.job_id)
            self._jobs[spec.job_id] = stage
        if old is not None:
            old.close()
        stage.thread = threading.Thread(target=self._serve, args=(stage,), name=f"serve-{spec.job_id}", daemon=True)
        stage.thread.start()
        params = sum(p.numel() for p in stage.module.parameters())
        log.info("serving job %s epoch %d: stage %d holds units [%d, %d) (%d parameters)", spec.job_id, spec.epoch,
                 spec.stage, spec.start, spec.end, params)
        self.ctx.bus.reply(msg, ServeReady(job_id=spec.job_id, epoch=spec.epoch, stage=spec.stage, parameters=params,
                                           memory_bytes=stage.static_bytes, load_s=time.monotonic() - started))

    def _build(self, spec: ServeAssign) -> _Stage:
        from edgeswarm.models.footprint import stage_footprint
        from edgeswarm.pipeline_serve.compute import build_stage, load_weights

        budget = self.ctx.device.memory_budget_bytes
        with self.ctx.gate.building():
            footprint = stage_footprint(spec.model, spec.start, spec.end)
            static = footprint.weights_bytes + footprint.buffers_bytes
            if static > budget:
                raise MemoryBudgetError(
                    f"serving stage {spec.stage} (units [{spec.start}, {spec.end})) needs {static / MIB:.1f} MiB "
                    f"for its weights and buffers, but {self.ctx.node} ({self.ctx.device.device_class}) has a "
                    f"memory budget of {budget / MIB:.1f} MiB")
            # Before any weight exists: beside every other job on the node (training's too), or idle training jobs
            # give way (the ledger's policy), or the assignment is refused naming what holds the memory.
            self.ctx.ledger.reserve(
                PROGRAM, spec.job_id, static, service=self.ctx.service,
                what=f"serving job {spec.job_id} (stage {spec.stage}, units [{spec.start}, {spec.end}))",
                refusal=f"serving stage {spec.stage} (units [{spec.start}, {spec.end})) needs {static / MIB:.1f} MiB "
                        "for its weights and buffers")
            built = build_stage(spec, self.ctx.device)
        if spec.weights is not None:
            load_weights(self.ctx.bus, spec, built)
        module = built.module.to(self.ctx.compute)
        service = "coordinator" if spec.stage == len(spec.devices) - 1 else self.ctx.service
        exchange: TensorExchange[ServeKey] = TensorExchange(self.ctx.bus, service, wait_s=IDLE_WAIT_S,
                                                            name=f"serving job {spec.job_id}", scope_name="epoch",
                                                            compute=self.ctx.compute)
        return _Stage(spec, module, built.in_dtype, built.in_shape, static, exchange)

    def _unreserve(self, job_id: str) -> None:
        """After an assignment of ``job_id`` failed: its reservation goes back to what the stage still held for the
        job needs, or goes."""
        with self._lock:
            stage = self._jobs.get(job_id)
        self.ctx.ledger.release(PROGRAM, job_id)
        if stage is not None:
            self.ctx.ledger.grow(PROGRAM, job_id, stage.static_bytes)

    # --- items --------------------------------------------------------------------------------------

    def on_tensor(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, ServeTensor)
        with self._lock:
            stage = self._jobs.get(body.job_id)
        why = _refusal(stage, body, msg)
        if why is not None:
            self.ctx.metrics.count("serve_items_dropped")
            if stage is not None and stranger(msg, stage.source, "") is not None:
                count_stranger(self.ctx.metrics)
            _limited.log(logging.ERROR, "serve_item", "dropped %s", why)
            return
        assert stage is not None and msg.tensor is not None
        if len(stage.upstream) < 2 * MAX_PENDING:  # items are taken in order: more waiting is no item of ours
            arrival = msg.tensor.arrival
            mine = [] if arrival is None or arrival.chunks < 1 else [LinkSample(
                src=msg.envelope.sender_node, bytes=arrival.nbytes, chunks=arrival.chunks, seconds=arrival.seconds)]
            stage.upstream[body.item] = (body.compute_s[:stage.spec.stage],
                                         [*body.arrivals[:stage.spec.stage], *mine])
        stage.exchange.put(ServeKey(body.epoch, body.item), msg.tensor.to_torch())

    def _serve(self, stage: _Stage) -> None:
        """Take the epoch's items in order, compute each, send it on; ends when the stage is replaced or released."""
        from edgeswarm.pipeline_serve.compute import forward

        spec = stage.spec
        peer = spec.coordinator if stage.last else spec.devices[spec.stage + 1]
        item = 0
        # Each item's forward on the stage's lane (its number as the span's micro-batch, with its samples), its send
        # on the link's.
        lane = self.ctx.tracer.lane(spec.job_id, f"stage {spec.stage}")
        link = lane.on(f"link {spec.stage}→{spec.stage + 1}")
        while not stage.stop.is_set():
            try:
                x = stage.exchange.wait(ServeKey(spec.epoch, item))
            except ExchangeTimeout:
                continue  # idle: no request is in the pipeline
            except ExchangeAborted:
                return
            except EdgeswarmError as exc:
                _limited.log(logging.ERROR, "serve_wait", "serving job %s: %s", spec.job_id, exc)
                return
            try:
                started = time.perf_counter()
                with self.ctx.gate.computing():
                    out = forward(stage.module, x, self.ctx.device, self.ctx.compute)
                ended = time.perf_counter()
                lane.add("forward", "compute", started, ended, micro_batch=item, samples=int(x.shape[0]))
                stage.compute_s += ended - started
                stage.items += 1
                times, arrivals = stage.upstream.pop(item, ([], []))
                stage.exchange.send(peer, spec.epoch, ServeTensor(
                    job_id=spec.job_id, epoch=spec.epoch, item=item, stage=spec.stage + 1,
                    compute_s=[*times, min(ended - started, MAX_STAGE_S)], arrivals=arrivals), out,
                                    span=link.span("activation", "transfer", micro_batch=item))
            except Exception as exc:  # noqa: BLE001 - the coordinator replays the item; the stage goes on
                self.ctx.metrics.count("serve_items_failed")
                _limited.log(logging.ERROR, "serve_compute", "serving job %s: item %d failed: %s", spec.job_id, item,
                             exc)
            self.ctx.metrics.count("serve_items")
            item += 1


def _refusal(stage: _Stage | None, body: ServeTensor, msg: Inbound) -> str | None:
    """Why an arrived item cannot be used by ``stage``, or None."""
    what = f"serving item {body.item} of job {body.job_id} epoch {body.epoch} from {msg.sender}"
    if stage is None:
        return f"{what}: this worker holds no stage of that job"
    spec = stage.spec
    if body.epoch != spec.epoch or body.stage != spec.stage:
        return f"{what} for stage {body.stage}: this worker holds stage {spec.stage} of epoch {spec.epoch}"
    foreign = stranger(msg, stage.source, what)
    if foreign is not None:
        return foreign
    if stage.exchange.pending() >= MAX_PENDING:
        return f"{what}: {MAX_PENDING} items are already waiting"
    return tensor_problem(msg.tensor, dtype=stage.in_dtype, sample_shape=stage.in_shape, what=what)
