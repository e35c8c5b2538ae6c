"""The coordinator's program for a serve-hmp job: deploy the shards, run each request as passes, survive a loss.

The job measures every device's block latencies for its model (a ShardProfile request to each tensor-shard-worker;
the links come from the profilers), asks the planner service for an HmpPlan and deploys each rank's shard
(ShardAssign). It takes HmpRequest frames on the coordinator's data topic: each is checked (token ids or text, lengths,
ids within the vocabulary) and queued, at most ``spec.queue`` of them and half that from one caller node
(``edgeswarm.shares``; beyond: ``busy``). Requests run as passes: a decoder's up to ``spec.max_batch`` at once, each
pass holding a decode step of every running request (the next token, greedy or sampled, which the rank holding the
request's last row reports; the end of sequence or a stop string ends it early) and a chunk of ``spec.prefill_chunk``
tokens of the prompt of one request joining (so the others wait one chunk at most; with no stream decoding, the prompt
goes in passes of up to ``spec.seq_len`` tokens, the length the plan is priced and its activations reserved for); an
encoder's one at a time, its prompt in one pass. Before its first pass on a plan, a request's KV cache is reserved on
every rank (ShardAdmit: its prompt and the tokens it may generate, in each node's memory ledger); a request whose cache
does not fit waits, in its place in the batch, while others of the job run and free memory as they end, and is answered
``busy`` (naming what holds the memory) when none does. Each pass is a ShardPass frame to every rank and a ShardResult
from every rank; when a pass's results do not all come within its deadline its requests run again once on new KV caches
(a slice lost twice), and when the failure detector confirms a device lost, the job re-plans over the survivors, deploys
the new plan as a new epoch and rebuilds each request's cache there from its tokens so far (a prefill over the prompt
and the tokens generated), so every request is answered once. A cancelled job answers what it still holds with
InferError ``not_serving`` and releases its shards.

With the rebalance setting on, the job closes the loop (planning.refit, planning.hmp.refit): every prefill pass's
ranks report their own arithmetic's seconds, which the fit sets against what the plan's block profiles predict for
each rank; when the plan the planner finds on the refitted profiles is predicted faster than the running plan
priced on them by more than the rebalancer's margin, the job moves to it between two requests. When the job stops,
each device's scale is saved in the profile cache under the served model and sequence length (``fit_key``), and the
next job serving them starts from it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.coordination.fanout import fan_out
from edgeswarm.coordination.planner_client import PLANNER_BUSY_PAUSE_S, PLANNER_NODE
from edgeswarm.errors import EdgeswarmError, JobError
from edgeswarm.hmp.gather import hmp_cluster, profile_shards
from edgeswarm.hmp.spec import HmpSpec
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.hmp import (
    HmpCancel,
    HmpDelta,
    HmpReply,
    HmpRequest,
    KvRequest,
    LayerSplit,
    PassSegment,
    ShardAdmit,
    ShardAdmitted,
    ShardAssign,
    ShardFree,
    ShardPass,
    ShardReady,
    ShardRelease,
    ShardResult,
)
from edgeswarm.messages.hmp_planning import HmpPlanReply, HmpPlanRequest
from edgeswarm.messages.serving import InferErrorReason
from edgeswarm.models.text.hf import source_config
from edgeswarm.observability import record
from edgeswarm.planning.hmp.plan import plan_hmp, prefill_s, request_s
from edgeswarm.planning.hmp.refit import rank_compute_s, reprice, scaled_cluster
from edgeswarm.planning.hmp.types import HmpCluster, HmpOptions, HmpPlan
from edgeswarm.planning.refit import ClosedLoop, RefitPricing
from edgeswarm.profiling.cache import ProfileCache
from edgeswarm.profiling.refits import save_measured, started_from
from edgeswarm.runtime.senders import count_stranger, stranger
from edgeswarm.service_registry import TENSOR_SHARD_WORKER
from edgeswarm.stats import percentile
from edgeswarm.values.profiles import ClusterProfile
from edgeswarm.values.sampling import Sampling
from edgeswarm.wire import Message
from edgeswarm.workloads.base import JobContext
from edgeswarm.workloads.serving import QueuedRequest, ServingProgram

if TYPE_CHECKING:
    from edgeswarm.values.text_model import TextModelConfig

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

RECENT = 1024  # requests the latency percentiles are measured over
MAX_CANCELLED = 256  # cancels remembered: a cancel that comes before its request still stops it
RETRIES = 1  # a request whose pass failed with no device lost is run again this many times
REPLAN_WAIT_S = 300.0  # how long a request waits for the job to re-plan after a device of its pass was lost
KV_RETRY_S = 1.0  # a request whose KV cache did not fit asks again this often (at once when one of the job's ends)


class PassFailed(EdgeswarmError):
    """A pass's results did not all come in time."""


@dataclass
class _Request(QueuedRequest):
    prompt: list[int]
    new_tokens: int
    sampling: Sampling | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    streamed: tuple[int, int] = (0, 0)  # the generated tokens and the characters of their text sent as HmpDelta

    @property
    def key(self) -> tuple[str, str, str]:
        """Who sent it and its id: what a cancel must name."""
        env = self.msg.envelope
        return env.sender_node, env.sender_service, self.request_id


