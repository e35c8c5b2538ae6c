"""The training jobs a stage-worker holds, and their residency: which stages stay in the device's memory.

``StageJobs`` is the table every part of the training program shares (``stage_build``, ``stage_recovery``,
``stage_round``): each job's ``_Stage`` and recovery state by job id, under one condition that is notified when
state arrives. It also keeps the stages within the device's memory: a stage's static bytes are reserved in the node's
memory ledger (``runtime.ledger``, shared with serving and every other program on the node) before the stage is
built, its activations' peak as rounds allocate them, and the reservation goes when the stage is evicted, replaced
or the program closes. At most ``MAX_JOBS`` jobs are held; idle jobs (not in a round) give way, idlest first, to a
new job of this program and, through the ledger's eviction hook, to any other program's reservation on the node.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from edgeswarm.errors import MemoryBudgetError
from edgeswarm.hpp.held import HeldState
from edgeswarm.messages.training import StageAssign
from edgeswarm.runtime.collective_exchange import CollectivePort
from edgeswarm.runtime.exchange import TensorExchange
from edgeswarm.runtime.ledger import MIB
from edgeswarm.runtime.program import WorkerContext
from edgeswarm.runtime.serial import SerialThread

log = logging.getLogger(__name__)

MAX_JOBS = 8  # stages of different jobs held at once; past it, the one idle longest gives way to a new job
PROGRAM = "training"  # this program's name in the node's memory ledger


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
    rounds: SerialThread = field(default_factory=lambda: SerialThread("round"))  # where its rounds run, in turn
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
        self.building: set[str] = set()  # jobs whose new stage holds a reservation but is not in ``stages`` yet
        ctx.ledger.on_pressure(PROGRAM, self._give_way)

    def stage_of(self, job_id: str, epoch: int | None = None) -> _Stage | None:
        """The stage held for ``job_id`` (of plan ``epoch`` when given), or None."""
        with self.ready:
            st = self.stages.get(job_id)
        return st if st is not None and (epoch is None or st.spec.epoch == epoch) else None

    def close(self) -> list[_Stage]:
        """Forget every stage and release its memory; returns the stages (the caller closes their exchanges)."""
        self.ctx.ledger.off_pressure(self._give_way)
        with self.ready:
            stages, self.stages = list(self.stages.values()), {}
        for st in stages:
            self.ctx.ledger.release(PROGRAM, st.spec.job_id)
        return stages

    def make_room(self, spec: StageAssign, static: int) -> None:
        """Reserve ``static`` bytes for job ``spec.job_id``'s stage in the node's memory ledger, first dropping the
        stages of other jobs, idlest first and never one in a round, while MAX_JOBS jobs are held; the ledger's
        pressure hooks make idle jobs give way when the budget is short. Raises MemoryBudgetError with the numbers
        and the holders when it cannot."""
        with self.ready:
            self.building.add(spec.job_id)  # its old stage (a replacement) must not give its reservation away
            others = sorted((st for job, st in self.stages.items() if job != spec.job_id), key=lambda st: st.used)
            count = len(others)
            for st in others:
                if count < MAX_JOBS:
                    break
                if st.spec.job_id not in self.building and self._evict_idle(st, f"job {spec.job_id} needs the room"):
                    count -= 1
        self.ctx.ledger.reserve(
            PROGRAM, spec.job_id, static, service=self.ctx.service,
            what=f"training job {spec.job_id} (stage {spec.stage}, units [{spec.start}, {spec.end}))",
            refusal=f"stage {spec.stage} (units [{spec.start}, {spec.end})) needs {static / MIB:.1f} MiB")

    def unreserve(self, job_id: str) -> None:
        """After an assignment of ``job_id`` failed: its reservation goes back to what the stage still held for the
        job needs (its static bytes), or goes."""
        with self.ready:
            st = self.stages.get(job_id)
            self.building.discard(job_id)
        self.ctx.ledger.release(PROGRAM, job_id)
        if st is not None:
            self.ctx.ledger.grow(PROGRAM, job_id, st.static_bytes)

    def _give_way(self, need: int, why: str, keep: str | None) -> int:
        """The ledger's pressure hook: drop idle stages, idlest first, until ``need`` bytes are freed; never job
        ``keep`` (the one asking) or a stage in a round. Returns the bytes freed."""
        freed = 0
        with self.ready:
            for st in sorted(self.stages.values(), key=lambda st: st.used):
                if freed >= need:
                    break
                if st.spec.job_id == keep or st.spec.job_id in self.building:
                    continue
                held = self.ctx.ledger.held_by(PROGRAM, st.spec.job_id)
                if self._evict_idle(st, why):
                    freed += held
        return freed

    def _evict_idle(self, st: _Stage, why: str) -> bool:
        """Evict ``st`` unless a round holds it (the caller holds ``ready``); whether it was evicted."""
        if not st.round_lock.acquire(blocking=False):
            return False  # in a round: not idle
        try:
            self.evict(st.spec.job_id, why)
        finally:
            st.round_lock.release()
        return True

    def evict(self, job_id: str, why: str) -> None:
        """Forget job ``job_id``'s stage and recovery state and release its memory (the caller holds ``ready``)."""
        st = self.stages.pop(job_id)
        self.held.pop(job_id, None)
        self.ctx.ledger.release(PROGRAM, job_id)
        st.exchange.retire(f"the stage was dropped: {why}")
        threading.Thread(target=st.exchange.close, name="evict", daemon=True).start()  # (its sends may take a while)
        self.ctx.metrics.count("stages_evicted")
        log.warning("dropped the stage of job %s (epoch %d, %.1f MiB): %s", job_id, st.spec.epoch,
                    st.static_bytes / MIB, why)

    def check_memory(self, st: _Stage) -> None:
        """Called as a round allocates activations: the stage's static bytes and the activations it holds now must
        fit the budget beside every other reservation on the node; the reservation grows to the peak. Raises
        MemoryBudgetError with the numbers when they do not fit."""
        ledger, job_id = self.ctx.ledger, st.spec.job_id
        need_own = st.static_bytes + st.stage.held_bytes
        if need_own <= ledger.held_by(PROGRAM, job_id):
            return  # within the peak already reserved: no need to look at the others
        if ledger.grow(PROGRAM, job_id, need_own):  # idle stages of other jobs give way if need be
            return
        budget = self.ctx.device.memory_budget_bytes
        others = ledger.reserved_bytes(exclude=(PROGRAM, job_id))
        need = others + need_own
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

