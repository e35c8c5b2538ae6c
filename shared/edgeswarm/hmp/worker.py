"""The tensor-shard-worker's program for serve-hmp jobs: one shard of every layer per job, any number of jobs.

A ShardAssign makes rank ``rank``'s shard of the model under the plan's shares (the heads, MLP columns and rows of
``hmp.compute``), after reserving its weights and one pass's activations in the node's memory ledger beside every
other job on the node: a shard that does not fit (or leaves no room for one request's KV cache) is refused naming
what holds the memory. Weights come from the model folder (only the shard's slices are read) or, for a preset, from
its seed. Each request's KV cache is reserved apart, as a part of the job's holding, when ShardAdmit asks (its
prompt and the tokens it may generate, for this rank's KV heads), and given back by ShardFree: a request whose
cache does not fit beside the node's other holdings is refused in the ShardAdmitted answer, and the coordinator
keeps it waiting or answers it ``busy``. ShardRelease, a failed assignment and closing give all the memory back.

Passes arrive as ShardPass frames from the job's coordinator (any other sender is refused and counted); the job's
thread runs them in order: the shard's forward over the pass's tokens, exchanging the ring's CollectiveTensor
slices with the other ranks through the platform's ``CollectivePort`` (scope: the pass), and answers the
coordinator with a ShardResult. A pass that fails (a peer gone, a slice lost twice) is answered with nothing: the
coordinator runs the request again or re-plans, and its ShardFree for the request stops a pass of it still waiting
for a peer's slice here. The request's KV cache lives on the shard until ShardFree (or a
newer prefill of the same request, or the release). Caches are bounded: MAX_CACHES requests, each within the bytes
its admission reserved.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgeswarm.devices.compute import to_host
from edgeswarm.errors import EdgeswarmError, MemoryBudgetError
from edgeswarm.hmp.spec import PREFILL
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.collectives import CollectiveTensor
from edgeswarm.messages.hmp import (
    MAX_BATCH,
    KvRefusal,
    ShardAdmit,
    ShardAdmitted,
    ShardAssign,
    ShardFree,
    ShardPass,
    ShardProfileReply,
    ShardProfileRequest,
    ShardReady,
    ShardRelease,
    ShardResult,
)
from edgeswarm.messages.tracing import SpanCat
from edgeswarm.models.text.hf import source_config
from edgeswarm.runtime.collective_exchange import CollectiveKey, CollectivePort
from edgeswarm.runtime.exchange import TensorExchange
from edgeswarm.runtime.program import JobTable, WorkerContext, build_failure
from edgeswarm.runtime.senders import count_stranger, stranger
from edgeswarm.wire import Message

if TYPE_CHECKING:
    from edgeswarm.bus import Inbound
    from edgeswarm.hmp.compute import Shard
    from edgeswarm.planning.hmp.types import BlockProfile

log = logging.getLogger(__name__)
# The rank recorder's phases as span categories (tracing.spans).
_SPAN_CATS: dict[str, SpanCat] = {"compute": "compute", "sync": "collective", "wait": "wait", "comm": "transfer"}
_limited = RateLimitedLog(log)

MIB = 1 << 20
PROGRAM = "hmp"  # this program's name in the node's memory ledger
MAX_QUEUED_PASSES = 64  # passes a shard holds beyond the one it runs (the coordinator runs one pass at a time)
MAX_CACHES = MAX_BATCH + 2  # requests whose KV cache a shard holds at once (a batch, one joining, one rebuilt)
MAX_PROFILES = 8  # block profiles kept (one per model and sequence length)


@dataclass
class _Job:
    spec: ShardAssign
    shard: Shard
    exchange: TensorExchange[CollectiveKey]
    port: CollectivePort
    reserved_bytes: int
    passes: queue.Queue[tuple[ShardPass, Any] | None] = field(default_factory=lambda: queue.Queue(MAX_QUEUED_PASSES))
    caches: dict[int, Any] = field(default_factory=dict)  # request number -> its KV cache
    admitted: set[int] = field(default_factory=set)  # requests whose KV cache the node's ledger holds
    thread: threading.Thread | None = None
    ran: int = 0
    running: tuple[frozenset[int], int] | None = None  # (requests, pass) of the pass under way

    def close(self) -> None:
        try:
            self.passes.put_nowait(None)
        except queue.Full:
            pass
        self.exchange.close(timeout_s=1.0)  # a pass waiting for a slice gives up now
        self.shard.rank.close()  # its communication threads
        self.caches.clear()


class ShardProgram(JobTable[_Job]):
    """The shards this worker holds, by job id (see the module's docstring). A profile request names no job: it is
    nobody's."""

    handles: tuple[type[Message], ...] = (ShardAssign, ShardRelease, ShardAdmit, ShardFree, ShardProfileRequest)
    tensors: tuple[type[Message], ...] = (ShardPass, CollectiveTensor)
    ledger_name = PROGRAM
    refusal_counter = "hmp_failed"

    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        self._profiles: dict[str, BlockProfile] = {}  # (model, sequence length) -> this device's block latencies
        self._profiling = threading.Lock()  # one profile at a time: two would time each other

    # --- requests -----------------------------------------------------------------------------------

    def on_request(self, msg: Inbound) -> None:
        body = msg.body
        if isinstance(body, ShardRelease):
            self._release(body.job_id)
        elif isinstance(body, ShardFree):
            with self._lock:
                job = self._jobs.get(body.job_id)
            if job is not None and job.spec.epoch == body.epoch:
                running = job.running
                for request in body.requests:
                    job.caches.pop(request, None)  # the pass thread reads it only while it runs that request
                    if request in job.admitted:
                        job.admitted.discard(request)
                        self.ctx.ledger.release(PROGRAM, body.job_id, _part(request))
                    if running is not None and request in running[0]:
                        # The coordinator gave the request up (a peer is gone): its pass stops waiting for slices.
                        job.exchange.abort(running[1], "the coordinator gave the request up")
        elif isinstance(body, ShardAdmit):
            self._admit(msg, body)
        elif isinstance(body, ShardAssign):
            # Making the shard (reading a model folder) runs apart from the request topic's thread.
            threading.Thread(target=self._assign, args=(msg, body), name="hmp-assign", daemon=True).start()
        elif isinstance(body, ShardProfileRequest):
            threading.Thread(target=self._profile, args=(msg, body), name="hmp-profile", daemon=True).start()

    def _profile(self, msg: Inbound, body: ShardProfileRequest) -> None:
        """Answer a profile request with this device's block latencies (measured once per model and length)."""
        from edgeswarm.hmp.profiling import profile_blocks

        key = f"{body.model.model_dump_json()}@{body.seq_len}"
        try:
            with self._profiling:
                profile = self._profiles.get(key)
                if profile is None:
                    cfg = source_config(body.model)
                    if body.seq_len > cfg.max_positions:
                        raise EdgeswarmError(f"{body.model.name} takes at most {cfg.max_positions} tokens, not "
                                             f"{body.seq_len}")
                    with self.ctx.gate.computing():
                        profile = profile_blocks(cfg, body.seq_len, node=self.ctx.node, device=self.ctx.device,
                                                 compute=self.ctx.compute)
                    while len(self._profiles) >= MAX_PROFILES:
                        del self._profiles[next(iter(self._profiles))]
                    self._profiles[key] = profile
        except EdgeswarmError as exc:
            self.refuse(msg, "", "bad_request", f"cannot profile {body.model.name}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - the requester must hear of it rather than wait out its timeout
            log.exception("profiling %s failed", body.model.name)
            self.refuse(msg, "", "error", f"profiling {body.model.name} failed: {type(exc).__name__}: {exc}")
            return
        self.ctx.bus.reply(msg, ShardProfileReply(profile=profile))

    def _admit(self, msg: Inbound, body: ShardAdmit) -> None:
        """Reserve each request's KV cache in the node's ledger; answer which did not fit."""
        from edgeswarm.hmp.compute import request_kv_bytes

        with self._lock:
            job = self._jobs.get(body.job_id)
        if job is None or job.spec.epoch != body.epoch:
            self.refuse(msg, body.job_id, "not_assigned", f"this worker holds no shard of hmp job {body.job_id} at "
                                                          f"epoch {body.epoch}")
            return
        foreign = stranger(msg, job.spec.coordinator, f"an admission to hmp job {body.job_id}")
        if foreign is not None:  # only the job's coordinator may take the node's memory for its requests
            count_stranger(self.ctx.metrics)
            self.refuse(msg, body.job_id, "bad_request", foreign)
            return
        spec, refused = job.spec, []
        for r in body.requests:
            if r.request not in job.admitted and len(job.admitted) >= MAX_CACHES:
                refused.append(KvRefusal(request=r.request, detail=f"rank {spec.rank} on {self.ctx.node} holds the "
                                                                   f"KV caches of {MAX_CACHES} requests already"))
                continue
            tokens = min(r.tokens, spec.max_tokens)
            need = request_kv_bytes(job.shard.cfg, spec.shares, spec.rank, tokens)
            what = (f"the KV cache of request {r.request} of serving job {spec.job_id} (rank {spec.rank}, "
                    f"{tokens} tokens)")
            try:
                self.ctx.ledger.reserve(PROGRAM, spec.job_id, need, part=_part(r.request), service=self.ctx.service,
                                        what=what, refusal=f"{what} needs {need / MIB:.2f} MiB on {self.ctx.node}")
            except MemoryBudgetError as exc:
                refused.append(KvRefusal(request=r.request, detail=str(exc)[:2048]))
                continue
            job.admitted.add(r.request)
        if refused:
            self.ctx.metrics.count("hmp_kv_refused", len(refused))
        self.ctx.bus.reply(msg, ShardAdmitted(job_id=spec.job_id, epoch=spec.epoch, rank=spec.rank, refused=refused))

    def _release(self, job_id: str) -> None:
        with self._lock:
            job = self._jobs.pop(job_id, None)
        if job is not None:
            log.info("hmp job %s: released rank %d after %d passes", job_id, job.spec.rank, job.ran)
            job.close()
            self.ctx.ledger.release(PROGRAM, job_id)

    def _assign(self, msg: Inbound, spec: ShardAssign) -> None:
        from edgeswarm.hmp.compute import load_shard, request_kv_bytes, shard_memory

        started = time.monotonic()
        self._release(spec.job_id)  # a newer assignment replaces the job's shard (and its memory)
        try:
            cfg = source_config(spec.model)
            if not spec.shares.devices[spec.rank:spec.rank + 1]:
                raise EdgeswarmError(f"rank {spec.rank} is not in a ring of {len(spec.shares.devices)}")
            if spec.shares.devices[spec.rank] != self.ctx.node:
                raise EdgeswarmError(f"rank {spec.rank} of the plan is {spec.shares.devices[spec.rank]}, not "
                                     f"{self.ctx.node}")
            need = shard_memory(cfg, spec.shares, spec.rank, spec.max_tokens)
            one_request = request_kv_bytes(cfg, spec.shares, spec.rank, spec.max_tokens)
            budget = self.ctx.device.memory_budget_bytes
            what = (f"rank {spec.rank} of serving job {spec.job_id} ({spec.shares.heads[spec.rank]} heads, "
                    f"{spec.shares.columns[spec.rank]} MLP columns of {cfg.layers} layers)")
            if need + one_request > budget:
                raise MemoryBudgetError(f"{what} needs {need / MIB:.1f} MiB for its weights and "
                                        f"{one_request / MIB:.1f} MiB for one request's KV cache of {spec.max_tokens} "
                                        f"tokens, but {self.ctx.node} ({self.ctx.device.device_class}) has a memory "
                                        f"budget of {budget / MIB:.1f} MiB")
            self.ctx.ledger.reserve(PROGRAM, spec.job_id, need, service=self.ctx.service, what=what,
                                    refusal=f"{what} needs {need / MIB:.1f} MiB for its weights")
            with self.ctx.gate.building():
                shard = load_shard(spec.model, cfg, spec.shares, spec.rank, self.ctx.compute, device=self.ctx.device)
        except Exception as exc:  # noqa: BLE001 - the requester must hear of it rather than wait out its timeout
            self.ctx.ledger.release(PROGRAM, spec.job_id)
            self.refuse(msg, spec.job_id, *build_failure(exc, f"making rank {spec.rank} of hmp job {spec.job_id}",
                                                         log))
            return
        exchange: TensorExchange[CollectiveKey] = TensorExchange(
            self.ctx.bus, self.ctx.service, wait_s=spec.deadline_s, name=f"hmp job {spec.job_id} rank {spec.rank}",
            scope_name="pass", compute=self.ctx.compute)
        port = CollectivePort(exchange, spec.job_id, epoch=spec.epoch, dtype=shard.wire_dtype)
        job = _Job(spec, shard, exchange, port, need)
        with self._lock:
            old = self._jobs.pop(spec.job_id, None)
            self._jobs[spec.job_id] = job
        if old is not None:
            old.close()
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"hmp-{spec.job_id}", daemon=True)
        job.thread.start()
        log.info("hmp job %s epoch %d: rank %d of %s holds %d parameters", spec.job_id, spec.epoch, spec.rank,
                 ", ".join(spec.shares.devices), shard.parameters)
        self.ctx.bus.reply(msg, ShardReady(job_id=spec.job_id, epoch=spec.epoch, rank=spec.rank,
                                           parameters=shard.parameters, memory_bytes=need,
                                           load_s=time.monotonic() - started))

    # --- tensors ------------------------------------------------------------------------------------

    def on_tensor(self, msg: Inbound) -> None:
        body = msg.body
        with self._lock:
            job = self._jobs.get(self.job_of(body))
        if isinstance(body, CollectiveTensor):
            if job is None:
                _limited.log(logging.WARNING, "no_job", "dropped a collective tensor of job %s from %s: this worker "
                             "holds no shard of it", body.job_id, msg.sender)
                return
            refused = job.port.accept(msg, job.spec.shares.devices, job.spec.rank)
            if refused is not None:
                self.ctx.metrics.count(f"hmp_tensors_dropped.{refused.reason}")
                if refused.reason == "sender":
                    count_stranger(self.ctx.metrics)
                _limited.log(logging.ERROR, refused.reason, "dropped %s", refused.detail)
            return
        assert isinstance(body, ShardPass)
        why = self._pass_problem(job, body, msg)
        if why is not None:
            self.ctx.metrics.count("hmp_passes_dropped")
            _limited.log(logging.ERROR, "pass", "dropped %s", why)
            return
        assert job is not None and msg.tensor is not None
        try:
            job.passes.put_nowait((body, msg.tensor.to_torch()))
        except queue.Full:
            self.ctx.metrics.count("hmp_passes_dropped")
            _limited.log(logging.ERROR, "full", "dropped pass %d of hmp job %s: %d passes are waiting", body.pass_id,
                         body.job_id, MAX_QUEUED_PASSES)

    def _pass_problem(self, job: _Job | None, body: ShardPass, msg: Inbound) -> str | None:
        what = f"pass {body.pass_id} of hmp job {body.job_id} epoch {body.epoch} from {msg.sender}"
        if job is None:
            return f"{what}: this worker holds no shard of that job"
        foreign = stranger(msg, job.spec.coordinator, what)
        if foreign is not None:
            count_stranger(self.ctx.metrics)
            return foreign
        if body.epoch != job.spec.epoch:
            return f"{what}: this worker holds epoch {job.spec.epoch}"
        t = msg.tensor
        cap = job.spec.max_tokens + job.spec.max_batch  # a prompt's chunk beside a decode step of every other request
        if t is None or t.dtype != "int64" or len(t.shape) != 1 or not 1 <= t.shape[0] <= cap:
            got = "no tensor" if t is None else f"{t.dtype} {list(t.shape)}"
            return f"{what}: token ids are a 1-D int64 tensor of 1 to {cap}, not {got}"
        segments = body.segments
        if sum(g.tokens for g in segments) != t.shape[0]:
            return f"{what}: its requests hold {sum(g.tokens for g in segments)} tokens, its tensor {t.shape[0]}"
        if len({g.request for g in segments}) != len(segments) or len(segments) > job.spec.max_batch + 1:
            return f"{what}: {len(segments)} segments, of distinct requests and at most {job.spec.max_batch + 1}"
        longest = max(g.start + g.tokens for g in segments)
        if longest > job.spec.max_tokens:
            return f"{what}: positions up to {longest} pass the job's {job.spec.max_tokens} tokens"
        return None

    # --- passes -------------------------------------------------------------------------------------

    def _run(self, job: _Job) -> None:
        """Run the job's passes in order until it is released."""
        from edgeswarm.hmp.compute import run_pass

        spec = job.spec
        while True:
            item = job.passes.get()
            if item is None:
                return
            body, tokens = item
            caches = self._caches_for(job, body)
            if caches is None:
                continue
            requests = frozenset(g.request for g in body.segments)

            def ring(collective: int, _scope: int = body.pass_id) -> Any:
                return job.port.ring(spec.shares.devices, spec.rank, _scope, collective=collective, qos=spec.qos,
                                     deadline_s=spec.deadline_s)

            job.running = (requests, body.pass_id)
            started = time.perf_counter()
            try:
                with self.ctx.gate.computing():
                    out = run_pass(job.shard, tokens, list(zip(body.segments, caches, strict=True)), ring)
            except Exception as exc:  # noqa: BLE001 - one bad pass must not end the shard
                # A peer gone or a slice lost twice: the coordinator hears nothing and runs the requests again.
                self.ctx.metrics.count("hmp_passes_failed")
                for request in requests:
                    job.caches.pop(request, None)
                if isinstance(exc, EdgeswarmError):
                    _limited.log(logging.WARNING, "pass_failed", "hmp job %s: pass %d failed: %s", spec.job_id,
                                 body.pass_id, exc)
                else:
                    log.exception("hmp job %s: pass %d failed: %s", spec.job_id, body.pass_id, exc)
                continue
            finally:
                job.running = None
                job.exchange.forget(body.pass_id)
                job.port.forget(body.pass_id)
            job.ran += 1
            self._trace(job, body, started, time.perf_counter())
            self.ctx.metrics.count("hmp_passes")
            result = ShardResult(job_id=spec.job_id, epoch=spec.epoch, pass_id=body.pass_id, rank=spec.rank,
                                 row_start=out.row_start, tokens=out.tokens, split=out.split,
                                 cache_bytes=sum(c.nbytes() for c in job.caches.values()))
            wire, ready = to_host(out.tensor)
            ready()
            try:
                self.ctx.bus.send_tensor(spec.coordinator, "coordinator", result, wire)
            except EdgeswarmError as exc:
                _limited.log(logging.WARNING, "result", "hmp job %s: result of pass %d not sent: %s", spec.job_id,
                             body.pass_id, exc)

    def _trace(self, job: _Job, body: ShardPass, started: float, ended: float) -> None:
        """Hand the pass's spans (the rank's recorder: each layer's compute, each collective step and wait, the
        communication threads' sends and receives) to the service's tracer: the pass is the span's round, the
        layer part of its name; the rank's lane is "shard r", its communication threads' "shard r comm". The whole
        pass is one more span on the rank's lane, "prefill" (a request from token 0 in it) or "decode", from
        ``started`` to ``ended`` (perf_counter seconds)."""
        from edgeswarm.tracing.spans import RawSpan

        rank, job_id, add, pass_id = job.spec.rank, job.spec.job_id, self.ctx.tracer.add, body.pass_id
        lane, comm_lane = f"shard {rank}", f"shard {rank} comm"
        for s in job.shard.rank.recorder.spans():
            name = s.name if s.layer < 0 else f"L{s.layer} {s.name}"
            add(RawSpan(job_id, comm_lane if s.kind == "comm" else lane, name, _SPAN_CATS[s.kind], pass_id, None,
                        s.start, s.end))
        name = PREFILL if any(g.start == 0 for g in body.segments) else "decode"
        add(RawSpan(job_id, lane, name, "other", pass_id, None, started, ended))

    def _caches_for(self, job: _Job, body: ShardPass) -> list[Any] | None:
        """The KV cache each segment of pass ``body`` extends: a new one for a request from its start (0), else the
        request's. None (the pass is dropped) when a new cache was not admitted (its memory is not reserved), a
        continuation's cache is gone, or it does not continue where the cache ends."""
        from edgeswarm.hmp.compute import new_cache

        out = []
        for g in body.segments:
            if g.start == 0:
                if g.request not in job.admitted:
                    self.ctx.metrics.count("hmp_passes_dropped")
                    _limited.log(logging.WARNING, "admit", "hmp job %s: pass %d starts request %d, whose KV cache "
                                 "was not admitted", job.spec.job_id, body.pass_id, g.request)
                    return None
                job.caches[g.request] = new_cache(job.shard)
                out.append(job.caches[g.request])
                continue
            cache = job.caches.get(g.request)
            if cache is None or cache.length != g.start:
                self.ctx.metrics.count("hmp_passes_dropped")
                _limited.log(logging.WARNING, "cache", "hmp job %s: pass %d continues request %d at %d, but its "
                             "cache holds %s tokens", job.spec.job_id, body.pass_id, g.request, g.start,
                             "no" if cache is None else cache.length)
                return None
            out.append(cache)
        return out


def _part(request: int) -> str:
    """The ledger part of request ``request``'s KV cache (within its job's holding)."""
    return f"request {request}"