@dataclass
class _Active:
    """A request in the job's batch: its cache is request number ``number`` on plan ``epoch`` (-1: none yet, or
    lost), reserved on every rank once ``admitted`` (else, ``waiting`` since that monotonic time for memory), and
    holds the first ``fed`` tokens of its ``sequence`` (prompt and generated)."""

    request: _Request
    number: int = 0
    epoch: int = -1
    admitted: bool = False
    waiting: float | None = None
    fed: int = 0
    generated: list[int] = field(default_factory=list)
    ttft: float | None = None
    decode_s: float = 0.0
    retries: int = 0
    recomputed: bool = False
    split: LayerSplit | None = None

    @property
    def sequence(self) -> list[int]:
        return self.request.prompt + self.generated

    @property
    def stepping(self) -> bool:
        """Its next pass is a decode step: it has generated, and only its newest token is not in its cache."""
        return bool(self.generated) and len(self.sequence) - self.fed == 1


@dataclass
class _Pass:
    pass_id: int
    ranks: int
    results: dict[int, tuple[ShardResult, Any]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Stats:
    answered: int = 0
    recomputed: int = 0
    tokens: int = 0
    decode_s: float = 0.0  # seconds of decode passes
    decoded: int = 0  # tokens the decode passes generated
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    tpots: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    split: LayerSplit | None = None
    passes: int = 0
    peak_batch: int = 0


def fit_key(spec: HmpSpec) -> str:
    """The profile cache's model key of what a serve-hmp job measures of each device: its blocks of the served model
    at its sequence length (every mode computes the same blocks)."""
    named = spec.model.model_dump_json() + f"|{spec.seq_len}"
    return "hmp-" + hashlib.sha256(named.encode()).hexdigest()[:24]


def _keyed(cluster: ClusterProfile, key: str) -> ClusterProfile:
    """``cluster`` with every device's profile named by ``key``: the refits it saves and reads are the served
    Transformer's, not the links' probe model's that the profilers measured."""
    return cluster.model_copy(update={"devices": [
        e.model_copy(update={"compute": e.compute.model_copy(update={"model_fingerprint": key})})
        for e in cluster.devices]})


def describe_plan(plan: HmpPlan) -> str:
    """One line on ``plan`` for the job's events."""
    s = plan.shares
    shares = ", ".join(f"{d} {h}h/{c}c" for d, h, c in zip(s.devices, s.heads, s.columns, strict=True))
    line = (f"{s.mode} over {len(s.devices)} devices ({shares}): {plan.model.total_s * 1000:.1f} ms per "
            f"{plan.seq_len}-token prefill predicted")
    if plan.decode is not None:
        line += f", {plan.decode.per_token_s * 1000:.1f} ms per token"
    return line + (f"; left out: {', '.join(plan.left_out)}" if plan.left_out else "")


class HmpRunner(ServingProgram[HmpPlan, _Request]):
    """One serve-hmp job on the coordinator (see the module's docstring), on the serving skeleton."""

    ready = ShardReady
    release = ShardRelease
    part = "shard"
    plan_noun = "tensor-parallel plan"
    too_large_advice = "In the job file: exclude devices (planner.exclude)"

    def __init__(self, ctx: JobContext, spec: HmpSpec, *, worker_service: str = TENSOR_SHARD_WORKER,
                 planner_node: str = PLANNER_NODE, busy_pause_s: float = PLANNER_BUSY_PAUSE_S) -> None:
        super().__init__(ctx, spec, worker_service=worker_service, planner_node=planner_node,
                         busy_pause_s=busy_pause_s)
        self.spec: HmpSpec = spec
        self.config: TextModelConfig = source_config(spec.model)
        self.tokenizer: Any = None
        self.chat: Any = None  # the model folder's chat template (models.text.chat), for requests with messages
        self.stop_tokens: frozenset[int] = frozenset()  # generation ends at these (the tokenizer's end of sequence)
        self.device_profiles: dict[str, Any] = {}  # node -> its measured block latencies (planning.hmp)
        self._next_pass = 0
        self._next_request = 0
        self._pass: _Pass | None = None
        self._stats = _Stats()
        self._cancelled: OrderedDict[tuple[str, str, str], None] = OrderedDict()  # requests their callers cancelled
        # The closed loop: each rank's measured arithmetic in a prefill pass against its block profile; re-plans only
        # with the rebalance setting on.
        self.refit_loop = ClosedLoop(RefitPricing(
            lambda plan, profile: reprice(plan, profile, self.options()),
            lambda _plan, profile: plan_hmp(profile, self.options()), scaled_cluster),
            cost=lambda plan: request_s(plan, self.options().new_tokens))
        self.base_scales: dict[str, float] = {}  # what earlier jobs measured, applied to the profiles (``profiles``)
        self._predicted: tuple[int, int, bool, dict[str, float]] = (-1, 0, False, {})  # (plan epoch, tokens,
        # logits or not, seconds per device)
        self._ended = False  # a request of the batch ended since the last admission: its KV memory is free again

    # --- the job: the serving skeleton's hooks ----------------------------------------------------------

    def measure(self, nodes: list[str]) -> ClusterProfile:
        self.ctx.update("profiling", event=("profiling", f"measuring {self.spec.model.name}'s blocks at "
                                                         f"{self.spec.seq_len} tokens on {', '.join(nodes)}"))
        cluster, self.device_profiles = profile_shards(self.bus, self.spec, nodes, self.worker_service,
                                                       timeout_s=self.ctx.timeout_s)
        if self.closed_loop:
            self.base_scales, said = started_from(ProfileCache(self.bus.settings.profile_dir),
                                                  _keyed(cluster, fit_key(self.spec)), "serve")
            if said:
                self.ctx.update("profiling", event=("refit", said))
        return cluster

    def stop(self) -> None:
        """Stop serving, and save what the job measured of each device's speed (with the closed loop on)."""
        fitted = self.refit_loop.measured()
        if self.closed_loop and self.cluster is not None and fitted:
            said = save_measured(ProfileCache(self.bus.settings.profile_dir), _keyed(self.cluster, fit_key(self.spec)),
                                 self.base_scales, fitted, self.refit_loop.rounds(), "serve")
            if said:
                self.ctx.update(self.ctx.state().status, event=("refit", said))
        super().stop()

    @property
    def batch(self) -> int:
        """Requests the job runs at once: ``spec.max_batch`` for a decoder, one for an encoder or in sp mode (its
        ranks split one sequence's rows)."""
        return self.spec.max_batch if self.config.decoder and self.spec.mode != "sp" else 1

    def options(self) -> HmpOptions:
        """What the job's plans are asked for (its mode, the planner's settings, the KV cache it needs)."""
        spec = self.spec
        return HmpOptions(mode=spec.mode, overlap=spec.overlap, shift=spec.planner.shift, prune=spec.planner.prune,
                          max_tokens=spec.max_tokens * self.batch, direct_syncs=spec.decode_syncs == "direct",
                          new_tokens=spec.max_new_tokens if self.config.decoder else 0)

    def profiles(self, cluster: ClusterProfile) -> HmpCluster:
        """The planner's input over ``cluster``'s devices, as profiled and scaled by what earlier jobs measured."""
        return scaled_cluster(hmp_cluster(self.spec, self.config, cluster, self.device_profiles), self.base_scales)

    def plan_request(self, cluster: ClusterProfile, epoch: int) -> Message:
        # The excluded devices are out of the cluster already (the skeleton's ``nodes``), the lost ones too: their
        # profiles are left out with them. With the closed loop on, a re-plan after a loss prices the devices as
        # they were measured.
        profiles = self.profiles(cluster)
        if self.closed_loop:
            profiles = scaled_cluster(profiles, self.refit_loop.scales())
        return HmpPlanRequest(cluster=profiles, options=self.options(), epoch=epoch)

    def refit_profile(self, cluster: ClusterProfile) -> HmpCluster:
        return self.profiles(cluster)

    def gain(self, current: HmpPlan, best: HmpPlan) -> str:
        n = self.options().new_tokens
        was, will = request_s(current, n), request_s(best, n)
        return (f"a request of {self.spec.seq_len} prompt tokens{f' generating {n}' if n else ''} would take "
                f"{was * 1000:.1f} ms on the running plan, {will * 1000:.1f} ms on the new one "
                f"({was / will:.2f}x faster)")

    def _refit(self, plan: HmpPlan, tokens: int, logits: bool, results: dict[int, tuple[ShardResult, Any]]) -> None:
        """One prefill pass of ``tokens`` tokens (computing its last row's logits or not): each rank's measured
        arithmetic (seconds) into the fit."""
        if self.cluster is None:
            return
        with self._changed:
            if self._predicted[:3] != (plan.epoch, tokens, logits):
                try:
                    priced = rank_compute_s(self.profiles(self.cluster), plan, tokens, logits=logits)
                except KeyError:  # a device of the plan no longer in the profile: nothing to compare with
                    priced = {}
                self._predicted = (plan.epoch, tokens, logits, priced)
            predicted = self._predicted[3]
        devices = plan.devices
        self.refit_loop.add(predicted, {devices[rank]: result.split.compute_s
                                  for rank, (result, _) in results.items() if rank < len(devices)})

    def plan_from(self, reply: Message) -> HmpPlan:
        assert isinstance(reply, HmpPlanReply)
        return reply.plan

    def describe(self, plan: HmpPlan) -> str:
        return describe_plan(plan)

    def plan_fields(self, plan: HmpPlan) -> dict[str, Any]:
        return {"predicted_latency_s": prefill_s(plan, self.options().new_tokens),
                "predicted_tpot_s": plan.decode.per_token_s if plan.decode is not None else None}

    def assignments(self, plan: HmpPlan) -> dict[str, Message]:
        spec = self.spec
        return {device: ShardAssign(job_id=spec.name, epoch=plan.epoch, rank=rank, model=spec.model,
                                    shares=plan.shares, coordinator=self.ctx.node, max_tokens=spec.max_tokens,
                                    max_batch=self.batch,
                                    qos=spec.qos, deadline_s=spec.deadline_s)
                for rank, device in enumerate(plan.shares.devices)}

    def on_ready(self, plan: HmpPlan) -> None:
        if self.spec.model.path is not None and self.tokenizer is None:
            self.tokenizer = _tokenizer(self.spec.model.path)
            if self.tokenizer is not None:
                self.stop_tokens = frozenset(self.tokenizer.special.eos)
                self.chat = _chat_template(self.spec.model.path)
        super().on_ready(plan)

    def interrupt(self, reason: str) -> None:
        """Wake the pass under way: it fails (the request rebuilds its cache on the new plan, or is refused)."""
        current = self._pass
        if current is not None:
            current.done.set()
            log.info("job %s: pass %d given up: %s", self.spec.name, current.pass_id, reason)

    # --- requests in ------------------------------------------------------------------------------

    def on_data(self, msg: Inbound) -> None:
        """An HmpRequest from a caller, or a ShardResult from a rank (bus threads)."""
        if isinstance(msg.body, ShardResult):
            self._on_result(msg, msg.body)
        elif isinstance(msg.body, HmpRequest):
            self._on_request(msg, msg.body)
        elif isinstance(msg.body, HmpCancel):
            env = msg.envelope
            with self._changed:
                self._cancelled[(env.sender_node, env.sender_service, msg.body.request_id)] = None
                while len(self._cancelled) > MAX_CANCELLED:  # the oldest: their requests are long answered
                    self._cancelled.popitem(last=False)

    def _on_request(self, msg: Inbound, body: HmpRequest) -> None:
        prompt, problem = self._prompt(msg, body)
        if problem is not None:
            self.refuse(msg, body.request_id, *problem)
            return
        assert prompt is not None
        if body.stop and self.tokenizer is None:
            self.refuse(msg, body.request_id, "bad_shape", f"model {self.spec.model.name} has no tokenizer (a "
                                                           "preset): stop strings need one; send none")
            return
        asked = self.spec.max_new_tokens if body.max_new_tokens is None else body.max_new_tokens
        new = asked if self.config.decoder else 0
        new = min(new, self.spec.max_tokens - len(prompt))
        self.admit(_Request(msg=msg, request_id=body.request_id, arrived=time.monotonic(), prompt=prompt,
                            new_tokens=new, sampling=body.sampling, stop=tuple(body.stop), stream=body.stream))

    def _prompt(self, msg: Inbound, body: HmpRequest) -> tuple[list[int] | None, tuple[InferErrorReason, str] | None]:
        """The request's prompt token ids, or why it is refused."""
        cap = self.spec.max_tokens
        if body.messages is not None:
            if self.chat is None:
                return None, ("bad_shape", f"model {self.spec.model.name} has no chat template (its folder's "
                                           "tokenizer_config.json names none): send text or token ids")
            from edgeswarm.models.text.chat import ChatTemplateError

            try:
                # the template writes the special tokens (a BOS) itself, as transformers' apply_chat_template does
                ids = list(self.tokenizer.encode(self.chat.render(body.messages), special_tokens=False).ids)
            except (ChatTemplateError, ValueError) as exc:
                return None, ("bad_shape", str(exc))
        elif body.text is not None:
            if self.tokenizer is None:
                return None, ("bad_shape", f"model {self.spec.model.name} has no tokenizer (a preset): send token "
                                           "ids as an int64 tensor")
            ids = list(self.tokenizer.encode(body.text).ids)
        else:
            t = msg.tensor
            if t is None or t.shape == (0,) or len(t.shape) == 0:
                return None, ("no_tensor", "a request carries token ids (an int64 tensor [tokens]) or text")
            if t.dtype != "int64":
                return None, ("bad_dtype", f"token ids are int64, not {t.dtype}")
            if len(t.shape) != 1:
                return None, ("bad_shape", f"token ids are one sequence [tokens], not {list(t.shape)}")
            if t.shape[0] > cap:
                return None, ("too_large", f"{t.shape[0]} tokens: the job takes at most {cap} (max_tokens)")
            ids = [int(v) for v in t.to_torch().tolist()]
        if not ids:
            return None, ("bad_shape", "the prompt is empty")
        if len(ids) > cap:
            return None, ("too_large", f"{len(ids)} tokens: the job takes at most {cap} (max_tokens)")
        if min(ids) < 0 or max(ids) >= self.config.vocab:
            return None, ("bad_shape", f"token ids must be in [0, {self.config.vocab}) for {self.spec.model.name}")
        return ids, None

    # --- requests through -------------------------------------------------------------------------

    def dispatch(self) -> None:
        """The job's passes, one at a time: every active request's next rows in each (see ``_step``); requests join
        from the queue between passes, up to ``spec.max_batch`` (an encoder's, or sp's: one at a time)."""
        active: list[_Active] = []
        limit = self.batch
        while True:
            with self._changed:
                while not self._stopped and (self._plan is None or (not self._queue and not active)):
                    self._changed.wait(1.0)
                if self._stopped:
                    break
                joined = []
                while self._queue and len(active) + len(joined) < limit:
                    request = self._queue.popleft()
                    self._callers.release(request.caller)
                    joined.append(request)
            for request in joined:
                record.request_dispatched(self.bus.metrics, self.spec.name, time.monotonic() - request.arrived)
                active.append(_Active(request))
            try:
                active = self._step(active)
            except _Stopped:
                break
            except EdgeswarmError as exc:  # no new plan after a loss, or a pass that answered without a token
                for a in active:
                    self.refuse(a.request.msg, a.request.request_id, "failed", str(exc))
                active = []
            except Exception as exc:  # noqa: BLE001 - one bad pass must not end the job's serving
                log.exception("job %s: a pass failed", self.spec.name)
                for a in active:
                    self.refuse(a.request.msg, a.request.request_id, "failed", f"{type(exc).__name__}: {exc}")
                active = []
        for a in active:
            self.refuse(a.request.msg, a.request.request_id, "not_serving", f"job {self.spec.name} stopped")

    def _step(self, active: list[_Active]) -> list[_Active]:
        """One pass of the active requests on the current plan: a decode step of each one whose sequence is in its
        cache, and a chunk of the prompt (or of the tokens so far, rebuilding a cache) of the first one whose
        sequence is not; returns the requests still active after it (the others answered or refused)."""
        plan, epoch = self._current_plan()
        kept = []
        for a in active:
            with self._changed:
                cancelled = a.request.key in self._cancelled
            if cancelled:
                if a.epoch == epoch and a.admitted:
                    self._free(plan, epoch, [a.number])
                self._ended = True
                self.refuse(a.request.msg, a.request.request_id, "cancelled", "its caller cancelled it")
            else:
                if a.epoch != epoch:  # new, or its cache was lost or on a plan that is gone: built from its tokens
                    a.recomputed = a.recomputed or a.epoch >= 0  # a device lost, or the job re-planned, under it
                    a.epoch, a.number, a.fed, a.admitted = epoch, self._new_request_number(), 0, False
                kept.append(a)
        try:
            kept = self._admit(plan, epoch, kept)
        except PassFailed as exc:
            return self._failed(plan, epoch, kept, exc)
        running = [a for a in kept if a.admitted]
        if not running:
            return kept
        chunk = self.spec.prefill_chunk if self.config.decoder and self.spec.mode != "sp" else 0
        if chunk and not any(a.stepping for a in running):
            # No stream waits on this pass, and every chunk more costs its collectives and each GEMM's weight read
            # again (GPT2-L's 284-token prompt in chunks of 128 took 1.4x the compute of one pass, 2026-12-02).
            chunk = max(chunk, self.spec.seq_len)
        batch: list[tuple[_Active, list[int]]] = []
        filling = False
        for a in running:
            pending = a.sequence[a.fed:]
            if a.stepping:
                batch.append((a, pending))
            elif not filling:
                batch.append((a, pending[:chunk] if chunk else pending))
                filling = True
        segments = [PassSegment(request=a.number, start=a.fed, tokens=len(rows), sampling=a.request.sampling,
                                answer=a.fed + len(rows) == len(a.sequence) and len(a.generated) < a.request.new_tokens)
                    for a, rows in batch]
        tokens = [t for _, rows in batch for t in rows]
        started = time.perf_counter()
        try:
            results = self._run_pass(plan, epoch, segments, tokens)
        except PassFailed as exc:
            return self._failed(plan, epoch, kept, exc)
        took = time.perf_counter() - started
        with self._changed:
            self._stats.passes += 1
            self._stats.peak_batch = max(self._stats.peak_batch, len(segments))
        if len(segments) == 1 and segments[0].start == 0:
            self._refit(plan, len(tokens), segments[0].answer, results)
        chosen = _tokens(results, len(segments)) if self.config.decoder else []
        done: set[int] = set()
        for k, (a, rows) in enumerate(batch):
            decoding = a.stepping  # read before this pass's rows count as fed
            a.fed += len(rows)
            if segments[k].start == 0:
                a.split = _layer_split(results, self.config.layers)
            if segments[k].answer:
                if chosen[k] < 0:
                    raise PassFailed(f"no rank reported request {a.number}'s next token")
                if a.ttft is None:
                    a.ttft = time.monotonic() - a.request.arrived
                    record.first_token(self.bus.metrics, self.spec.name, a.ttft, len(a.request.prompt))
                if decoding:
                    a.decode_s += took
                    record.next_token(self.bus.metrics, self.spec.name, took)
                a.generated.append(chosen[k])
                self._stream(a.request, a.generated)
            ended = not self.config.decoder or (a.fed >= len(a.request.prompt) and (
                len(a.generated) >= a.request.new_tokens or (bool(a.generated) and a.generated[-1] in self.stop_tokens)
                or self._stop_at(a.request, a.generated) is not None))
            if ended:
                self._free(plan, epoch, [a.number])
                hidden = None if self.config.decoder else _rows(results, len(tokens))
                if a.ttft is None:
                    a.ttft = time.monotonic() - a.request.arrived
                self._answer(a.request, a.generated, hidden, a.ttft, a.decode_s, a.split, epoch, a.recomputed)
                done.add(id(a))
        self._ended = self._ended or bool(done)
        return [a for a in kept if id(a) not in done]

    def _failed(self, plan: HmpPlan, epoch: int, kept: list[_Active], exc: PassFailed) -> list[_Active]:
        """After a pass (or an admission) of ``kept`` on ``plan`` failed: their caches freed, the requests to go on
        with (rebuilt on the new plan, or run again up to RETRIES times; the others refused)."""
        self._free(plan, epoch, [a.number for a in kept])
        self._ended = True
        with self._changed:
            moved = self._plan is None or self._epoch != epoch  # the job is moving to a better plan
        if moved or self._wait_for_replan(plan, epoch):
            return kept  # on the new plan, each rebuilds its cache from its tokens so far
        out = []
        for a in kept:
            # its cache is gone: rebuilt by the next pass (one waiting for memory was not in the pass)
            a.retries, a.epoch = a.retries + int(a.admitted), -1
            if a.retries > RETRIES:
                self.refuse(a.request.msg, a.request.request_id, "failed",
                            f"request {a.request.request_id or '(no id)'}: {exc}, also when run again")
            else:
                out.append(a)
        _limited.warning("retry", "job %s: %s; running its requests again", self.spec.name, exc)
        return out

    def _admit(self, plan: HmpPlan, epoch: int, active: list[_Active]) -> list[_Active]:
        """Have every rank of ``plan`` reserve the KV cache of each request of ``active`` not yet admitted on it, in
        arrival order: a request is admitted when every rank holds its cache and every request before it is
        admitted (a short request does not pass a long one waiting). The others wait while an admitted request of
        the job runs (asking again once one ends, or after KV_RETRY_S); with none running they are answered
        ``busy``. Returns the requests still active. Raises PassFailed when a rank does not answer."""
        now = time.monotonic()
        asking = [a for a in active if not a.admitted]
        due = self._ended or not any(a.admitted for a in active) or any(
            a.waiting is None or now - a.waiting >= KV_RETRY_S for a in asking)
        if not asking or not due:
            return active
        self._ended = False
        for a in asking:
            if a.waiting is not None:  # refused before and freed: asks with a number of its own again
                a.number = self._new_request_number()
        body = ShardAdmit(job_id=self.spec.name, epoch=epoch, requests=[
            KvRequest(request=a.number, tokens=len(a.request.prompt) + a.request.new_tokens) for a in asking])
        fan = fan_out(self.bus, dict.fromkeys(plan.shares.devices, body), self.worker_service,
                      timeout_s=3 * self.spec.deadline_s + 5.0)
        refused: dict[int, str] = {}
        for device in plan.shares.devices:
            reply = fan.replies.get(device)
            if not isinstance(reply, ShardAdmitted) or reply.epoch != epoch:
                problem = fan.failures.get(device) or f"it answered {type(reply).__name__}"
                raise PassFailed(f"admitting requests on {device}: {problem}")
            for r in reply.refused:
                refused.setdefault(r.request, r.detail)
        blocked = next((k for k, a in enumerate(asking) if a.number in refused), len(asking))
        for a in asking[:blocked]:
            a.admitted, a.waiting = True, None
        late = asking[blocked:]
        if not late:
            return active
        if any(a.admitted for a in active):  # they wait, in order, for the running ones to free memory
            self._free(plan, epoch, [a.number for a in late])
            for a in late:
                a.waiting = now
            _limited.log(logging.INFO, "kv_wait", "job %s: %d requests wait for KV cache memory: %s", self.spec.name,
                         len(late), refused[asking[blocked].number])
            return active
        busy = [a for a in late if a.number in refused]
        self._free(plan, epoch, [a.number for a in busy])
        for a in late:
            if a.number in refused:
                self.refuse(a.request.msg, a.request.request_id, "busy", f"job {self.spec.name}: the request's KV "
                            f"cache does not fit now: {refused[a.number]}; send again later")
            else:
                a.admitted, a.waiting = True, None
        return [a for a in active if a.admitted]

    def _answer(self, request: _Request, generated: list[int], hidden: Any, ttft: float, decode_s: float,
                split: LayerSplit | None, epoch: int, recomputed: bool) -> None:
        now = time.monotonic()
        tpot = decode_s / (len(generated) - 1) if len(generated) > 1 else None
        text = self.tokenizer.decode(generated) if self.tokenizer is not None and generated else ""
        cut = self._stop_at(request, generated, text)
        text = text if cut is None else text[:cut]
        ended = cut is not None or (bool(generated) and generated[-1] in self.stop_tokens)
        reply = HmpReply(job_id=self.spec.name, request_id=request.request_id, prompt_tokens=request.prompt,
                         tokens=generated, text=text, latency_s=now - request.arrived, ttft_s=ttft, tpot_s=tpot,
                         split=split, epoch=epoch, recomputed=recomputed,
                         finish="length" if len(generated) >= request.new_tokens and not ended else "stop")
        try:
            if hidden is not None:
                self.bus.reply_tensor(request.msg, reply, hidden)
            else:
                self.bus.reply(request.msg, reply)
        except EdgeswarmError as exc:
            _limited.warning("answer", "job %s: could not answer %s: %s", self.spec.name, request.msg.sender, exc)
        record.request_answered(self.bus.metrics, self.spec.name, now - request.arrived)
        record.tokens_generated(self.bus.metrics, self.spec.name, len(generated))
        record.replayed(self.bus.metrics, self.spec.name, int(recomputed))
        with self._changed:
            s = self._stats
            s.answered += 1
            s.recomputed += int(recomputed)
            s.tokens += len(generated)
            s.decode_s += decode_s
            s.decoded += max(0, len(generated) - 1)  # the first token comes from the prefill
            s.latencies.append(now - request.arrived)
            s.ttfts.append(ttft)
            if tpot is not None:
                s.tpots.append(tpot)
            s.split = split

    def _current_plan(self) -> tuple[HmpPlan, int]:
        with self._changed:
            while self._plan is None and not self._stopped:
                self._changed.wait(1.0)
            if self._stopped or self._plan is None:
                raise _Stopped()
            return self._plan, self._epoch

    def _new_request_number(self) -> int:
        with self._changed:
            self._next_request += 1
            return self._next_request

    def _wait_for_replan(self, plan: HmpPlan, epoch: int) -> bool:
        """After a failed pass of ``plan`` (epoch ``epoch``): whether a device of it is confirmed lost (probed now)
        and the job re-planned within REPLAN_WAIT_S. False: every device answers (a slice was lost twice, say)."""
        assert self.detector is not None
        if not self.detector.confirm(plan.devices):
            return False
        deadline = time.monotonic() + REPLAN_WAIT_S
        with self._changed:
            while not self._stopped and time.monotonic() < deadline:
                if self._epoch != epoch and self._plan is not None:
                    return True
                self._changed.wait(0.5)
            if self._stopped:
                raise _Stopped()
        raise JobError(f"job {self.spec.name}: a device of plan epoch {epoch} was lost and no new plan came within "
                       f"{REPLAN_WAIT_S:.0f} s")

    def _stream(self, request: _Request, generated: list[int]) -> None:
        """Send a streaming request the tokens generated since the last HmpDelta and the text they add that is sure
        to stay: not a character that may begin a stop string, nor half of one (the decoder's replacement
        character). Never raises: a lost delta costs the caller its live view, not the answer."""
        if not request.stream:
            return
        sent_tokens, sent_chars = request.streamed
        text = self.tokenizer.decode(generated) if self.tokenizer is not None else ""
        keep = len(text.rstrip("\ufffd"))
        if request.stop:
            cut = self._stop_at(request, generated, text)
            keep = min(keep, cut if cut is not None else max(0, len(text) - max(map(len, request.stop)) + 1))
        keep = max(keep, sent_chars)
        delta = HmpDelta(job_id=self.spec.name, request_id=request.request_id, first=sent_tokens,
                         tokens=generated[sent_tokens:], offset=sent_chars, text=text[sent_chars:keep])
        request.streamed = (len(generated), keep)
        try:
            self.bus.reply(request.msg, delta)
        except EdgeswarmError as exc:
            _limited.warning("delta", "job %s: could not stream to %s: %s", self.spec.name, request.msg.sender, exc)

    def _stop_at(self, request: _Request, generated: list[int], text: str | None = None) -> int | None:
        """Where the generated text (``text``, or ``generated`` decoded) first holds one of the request's stop
        strings; None when it holds none."""
        if not request.stop or self.tokenizer is None or not generated:
            return None
        text = self.tokenizer.decode(generated) if text is None else text
        found = [i for i in (text.find(s) for s in request.stop) if i >= 0]
        return min(found) if found else None

    def _run_pass(self, plan: HmpPlan, epoch: int, segments: list[PassSegment], tokens: list[int]
                  ) -> dict[int, tuple[ShardResult, Any]]:
        """Send one pass to every rank and wait for every rank's result. Raises PassFailed when they do not all
        come within the pass's deadline."""
        import torch

        devices = plan.shares.devices
        with self._changed:
            if self._stopped:
                raise _Stopped()
            self._next_pass += 1
            current = self._pass = _Pass(self._next_pass, len(devices))
        body = ShardPass(job_id=self.spec.name, epoch=epoch, pass_id=current.pass_id, segments=segments)
        ids = torch.tensor(tokens, dtype=torch.int64)
        for device in devices:
            try:
                self.bus.send_tensor(device, self.worker_service, body, ids, qos=self.spec.qos)
            except EdgeswarmError as exc:
                raise PassFailed(f"pass {current.pass_id} not sent to {device}: {exc}") from None
        if not current.done.wait(self._pass_deadline_s(plan, len(tokens))):
            missing = sorted(set(range(len(devices))) - set(current.results))
            raise PassFailed(f"pass {current.pass_id}: no result from {', '.join(devices[r] for r in missing)} "
                             f"within {self._pass_deadline_s(plan, len(tokens)):.1f} s")
        with self._changed:
            if self._pass is current:
                self._pass = None
            if self._stopped:
                raise _Stopped()
        if len(current.results) < current.ranks:
            raise PassFailed(f"pass {current.pass_id} was given up")
        return current.results

    def _pass_deadline_s(self, plan: HmpPlan, tokens: int) -> float:
        # A slice lost at QoS 0 is asked for again after deadline_s; a pass of a few seconds more than predicted is
        # not lost, only slow.
        predicted = plan.model.total_s * max(1.0, tokens / max(1, self.spec.seq_len))
        return 10.0 * predicted + 3 * self.spec.deadline_s + 5.0

    def _free(self, plan: HmpPlan, epoch: int, requests: list[int]) -> None:
        for device in plan.shares.devices:
            try:
                self.bus.publish(topics.request(device, self.worker_service),
                                 ShardFree(job_id=self.spec.name, epoch=epoch, requests=requests))
            except EdgeswarmError as exc:
                log.debug("could not free requests %s on %s: %s", requests, device, exc)

    def _on_result(self, msg: Inbound, body: ShardResult) -> None:
        with self._changed:
            plan, current = self._plan, self._pass
            devices = plan.shares.devices if plan is not None else []
            sender = devices[body.rank] if body.rank < len(devices) else None
            foreign = plan is not None and (sender is None or stranger(msg, sender, "") is not None)
            ok = (not foreign and current is not None and body.pass_id == current.pass_id
                  and body.epoch == self._epoch and body.rank not in current.results)
            if ok:
                assert current is not None
                current.results[body.rank] = (body, msg.tensor.to_torch() if msg.tensor is not None else None)
                if len(current.results) == current.ranks:
                    current.done.set()
        if not ok:
            self.bus.metrics.count("hmp_results_dropped")
            if foreign:
                count_stranger(self.bus.metrics)
            _limited.warning("result", "job %s: dropped the result of pass %d (epoch %d, rank %d) from %s: not a "
                             "rank's result of the pass under way", self.spec.name, body.pass_id, body.epoch,
                             body.rank, msg.sender)

    def progress(self) -> dict[str, Any]:
        """The progress fields of the job's state now (see HmpProgress)."""
        priced = self.refitted()
        with self._changed:
            s = self._stats
            return {"answered": s.answered, "errors": self._errors, "recomputed": s.recomputed,
                    "queued": len(self._queue), "tokens": s.tokens, "reconfigurations": self._reconfigurations,
                    "latency_p50_s": percentile(sorted(s.latencies), 0.5),
                    "latency_p99_s": percentile(sorted(s.latencies), 0.99),
                    "ttft_p50_s": percentile(sorted(s.ttfts), 0.5), "tpot_p50_s": percentile(sorted(s.tpots), 0.5),
                    "tokens_per_s": s.decoded / s.decode_s if s.decode_s > 0 else None,
                    "split": s.split, "passes": s.passes, "peak_batch": s.peak_batch,
                    "refitted_latency_s": prefill_s(priced.current, self.options().new_tokens)
                    if priced is not None else None}


class _Stopped(EdgeswarmError):
    """The job stopped while a request ran."""


def _tokens(results: dict[int, tuple[ShardResult, Any]], segments: int) -> list[int]:
    """Each segment's next token, from the rank that reports it (-1: none did)."""
    out = [-1] * segments
    for result, _ in results.values():
        for k, token in enumerate(result.tokens[:segments]):
            if token >= 0:
                out[k] = token
    return out


def _rows(results: dict[int, tuple[ShardResult, Any]], tokens: int) -> Any:
    """The final hidden states [tokens, hidden], put together from the ranks' rows. Raises PassFailed when a row is
    missing."""
    import torch

    parts = [(r.row_start, t) for r, t in results.values() if t is not None and t.dim() == 2 and t.numel()]
    if not parts:
        raise PassFailed("no rank sent hidden states")
    full = torch.full((tokens, parts[0][1].shape[1]), float("nan"))
    for start, t in parts:
        full[start:start + t.shape[0]] = t.float()
    if bool(full.isnan().any()):
        raise PassFailed("the ranks' hidden states do not cover every row")
    return full


def _layer_split(results: dict[int, tuple[ShardResult, Any]], layers: int) -> LayerSplit:
    """The per-layer time split of the slowest rank of a pass, in milliseconds."""
    slowest = max((r.split for r, _ in results.values()),
                  key=lambda s: s.compute_s + s.sync_s + s.waiting_s)
    per = 1000.0 / max(1, layers)
    return LayerSplit(compute_ms=slowest.compute_s * per, sync_ms=slowest.sync_s * per,
                      waiting_ms=slowest.waiting_s * per)


def _chat_template(path: str) -> Any:
    from edgeswarm.models.text.chat import ChatTemplate, ChatTemplateError

    try:
        return ChatTemplate.from_folder(path)
    except (OSError, ChatTemplateError) as exc:
        log.warning("model folder %s: its chat template cannot be used (%s); requests must carry text", path, exc)
        return None


def _tokenizer(path: str) -> Any:
    from edgeswarm.models.text.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        log.warning("model folder %s: no tokenizer (%s); requests must carry token ids", path, exc)
        return None
