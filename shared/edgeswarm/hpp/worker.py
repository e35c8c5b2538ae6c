"""The stage-worker's training program: one stage of each HPP training job this worker takes part in.

The program only routes: each request and tensor goes to the part that does that job, for the job it names.

* ``stage_jobs``: the jobs held (``StageJobs``: each job's stage and recovery state by job id) and their residency in
  the device's memory: at most ``MAX_JOBS`` jobs, idle ones giving way to new ones, activations checked as rounds
  allocate them.
* ``stage_build``: a StageAssign builds (or reuses) the stage, restores it, answers StageReady.
* ``stage_round``: a RoundStart runs the device's strict 1F1B round with the group's AllReduce; peers' activations,
  gradients and AllReduce slices reach the round that waits for them; StageAbort aborts one.
* ``stage_recovery``: snapshots, backups sent to and held for peers, StageSendState and StageInventory.
* here: StageSave writes the stage to the checkpoint store.

Jobs are kept by job id: a worker may hold stages of several jobs at once (an assignment of job A never retires or
replaces job B's stage; a new assignment of the same job replaces that job's stage), and every message is routed
to its job's stage and recovery state. Rounds of different jobs run at the same time; they share the device and
the process's compute gate (see ``runtime.program``).

Weights, activations, gradients and optimizer state live on the worker's compute device (``WorkerContext.compute``:
CUDA on a Jetson, the CPU when emulated). The stage is built and initialised on the CPU (so every replica, whatever
it computes on, starts from the same seeded weights) and then moved; samples are generated on the CPU by id and
moved; peers' tensors reach it through the exchange, which moves them; tensors go to host memory only at the wire
(sends, unit states, checkpoints), and restored state is copied back into the device's tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from edgeswarm.bus import Inbound
from edgeswarm.errors import CheckpointTransferError, EdgeswarmError
from edgeswarm.hpp.stage_build import StageBuilder
from edgeswarm.hpp.stage_jobs import MAX_JOBS, StageJobs, TensorKey
from edgeswarm.hpp.stage_recovery import RestoreError, StageRecovery
from edgeswarm.hpp.stage_round import StageRounds
from edgeswarm.messages.collectives import CollectiveTensor
from edgeswarm.messages.training import (
    RoundStart,
    StageAbort,
    StageAssign,
    StageFailed,
    StageInventory,
    StageSave,
    StageSaved,
    StageSendState,
    StageState,
    StageTensor,
)
from edgeswarm.runtime.program import WorkerContext
from edgeswarm.wire import Message

log = logging.getLogger(__name__)

__all__ = ["MAX_JOBS", "RestoreError", "TensorKey", "TrainingProgram"]


class TrainingProgram:
    """The WorkerProgram of HPP training (see the module's docstring). ``wait_s`` is the longest wait, in seconds,
    for one tensor or unit state from a peer."""

    handles: tuple[type[Message], ...] = (StageAssign, RoundStart, StageSave, StageAbort, StageSendState,
                                          StageInventory)
    tensors: tuple[type[Message], ...] = (StageTensor, CollectiveTensor, StageState)

    def __init__(self, ctx: WorkerContext, *, wait_s: float | None = None) -> None:
        self._ctx = ctx
        wait = ctx.wait_s if wait_s is None else wait_s
        self._jobs = StageJobs(ctx)
        self._recovery = StageRecovery(self._jobs, wait, self._fail)
        self._builder = StageBuilder(self._jobs, self._recovery, wait, self._fail)
        self._rounds = StageRounds(self._jobs, self._recovery, self._fail)
        self._requests: dict[type[Message], Callable[[Inbound], None]] = {
            StageAssign: self._builder.on_assign, RoundStart: self._rounds.on_round, StageSave: self._on_save,
            StageAbort: self._rounds.on_abort, StageSendState: self._recovery.on_send_state,
            StageInventory: self._recovery.on_inventory}
        self._tensors: dict[type[Message], Callable[[Inbound], None]] = {
            StageTensor: self._rounds.on_tensor, CollectiveTensor: self._rounds.on_collective,
            StageState: self._recovery.on_state}

    # --- WorkerProgram --------------------------------------------------------------------------------

    def job_of(self, body: Message) -> str:
        return str(getattr(body, "job_id", ""))

    def holds(self, job_id: str) -> bool:
        with self._jobs.ready:
            return job_id in self._jobs.stages or job_id in self._jobs.held

    def on_request(self, msg: Inbound) -> None:
        self._requests[type(msg.body)](msg)

    def on_tensor(self, msg: Inbound) -> None:
        self._tensors[type(msg.body)](msg)

    def refuse(self, msg: Inbound, job_id: str, reason: str, detail: str) -> None:
        self._fail(msg, job_id, reason, detail)

    def close(self) -> None:
        for st in self._jobs.close():
            st.exchange.close(timeout_s=1.0)
        self._recovery.close()

    # --- saving ---------------------------------------------------------------------------------------

    def _on_save(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageSave)
        st = self._jobs.stage_of(body.job_id, body.epoch)
        if st is None:
            self._fail(msg, body.job_id, "not_assigned", f"{self._ctx.node} holds no stage of job {body.job_id}")
            return
        from edgeswarm.checkpoints.client import save_checkpoint
        from edgeswarm.devices.compute import host_copies
        from edgeswarm.state.layout import stage_entry
        from edgeswarm.state.units import checkpoint_tensors

        name = stage_entry(st.spec.stage)
        # Weights, buffers (BatchNorm statistics: the first device of the group's, as data parallelism keeps) and
        # optimizer state, the same on every replica of the group; in host memory for the wire.
        tensors = host_copies(checkpoint_tensors(st.stage.module, st.optimizer))
        try:
            info = save_checkpoint(self._ctx.bus, body.store_node, body.job_id, name, body.version, tensors)
        except EdgeswarmError as exc:
            # "timeout": the store is away (restarting, say) and a later try may work; "error": it refused.
            self._fail(msg, body.job_id, "timeout" if isinstance(exc, CheckpointTransferError) else "error",
                       f"saving stage {st.spec.stage}: {exc}")
            return
        self._ctx.bus.reply(msg, StageSaved(job_id=body.job_id, stage=st.spec.stage, version=body.version,
                                            checkpoint_stage=name, nbytes=info.nbytes))

    def _fail(self, msg: Inbound, job_id: str, reason: str, detail: str) -> None:
        self._ctx.metrics.count(f"stage_failed.{reason}")
        log.warning("job %s: %s: %s", job_id, reason, detail)
        self._ctx.bus.reply(msg, StageFailed(job_id=job_id, reason=reason, detail=detail[:4096]))  # type: ignore[arg-type]
