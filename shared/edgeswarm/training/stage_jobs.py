"""The training jobs a stage-worker holds, and their residency: which stages stay in the device's memory.

``StageJobs`` is the table every part of the training program shares (``stage_build``, ``stage_recovery``,
``stage_round``): each job's ``_Stage`` and recovery state by job id, under one condition that is notified when
state arrives. It also keeps the stages within the device's memory budget: stages of other jobs idle longest make
room for a new one (never one in a round), at most ``MAX_JOBS`` jobs are held, and a round's activations are checked
as they are allocated.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from edgeswarm.errors import MemoryBudgetError
from edgeswarm.messages.training import StageAssign
from edgeswarm.runtime.collective_exchange import CollectivePort
from edgeswarm.runtime.exchange import TensorExchange
from edgeswarm.runtime.program import WorkerContext
from edgeswarm.training.held import HeldState

log = logging.getLogger(__name__)

MAX_JOBS = 8  # stages of different jobs held at once; past it, the one idle longest gives way to a new job
MIB = 1 << 20


class TensorKey(NamedTuple):
    """A stage's tensor of one round: ``kind`` (activations, gradients) for ``micro_batch`` from rank ``sender`` of
    the stage it comes from. (The AllReduce's slices are ``CollectiveKey``s in the same exchange.)"""

    round: int
    kind: str
    micro_batch: int
    sender: int

    @property
    def scope(self) -> int:
        """The round: a round's waits fail, abort and are forgotten together."""
        return self.round

    def __str__(self) -> str:
        return f"{self.kind} tensor (round {self.round}, micro-batch {self.micro_batch}, from rank {self.sender})"


@dataclass
class _Stage:
    """One job's stage on this worker, as one assignment built it."""

    spec: StageAssign
    stage: Any  # StageCompute
    optimizer: Any
    dataset: Any | None
    static_bytes: int  # weights + gradients + optimizer state + buffers
    in_shape: tuple[int, ...]  # one sample's input to this stage
    out_shape: tuple[int, ...]  # one sample's output of this stage
    names: list[frozenset[str]]  # every unit's parameter and buffer names
    exchange: TensorExchange[Any]  # TensorKey and CollectiveKey
    # Held by a round while it uses the stage, and by a restore that reuses the stage's module.
    round_lock: threading.Lock = field(default_factory=threading.Lock)
    used: float = field(default_factory=time.monotonic)  # last assignment or round: the idlest gives way first
    collectives: CollectivePort = field(init=False)  # the group's AllReduce over ``exchange``

    def __post_init__(self) -> None:
        self.collectives = CollectivePort(self.exchange, self.spec.job_id, epoch=self.spec.epoch)

    @property
    def ring(self) -> list[str]:
        """The nodes of this stage's data-parallel group, by rank: the AllReduce's ring."""
        return self.spec.groups[self.spec.stage]


class StageJobs:
    """The stages and recovery state of every training job this worker holds (see the module's docstring)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.stages: dict[str, _Stage] = {}  # job id -> its stage
        self.held: dict[str, HeldState] = {}  # job id -> its snapshots and the backups held for its devices
        self.ready = threading.Condition()  # guards the dicts above; notified when state arrives

    def stage_of(self, job_id: str, epoch: int | None = None) -> _Stage | None:
        """The stage held for ``job_id`` (of plan ``epoch`` when given), or None."""
        with self.ready:
            st = self.stages.get(job_id)
        return st if st is not None and (epoch is None or st.spec.epoch == epoch) else None

    def close(self) -> list[_Stage]:
        """Forget every stage; returns the stages (the caller closes their exchanges)."""
        with self.ready:
            stages, self.stages = list(self.stages.values()), {}
        return stages

    def make_room(self, spec: StageAssign, static: int) -> None:
        """Drop the stages of other jobs, idlest first and never one in a round, until a stage of ``static``
        bytes fits the memory budget beside the rest and fewer than MAX_JOBS jobs are held; raises
        MemoryBudgetError with the numbers when it cannot."""
        budget = self.ctx.device.memory_budget_bytes
        with self.ready:
            others = sorted((st for job, st in self.stages.items() if job != spec.job_id), key=lambda st: st.used)
            held, count = sum(st.static_bytes for st in others), len(others)
            for st in others:
                if held + static <= budget and count < MAX_JOBS:
                    return
                if not st.round_lock.acquire(blocking=False):
                    continue  # in a round: not idle
                try:
                    self.evict(st.spec.job_id, f"job {spec.job_id} needs the room")
                finally:
                    st.round_lock.release()
                held, count = held - st.static_bytes, count - 1
            if held + static > budget:
                raise MemoryBudgetError(
                    f"stage {spec.stage} (units [{spec.start}, {spec.end})) needs {static / MIB:.1f} MiB, and the "
                    f"stages of other jobs in a round on {self.ctx.node} hold {held / MIB:.1f} MiB of its memory "
                    f"budget of {budget / MIB:.1f} MiB")

    def evict(self, job_id: str, why: str) -> None:
        """Forget job ``job_id``'s stage and recovery state (the caller holds ``ready``)."""
        st = self.stages.pop(job_id)
        self.held.pop(job_id, None)
        st.exchange.retire(f"the stage was dropped: {why}")
        threading.Thread(target=st.exchange.close, name="evict", daemon=True).start()  # (its sends may take a while)
        self.ctx.metrics.count("stages_evicted")
        log.warning("dropped the stage of job %s (epoch %d, %.1f MiB): %s", job_id, st.spec.epoch,
                    st.static_bytes / MIB, why)

    def check_memory(self, st: _Stage) -> None:
        """Called as a round allocates activations: raises MemoryBudgetError with the numbers when the stage's
        static bytes, the activations it holds now and the other jobs' stages exceed the budget."""
        with self.ready:
            others = sum(o.static_bytes for job, o in self.stages.items() if job != st.spec.job_id)
        need = others + st.static_bytes + st.stage.held_bytes
        budget = self.ctx.device.memory_budget_bytes
        if need > budget:
            beside = f" + {others / MIB:.1f} MiB of other jobs' stages" if others else ""
            raise MemoryBudgetError(
                f"stage {st.spec.stage} on {self.ctx.node} ({self.ctx.device.device_class}) needs {need / MIB:.1f} "
                f"MiB with {st.stage.live} micro-batches live ({st.static_bytes / MIB:.1f} MiB of weights, "
                f"gradients, optimizer state and buffers + {st.stage.held_bytes / MIB:.1f} MiB of activations"
                f"{beside}) but its memory budget is {budget / MIB:.1f} MiB")

    def gauges(self) -> None:
        """Publish how many jobs this worker holds and how many peer tensors wait to be taken (a tensor a finished
        round left behind is dropped with it: a count that grows says a peer sends what nobody takes)."""
        with self.ready:
            stages = list(self.stages.values())
        self.ctx.metrics.gauge("stage_jobs", len(stages))
        self.ctx.metrics.gauge("exchange_pending", sum(st.exchange.pending() for st in stages))
