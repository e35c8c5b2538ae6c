"""The training program's assignments: build (or reuse) a job's stage and make it ready.

A StageAssign builds units [start, end) of the zoo model, initialised from the model's seed so every replica
starts identical, and its optimizer; the stage's static part (weights, gradients, optimizer state, buffers) is
measured on torch's meta device and reserved in the node's memory ledger (``StageJobs.make_room``) before any
weight exists; a failed assignment gives the reservation back. The stage is built
and initialised on the CPU and then moved to the worker's compute device. A restore that keeps this worker's units
reuses the stage already built. The stage is then restored (from peers' unit states or a checkpoint) and the worker
answers StageReady, or StageFailed with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from edgeswarm.bus import Inbound
from edgeswarm.devices.compute import use_device_threads
from edgeswarm.errors import MemoryBudgetError
from edgeswarm.hpp.held import HeldState
from edgeswarm.hpp.stage_jobs import MIB, StageJobs, _Stage
from edgeswarm.hpp.stage_recovery import Fail, StageRecovery
from edgeswarm.messages.training import StageAssign, StageReady
from edgeswarm.runtime.exchange import TensorExchange
from edgeswarm.runtime.program import build_failure

log = logging.getLogger(__name__)

REUSE_WAIT_S = 5.0  # how long a restore waits for an aborted round to leave the stage it would reuse


class StageBuilder:
    """Builds the stages assignments ask for (see the module's docstring). ``wait_s`` is the longest wait, in
    seconds, for one tensor from a peer, given to each stage's exchange."""

    def __init__(self, jobs: StageJobs, recovery: StageRecovery, wait_s: float, fail: Fail) -> None:
        self._jobs, self._ctx, self._recovery, self._wait_s, self._fail = jobs, jobs.ctx, recovery, wait_s, fail

    def on_assign(self, msg: Inbound) -> None:
        # Building (and restoring, which waits for peers' state) runs apart from the request topic's thread, so
        # the requests that make peers send that state, and probes, are still answered meanwhile.
        assert isinstance(msg.body, StageAssign)
        threading.Thread(target=self._assign, args=(msg, msg.body), name="assign", daemon=True).start()

    def _assign(self, msg: Inbound, spec: StageAssign) -> None:
        started, jobs = time.monotonic(), self._jobs
        with jobs.ready:
            old = jobs.stages.get(spec.job_id)
            if old is not None:
                # A round of the old plan may wait for tensors that will never come (its peers were re-assigned,
                # or the broker restarted and lost them): it gives up now rather than at its timeout.
                old.exchange.retire("a new assignment replaces the stage")
            # Peers may send the units this assignment restores while the stage is still being built.
            jobs.held.setdefault(spec.job_id, HeldState(spec.job_id))
            jobs.ready.notify_all()
        try:
            st = self._reuse(spec, old)
            if st is None:
                with self._ctx.gate.building():
                    st = self._build(spec)
            restored = (self._recovery.restore(st) if spec.restore else
                        self._recovery.restore_checkpoint(st) if spec.checkpoint is not None else 0)
        except Exception as exc:  # noqa: BLE001 - the requester must hear of it rather than wait out its timeout
            jobs.unreserve(spec.job_id)
            self._fail(msg, spec.job_id, *build_failure(exc, f"building stage {spec.stage} of job {spec.job_id}", log))
            return
        with jobs.ready:
            replaced = jobs.stages.get(spec.job_id)
            jobs.stages[spec.job_id] = st
            held = jobs.held.setdefault(spec.job_id, HeldState(spec.job_id))  # (evicted meanwhile)
            held.forget_after(spec.resume_round)
            held.epoch = spec.epoch
            jobs.building.discard(spec.job_id)
            jobs.ready.notify_all()
        if replaced is not None and replaced is not st:
            replaced.exchange.close()
        self._recovery.snapshot(st, spec.resume_round)
        params = sum(p.numel() for p in st.stage.parameters())
        log.info("job %s epoch %d: stage %d rank %d holds units [%d, %d) (%d parameters)%s", spec.job_id, spec.epoch,
                 spec.stage, spec.rank, spec.start, spec.end, params,
                 f", restored at round {spec.resume_round} ({restored} bytes from peers)" if spec.restore else "")
        self._ctx.bus.reply(msg, StageReady(job_id=spec.job_id, epoch=spec.epoch, stage=spec.stage, rank=spec.rank,
                                            parameters=params, restored_bytes=restored,
                                            restore_s=time.monotonic() - started))

    def _exchange(self, spec: StageAssign) -> TensorExchange[Any]:
        return TensorExchange(self._ctx.bus, self._ctx.service, wait_s=self._wait_s, scope_name="round",
                              name=f"job {spec.job_id} epoch {spec.epoch} stage {spec.stage} rank {spec.rank}",
                              compute=self._ctx.compute)

    def _reuse(self, spec: StageAssign, old: _Stage | None) -> _Stage | None:
        """For a restore that keeps this worker's units (a recovery that moved only other devices' cut points, or
        none), the stage already built, without its aborted round's gradients: the restore then only loads the
        snapshot, with no model to build and no kernels to warm up. None when the stage must be built anew."""
        from edgeswarm.hpp.compute import StageCompute

        if old is None or not spec.restore:
            return None
        was, now = old.spec, spec
        last = len(now.groups) - 1
        if (was.job_id, was.model, was.start, was.end, was.optimizer, was.data, was.seed) != \
                (now.job_id, now.model, now.start, now.end, now.optimizer, now.data, now.seed) or \
                old.stage.first != (now.stage == 0) or old.stage.last != (now.stage == last):
            return None
        if not old.round_lock.acquire(timeout=REUSE_WAIT_S):
            return None  # a round still computes on it: build a fresh one rather than wait
        try:
            for p in old.stage.parameters():
                p.grad = None
            stage = StageCompute(old.stage.module, first=now.stage == 0, last=now.stage == last,
                                 loss_scale=now.loss_scale, compute=self._ctx.compute)
        finally:
            old.round_lock.release()
        return _Stage(spec, stage, old.optimizer, old.dataset, old.static_bytes, old.in_shape, old.out_shape,
                      old.names, self._exchange(spec))

    def _build(self, spec: StageAssign) -> _Stage:

        from edgeswarm.data import open_dataset
        from edgeswarm.hpp.compute import StageCompute
        from edgeswarm.hpp.spec import make_optimizer
        from edgeswarm.models.footprint import stage_footprint
        from edgeswarm.models.sequence import layer_sequence
        from edgeswarm.models.zoo import build_model
        from edgeswarm.state.units import unit_names

        device, node = self._ctx.device, self._ctx.node
        # Measured on the meta device, before any weight exists: an assignment too large for this device is refused
        # without allocating it (Eq. 3's static part; activations are counted as rounds run, in check_memory).
        static = stage_footprint(spec.model, spec.start, spec.end).static_bytes(spec.optimizer.name)
        if static > device.memory_budget_bytes:
            raise MemoryBudgetError(
                f"stage {spec.stage} (units [{spec.start}, {spec.end})) needs {static / MIB:.1f} MiB for weights, "
                f"gradients, {spec.optimizer.name} state and buffers alone, but {node} "
                f"({device.device_class}) has a memory budget of {device.memory_budget_bytes / MIB:.1f} MiB")
        self._jobs.make_room(spec, static)
        use_device_threads(device)
        last = spec.stage == len(spec.groups) - 1
        compute = self._ctx.compute
        sequence = layer_sequence(build_model(spec.model))
        # Shapes first: stages built from one sequence share its submodules, and .to() moves them in place, so a
        # stage moved to an accelerator first would leave the CPU sample run with its weights there (seen on CUDA).
        in_shape, out_shape, sample = _sample_shapes(sequence, spec)
        module = sequence.build_stage(spec.start, spec.end).to(compute)
        stage = StageCompute(module, first=spec.stage == 0, last=last, loss_scale=spec.loss_scale, compute=compute)
        share = spec.shares[spec.stage][spec.rank]
        if share and not spec.restore and spec.checkpoint is None:
            # A restore skips it: the job is down until every stage is ready; the replayed round pays instead.
            stage.warm_up(sample[:1].expand(share, *sample.shape[1:]).contiguous().to(compute))
        dataset = open_dataset(spec.data, spec.model) if spec.stage == 0 or last else None
        params = list(stage.parameters())
        optimizer = make_optimizer(spec.optimizer, params) if params else None  # a stage may have no weights
        return _Stage(spec, stage, optimizer, dataset, static, in_shape, out_shape, unit_names(sequence),
                      self._exchange(spec))


def _sample_shapes(sequence: Any, spec: StageAssign) -> tuple[tuple[int, ...], tuple[int, ...], Any]:
    """One sample's input and output shape for units [start, end), and an example input batch, found by running
    the model's example input through the units before it (no gradients, evaluation mode so BatchNorm
    statistics stay untouched)."""
    import torch

    from edgeswarm.models.zoo import example_stage_input

    x = example_stage_input(spec.model, sequence, spec.start, 2)
    stage = sequence.build_stage(spec.start, spec.end)
    with torch.no_grad():
        stage.eval()
        out = stage(x)
        stage.train()
    return tuple(x.shape[1:]), tuple(out.shape[1:]), x
