"""The training program's rounds and data plane: a RoundStart runs the device's strict 1F1B round, peers' tensors
reach the round that waits for them.

A round runs ``training.executor``'s device round on its stage's round thread (``runtime.serial``): the first stage
reads its samples by id, the last its labels; activations go to the next group and gradient rows back to the device
that sent them (spec 6.1); after the last backward the group sums its gradients with a ring AllReduce
(``runtime.collectives``, its slices travelling as ``CollectiveTensor`` through the stage's ``CollectivePort``) and
every replica steps its optimizer. Forward, backward and the step run through ``DeviceProfile.run`` (the emulated
slow-down) under the process's compute gate. Tensors from another job or plan epoch are dropped with a logged error,
as are those from a device that is not the one the plan names; one of the wrong dtype or shape is dropped too and
fails the round it belongs to at once; every wait has a timeout.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from edgeswarm.bus import Inbound
from edgeswarm.devices.compute import synchronized
from edgeswarm.errors import EdgeswarmError, MemoryBudgetError
from edgeswarm.hpp.stage_jobs import StageJobs, TensorKey, _Stage
from edgeswarm.hpp.stage_recovery import Fail, StageRecovery
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.collectives import CollectiveTensor
from edgeswarm.messages.tracing import SpanCat
from edgeswarm.messages.training import RoundDone, RoundStart, StageAbort, StageTensor
from edgeswarm.runtime.exchange import ExchangeAborted, ExchangeTimeout, tensor_problem
from edgeswarm.runtime.senders import count_stranger
from edgeswarm.tracing.spans import Span

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)


class StageRounds:
    """Runs the rounds of every job's stage and routes peers' tensors to them (see the module's docstring)."""

    def __init__(self, jobs: StageJobs, recovery: StageRecovery, fail: Fail) -> None:
        self._jobs, self._ctx, self._recovery, self._fail = jobs, jobs.ctx, recovery, fail

    # --- tensors --------------------------------------------------------------------------------------

    def _tensor_stage(self, msg: Inbound, job_id: str, epoch: int, kind: str) -> _Stage | None:
        """The stage a peer's tensor is for, or None (counted and logged) when this worker holds no stage of its
        job and plan epoch."""
        with self._jobs.ready:
            st = self._jobs.stages.get(job_id)
        if st is None or epoch != st.spec.epoch:
            self._ctx.metrics.count("stage_tensors_dropped.epoch")
            _limited.log(logging.ERROR, "epoch", "dropped a %s tensor for job %s epoch %d from %s: this worker "
                         "holds %s", kind, job_id, epoch, msg.sender,
                         f"job {st.spec.job_id} epoch {st.spec.epoch}" if st else "no stage of that job")
            return None
        return st

    def on_collective(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, CollectiveTensor)
        st = self._tensor_stage(msg, body.job_id, body.epoch, "collective")
        if st is None:
            return
        refused = st.collectives.accept(msg, st.ring, st.spec.rank)
        if refused is None:
            return
        # A forged one is dropped without failing the round (the genuine tensor still comes); a bad one failed it.
        self._ctx.metrics.count(f"stage_tensors_dropped.{'shape' if refused.reason == 'tensor' else refused.reason}")
        if refused.reason == "sender":
            count_stranger(self._ctx.metrics)
        _limited.log(logging.ERROR, refused.reason, "dropped %s", refused.detail)

    def on_tensor(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageTensor)
        metrics = self._ctx.metrics
        st = self._tensor_stage(msg, body.job_id, body.epoch, body.kind)
        if st is None:
            return
        forged = _forged(st, body, msg)
        if forged is not None:  # dropped without failing the round: the genuine tensor still comes
            metrics.count("stage_tensors_dropped.sender")
            count_stranger(metrics)
            _limited.log(logging.ERROR, "sender", "dropped %s", forged)
            return
        problem = tensor_problem(msg.tensor, dtype="float32",
                                 sample_shape={"activation": st.in_shape, "gradient": st.out_shape}.get(body.kind),
                                 what=f"a {body.kind} tensor (round {body.round}, micro-batch {body.micro_batch}) "
                                      f"from {msg.sender}")
        if problem is not None:
            metrics.count("stage_tensors_dropped.shape")
            log.error("dropped %s; round %d fails", problem, body.round)
            st.exchange.fail(body.round, f"dropped {problem}")
            return
        assert msg.tensor is not None
        st.exchange.arrived(body.round, msg.envelope.sender_node, msg.tensor.arrival)
        st.exchange.put(TensorKey(body.round, body.kind, body.micro_batch, body.sender), msg.tensor.to_torch())

    def _send(self, st: _Stage, stage: int, rank: int, tensor: Any, **tags: Any) -> None:
        """Queue ``tensor`` for rank ``rank`` of stage ``stage`` on that peer's outbox (it must not change after);
        its transfer is a span on the link's lane ("link p→p+1", the plan's comm step)."""
        spec = st.spec
        message = StageTensor(job_id=spec.job_id, epoch=spec.epoch, stage=stage, sender=spec.rank, **tags)
        low = min(stage, spec.stage)
        span = self._ctx.tracer.lane(spec.job_id, f"link {low}→{low + 1}").span(
            tags["kind"], "transfer", tags["round"], tags["micro_batch"])
        st.exchange.send(spec.groups[stage][rank], tags["round"], message, tensor, span=span)

    def on_abort(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageAbort)
        st = self._jobs.stage_of(body.job_id, body.epoch)
        if st is not None:
            st.exchange.abort(body.round, body.reason)

    # --- rounds ---------------------------------------------------------------------------------------

    def on_round(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, RoundStart)
        st = self._jobs.stage_of(body.job_id, body.epoch)
        if st is None:
            self._fail(msg, body.job_id, "not_assigned", f"{self._ctx.node} holds no stage of job {body.job_id} "
                       f"epoch {body.epoch}")
            return
        st.rounds.submit(partial(self._round, msg, st, body.round))

    def _round(self, msg: Inbound, st: _Stage, round_index: int) -> None:
        metrics, job_id = self._ctx.metrics, st.spec.job_id
        try:
            with st.round_lock:
                st.used = time.monotonic()
                done = self._run_round(st, round_index)
        except EdgeswarmError as exc:
            metrics.count("rounds_failed")
            log.error("round %d of job %s failed: %s", round_index, job_id, exc)
            reason = ("timeout" if isinstance(exc, ExchangeTimeout) else
                      "aborted" if isinstance(exc, ExchangeAborted) else
                      "memory" if isinstance(exc, MemoryBudgetError) else "error")
            self._fail(msg, job_id, reason, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the requester must hear of it rather than wait out its timeout
            metrics.count("rounds_failed")
            log.exception("round %d of job %s failed", round_index, job_id)
            self._fail(msg, job_id, "error", f"round {round_index}: {type(exc).__name__}: {exc}")
            return
        finally:
            st.exchange.forget(round_index)
            st.collectives.forget(round_index)
            self._jobs.gauges()
        metrics.count("rounds")
        self._ctx.bus.reply(msg, done)

    def _run_round(self, st: _Stage, round_index: int) -> RoundDone:
        from edgeswarm.data.base import round_sample_ids
        from edgeswarm.devices.compute import to_compute
        from edgeswarm.hpp.executor import DeviceIO, Position, Recv, device_round, run_blocking
        from edgeswarm.hpp.routing import stage_sample_ids
        from edgeswarm.runtime.collectives import even_bounds, ring_all_reduce

        spec, stage, exchange, device, on = st.spec, st.stage, st.exchange, self._ctx.device, self._ctx.compute
        p, r, n_stages = spec.stage, spec.rank, len(spec.groups)
        b = sum(spec.shares[0])
        ids = (round_sample_ids(round_index, b * spec.micro_batches, st.dataset.train_size, spec.seed)
               if st.dataset is not None else None)

        def batch(mb: int) -> tuple[Any, Any]:
            if ids is None or st.dataset is None:
                return None, None
            held = stage_sample_ids(spec.shares, ids[mb * b:(mb + 1) * b])[p][r]
            # Read (or generated, seeded) on the CPU as on every device, then moved to where the stage computes.
            return (to_compute(st.dataset.inputs(held), on) if p == 0 else None,
                    to_compute(st.dataset.labels(held), on) if p == n_stages - 1 else None)

        def send(kind: str, to_stage: int, to_rank: int, mb: int, rows: Any) -> None:
            self._send(st, to_stage, to_rank, rows, round=round_index, kind=kind, micro_batch=mb)

        def compute(fn: Any) -> Any:
            # Shared for one forward or backward only, never across a wait for a peer: another job's build waits
            # for this call alone, and rounds of two jobs whose peers are crosswise cannot hold each other up. (A
            # build under way delays the call; that time counts as compute, as the device spent it busy.)
            with self._ctx.gate.computing():
                return device.run(partial(synchronized, fn, on))

        def step() -> None:
            if st.optimizer is not None:
                device.run(partial(synchronized, st.optimizer.step, on))
                st.optimizer.zero_grad(set_to_none=True)

        def recv(request: Recv) -> Any:
            key = TensorKey(round_index, request.kind, request.micro_batch, request.peer)
            return exchange.wait(key, rows=request.rows)

        def group_sum(flat: Any) -> Any:
            send_slice, recv_slice = st.collectives.ring(st.ring, r, round_index)
            return ring_all_reduce(flat, r, even_bounds(flat.numel(), len(st.ring)), send_slice, recv_slice)

        lane = self._ctx.tracer.lane(spec.job_id, f"stage {p}")

        def span(name: str, cat: SpanCat, mb: int | None) -> Span:
            return lane.span(name, cat, round_index, mb)

        exchange.blocked_s = 0.0
        io = DeviceIO(batch=batch, send=send, compute=compute, after_forward=partial(self._jobs.check_memory, st),
                      step=step, blocked_s=lambda: exchange.blocked_s, span=span)
        at = Position(p, r, spec.shares, spec.micro_batches, spec.warmup)
        times = run_blocking(device_round(stage, at, io), recv, group_sum)
        t0 = time.perf_counter()
        if (round_index + 1) % spec.backup_interval == 0:
            self._recovery.snapshot(st, round_index + 1)
        snapshot = time.perf_counter() - t0
        done = RoundDone(job_id=spec.job_id, epoch=spec.epoch, round=round_index, stage=p, rank=r,
                         loss_sum=stage.loss_sum, correct=stage.correct, terms=stage.terms, compute_s=times.compute_s,
                         compute_cpu_s=times.compute_cpu_s, wait_s=times.wait_s, overhead_s=times.overhead_s,
                         forward_s=times.forward_s, backward_s=times.backward_s, allreduce_s=times.allreduce_s,
                         peak_live=stage.peak_live, peak_activation_bytes=stage.peak_held_bytes,
                         static_bytes=st.static_bytes, snapshot_s=snapshot,
                         arrivals=exchange.take_arrivals(round_index))
        stage.end_round()
        return done


def _forged(st: _Stage, body: StageTensor, msg: Inbound) -> str | None:
    """Why an activation or gradient does not come from the device of the plan whose stage and rank it claims, or
    None. (The AllReduce's slices have the ring's own check: ``CollectivePort.accept``.)"""
    spec = st.spec
    source = {"activation": spec.stage - 1, "gradient": spec.stage + 1}[body.kind]
    group = spec.groups[source] if 0 <= source < len(spec.groups) and body.stage == spec.stage else []
    if body.sender < len(group) and group[body.sender] == msg.envelope.sender_node:
        return None
    return (f"a {body.kind} tensor from {msg.sender} for stage {body.stage}, claiming rank {body.sender} of stage "
            f"{source}: that is not {msg.envelope.sender_node} in this plan")
