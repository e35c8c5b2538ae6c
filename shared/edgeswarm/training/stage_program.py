"""The stage-worker's training program: one stage of each HPP training job this worker takes part in.

A StageAssign builds the stage (units [start, end) of the zoo model, initialised from the model's seed, so every
replica starts identical) and its optimizer. A RoundStart runs the device's strict 1F1B round
(``training.executor``) on a round thread: the first stage reads its samples by id, the last its labels;
activations go to the next group and gradient rows back to the device that sent them (spec 6.1); after the last
backward the group sums its gradients with a ring AllReduce (``runtime.collectives``, its slices travelling as
``CollectiveTensor`` through the stage's ``CollectivePort``) and every replica steps its optimizer. Tensors travel
through the stage's ``TensorExchange``. Tensors from another job or plan epoch are dropped with a
logged error; one of the wrong dtype or shape is dropped too and fails the round it belongs to at once; every wait
has a timeout.

Jobs are kept by job id: a worker may hold stages of several jobs at once (an assignment of job A never retires or
replaces job B's stage; a new assignment of the same job replaces that job's stage), and every message is routed
to its job's stage and recovery state. Rounds of different jobs run at the same time; they share the device and
the process's compute gate (see ``runtime.program``).

The worker computes as its device class: forward, backward and the optimizer step run through
``DeviceProfile.run`` (the emulated slow-down) on the class's thread count, and the stages held, with their
weights, gradients, optimizer state and held activations (Eq. 3), must fit the device's memory budget: a stage's
static part is measured on torch's meta device and checked before the stage is built (stages of other jobs idle
longest make room, or the assignment fails with the numbers), the activations as they are allocated.

Weights, activations, gradients and optimizer state live on the worker's compute device (``WorkerContext.compute``:
CUDA on a Jetson, the CPU when emulated). The stage is built and initialised on the CPU (so every replica, whatever
it computes on, starts from the same seeded weights) and then moved; samples are generated on the CPU by id and
moved; peers' tensors reach it through the exchange, which moves them; tensors go to host memory only at the wire
(sends, unit states, checkpoints), and restored state is copied back into the device's tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from edgeswarm.bus import Inbound
from edgeswarm.errors import CheckpointTransferError, EdgeswarmError, MemoryBudgetError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.collectives import CollectiveTensor
from edgeswarm.messages.training import (
    HeldBackup,
    HeldSnapshot,
    RoundDone,
    RoundStart,
    StageAbort,
    StageAssign,
    StageFailed,
    StageHeld,
    StageInventory,
    StageReady,
    StageSave,
    StageSaved,
    StageSendState,
    StageState,
    StageStateSent,
    StageTensor,
)
from edgeswarm.runtime.collective_exchange import CollectivePort
from edgeswarm.runtime.exchange import ExchangeAborted, ExchangeTimeout, TensorExchange, tensor_problem
from edgeswarm.runtime.outbox import Outbox
from edgeswarm.runtime.program import WorkerContext
from edgeswarm.training.held import HeldState, StateMissing, UnitStates
from edgeswarm.wire import Message

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

REUSE_WAIT_S = 5.0  # how long a restore waits for an aborted round to leave the stage it would reuse
MAX_JOBS = 8  # stages of different jobs held at once; past it, the one idle longest gives way to a new job
MIB = 1 << 20


class RestoreError(EdgeswarmError):
    """A restoring stage could not get the state of its units."""


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


class TrainingProgram:
    """The WorkerProgram of HPP training (see the module's docstring). ``wait_s`` is the longest wait, in seconds,
    for one tensor or unit state from a peer."""

    handles: tuple[type[Message], ...] = (StageAssign, RoundStart, StageSave, StageAbort, StageSendState,
                                          StageInventory)
    tensors: tuple[type[Message], ...] = (StageTensor, CollectiveTensor, StageState)

    def __init__(self, ctx: WorkerContext, *, wait_s: float = 120.0) -> None:
        self._ctx = ctx
        self._wait_s = wait_s
        self._stages: dict[str, _Stage] = {}  # job id -> its stage
        self._held: dict[str, HeldState] = {}  # job id -> its snapshots and the backups held for its devices
        self._state_out: dict[str, Outbox] = {}  # peer -> sender of backups (of every job, in order)
        self._ready = threading.Condition()  # guards the dicts above; notified when state arrives
        self._requests = {StageAssign: self._on_assign, RoundStart: self._on_round, StageSave: self._on_save,
                          StageAbort: self._on_abort, StageSendState: self._on_send_state,
                          StageInventory: self._on_inventory}

    # --- WorkerProgram --------------------------------------------------------------------------------

    def job_of(self, body: Message) -> str:
        return str(getattr(body, "job_id", ""))

    def holds(self, job_id: str) -> bool:
        with self._ready:
            return job_id in self._stages or job_id in self._held

    def on_request(self, msg: Inbound) -> None:
        self._requests[type(msg.body)](msg)

    def on_tensor(self, msg: Inbound) -> None:
        if isinstance(msg.body, StageTensor):
            self._on_tensor(msg)
        elif isinstance(msg.body, CollectiveTensor):
            self._on_collective(msg)
        else:
            self._on_state(msg)

    def refuse(self, msg: Inbound, job_id: str, reason: str, detail: str) -> None:
        self._fail(msg, job_id, reason, detail)

    def close(self) -> None:
        with self._ready:
            stages, self._stages = list(self._stages.values()), {}
        for st in stages:
            st.exchange.close(timeout_s=1.0)
        for outbox in self._state_out.values():
            outbox.close(timeout_s=1.0)

    def _stage_of(self, job_id: str, epoch: int | None = None) -> _Stage | None:
        """The stage held for ``job_id`` (of plan ``epoch`` when given), or None."""
        with self._ready:
            st = self._stages.get(job_id)
        return st if st is not None and (epoch is None or st.spec.epoch == epoch) else None

    # --- assignment -----------------------------------------------------------------------------------

    def _on_assign(self, msg: Inbound) -> None:
        # Building (and restoring, which waits for peers' state) runs apart from the request topic's thread, so
        # the requests that make peers send that state, and probes, are still answered meanwhile.
        assert isinstance(msg.body, StageAssign)
        threading.Thread(target=self._assign, args=(msg, msg.body), name="assign", daemon=True).start()

    def _assign(self, msg: Inbound, spec: StageAssign) -> None:
        started = time.monotonic()
        with self._ready:
            old = self._stages.get(spec.job_id)
            if old is not None:
                # A round of the old plan may wait for tensors that will never come (its peers were re-assigned,
                # or the broker restarted and lost them): it gives up now rather than at its timeout.
                old.exchange.retire("a new assignment replaces the stage")
            # Peers may send the units this assignment restores while the stage is still being built.
            self._held.setdefault(spec.job_id, HeldState(spec.job_id))
            self._ready.notify_all()
        try:
            st = self._reuse(spec, old)
            if st is None:
                with self._ctx.gate.building():
                    st = self._build(spec)
            restored = (self._restore(st) if spec.restore else
                        self._restore_checkpoint(st) if spec.checkpoint is not None else 0)
        except EdgeswarmError as exc:
            self._fail(msg, spec.job_id, "memory" if isinstance(exc, MemoryBudgetError) else
                       "timeout" if isinstance(exc, ExchangeTimeout) else "bad_request", str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the requester must hear of it rather than wait out its timeout
            log.exception("building stage %d of job %s failed", spec.stage, spec.job_id)
            self._fail(msg, spec.job_id, "error", f"building the stage failed: {type(exc).__name__}: {exc}")
            return
        with self._ready:
            replaced = self._stages.get(spec.job_id)
            self._stages[spec.job_id] = st
            held = self._held.setdefault(spec.job_id, HeldState(spec.job_id))  # (evicted meanwhile)
            held.forget_after(spec.resume_round)
            held.epoch = spec.epoch
            self._ready.notify_all()
        if replaced is not None and replaced is not st:
            replaced.exchange.close()
        self._snapshot(st, spec.resume_round)
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
        from edgeswarm.training.stage import StageCompute

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
        import torch

        from edgeswarm.models.sequence import layer_sequence
        from edgeswarm.models.zoo import build_model
        from edgeswarm.training.data import open_dataset
        from edgeswarm.training.footprint import stage_footprint
        from edgeswarm.training.jobs import make_optimizer
        from edgeswarm.training.stage import StageCompute
        from edgeswarm.training.unit_state import unit_names

        device, node = self._ctx.device, self._ctx.node
        # Measured on the meta device, before any weight exists: an assignment too large for this device is refused
        # without allocating it (Eq. 3's static part; activations are counted as rounds run, in _check_memory).
        static = stage_footprint(spec.model, spec.start, spec.end).static_bytes(spec.optimizer.name)
        if static > device.memory_budget_bytes:
            raise MemoryBudgetError(
                f"stage {spec.stage} (units [{spec.start}, {spec.end})) needs {static / MIB:.1f} MiB for weights, "
                f"gradients, {spec.optimizer.name} state and buffers alone, but {node} "
                f"({device.device_class}) has a memory budget of {device.memory_budget_bytes / MIB:.1f} MiB")
        self._make_room(spec, static)
        if device.compute_threads is not None:
            torch.set_num_threads(device.compute_threads)
        last = spec.stage == len(spec.groups) - 1
        compute = self._ctx.compute
        sequence = layer_sequence(build_model(spec.model))
        module = sequence.build_stage(spec.start, spec.end).to(compute)
        in_shape, out_shape, sample = _sample_shapes(sequence, spec)
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

    def _make_room(self, spec: StageAssign, static: int) -> None:
        """Drop the stages of other jobs, idlest first and never one in a round, until a stage of ``static``
        bytes fits the memory budget beside the rest and fewer than MAX_JOBS jobs are held; raises
        MemoryBudgetError with the numbers when it cannot."""
        budget = self._ctx.device.memory_budget_bytes
        with self._ready:
            others = sorted((st for job, st in self._stages.items() if job != spec.job_id), key=lambda st: st.used)
            held, count = sum(st.static_bytes for st in others), len(others)
            for st in others:
                if held + static <= budget and count < MAX_JOBS:
                    return
                if not st.round_lock.acquire(blocking=False):
                    continue  # in a round: not idle
                try:
                    self._evict(st.spec.job_id, f"job {spec.job_id} needs the room")
                finally:
                    st.round_lock.release()
                held, count = held - st.static_bytes, count - 1
            if held + static > budget:
                raise MemoryBudgetError(
                    f"stage {spec.stage} (units [{spec.start}, {spec.end})) needs {static / MIB:.1f} MiB, and the "
                    f"stages of other jobs in a round on {self._ctx.node} hold {held / MIB:.1f} MiB of its memory "
                    f"budget of {budget / MIB:.1f} MiB")

    def _evict(self, job_id: str, why: str) -> None:
        """Forget job ``job_id``'s stage and recovery state (the caller holds ``_ready``)."""
        st = self._stages.pop(job_id)
        self._held.pop(job_id, None)
        st.exchange.retire(f"the stage was dropped: {why}")
        threading.Thread(target=st.exchange.close, name="evict", daemon=True).start()  # (its sends may take a while)
        self._ctx.metrics.count("stages_evicted")
        log.warning("dropped the stage of job %s (epoch %d, %.1f MiB): %s", job_id, st.spec.epoch,
                    st.static_bytes / MIB, why)

    # --- recovery state -------------------------------------------------------------------------------

    def _restore(self, st: _Stage) -> int:
        """Load every unit's state at the start of the resume round from the sources the assignment names: this
        worker's own snapshot or backup, or a peer's StageState messages. Returns the bytes received from peers."""
        from edgeswarm.training.unit_state import load_units, state_nbytes

        spec, node = st.spec, self._ctx.node
        states: UnitStates = {}
        deadline = time.monotonic() + self._wait_s
        received = 0
        with self._ready:
            held = self._held.get(spec.job_id)
            for source in spec.restore:
                if source.node != node:
                    continue
                if held is None:
                    raise RestoreError(f"{node} holds no state of job {spec.job_id} to restore from")
                try:
                    states.update(held.units(spec.resume_round, source.owner, [source.unit]))
                except StateMissing as exc:
                    raise RestoreError(f"{node} cannot restore unit {source.unit}: {exc}") from None
            for source in spec.restore:
                if source.node == node:
                    continue
                key = (spec.epoch, spec.resume_round, source.unit)
                while (held := self._held.get(spec.job_id)) is None or key not in held.incoming:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ExchangeTimeout(f"the state of unit {source.unit} (round {spec.resume_round}) did not "
                                              f"arrive from {source.node} within {self._wait_s:.0f} s")
                    self._ready.wait(min(left, 1.0))
                states[source.unit] = held.incoming.pop(key)
                received += state_nbytes(states[source.unit])
        load_units(st.stage.module, st.optimizer, states, st.names)
        return received

    def _restore_checkpoint(self, st: _Stage) -> int:
        """Load every unit's state from the checkpoint version the assignment names, reading only the checkpoint
        stages that hold this stage's units. Returns the bytes received from the store."""
        from edgeswarm.training.layout import load_stage
        from edgeswarm.training.unit_state import checkpoint_units, load_units

        spec, source = st.spec, st.spec.checkpoint
        assert source is not None
        tensors: dict[str, Any] = {}
        for k, (start, end) in enumerate(source.stages):
            if start < spec.end and end > spec.start:
                try:
                    tensors.update(load_stage(self._ctx.bus, source.store_node, spec.job_id, k, source.version,
                                              timeout_s=self._wait_s))
                except EdgeswarmError as exc:
                    raise RestoreError(f"{self._ctx.node} cannot load stage {k} of checkpoint version "
                                       f"{source.version} of job {spec.job_id}: {exc}") from exc
        load_units(st.stage.module, st.optimizer,
                   checkpoint_units(tensors, st.stage.module, st.names, spec.start, spec.end), st.names)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _snapshot(self, st: _Stage, round_index: int) -> None:
        """Keep this stage's state at the start of ``round_index`` and, for a single-device stage, send it to its
        backup device (in the background: the round goes on)."""
        from edgeswarm.training.unit_state import extract_units

        spec = st.spec
        units = extract_units(st.stage.module, st.optimizer, st.names, spec.start, spec.end)
        with self._ready:
            held = self._held.get(spec.job_id)
            if self._stages.get(spec.job_id) is not st or held is None:
                return  # a newer assignment replaced this stage while it finished an aborted round
            held.add_snapshot(round_index, units)
            if spec.backup_to:
                outbox = self._state_out.get(spec.backup_to)
                if outbox is None:
                    outbox = self._state_out[spec.backup_to] = Outbox(spec.backup_to, self._backup_failed)
        if spec.backup_to:
            for unit, state in units.items():
                outbox.put(round_index, partial(self._send_state, spec.backup_to, spec.job_id, spec.epoch,
                                                round_index, unit, state, "backup"))

    def _send_state(self, to: str, job_id: str, epoch: int, round_index: int, unit: int, state: dict[str, Any],
                    purpose: str) -> int:
        from edgeswarm.training.unit_state import pack_units

        entries, flat = pack_units(state)
        message = StageState(job_id=job_id, epoch=epoch, round=round_index, unit=unit, owner=self._ctx.node,
                             purpose=purpose, entries=entries)  # type: ignore[arg-type]
        return self._ctx.bus.send_tensor(to, self._ctx.service, message, flat)

    def _backup_failed(self, round_index: object, reason: str) -> None:
        self._ctx.metrics.count("backups_failed")
        log.error("the backup of round %s was not delivered: %s", round_index, reason)

    def _on_state(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageState)
        from edgeswarm.training.unit_state import unpack_units

        metrics = self._ctx.metrics
        if msg.tensor is None:
            log.error("dropped a unit state from %s without its tensor", msg.sender)
            return
        try:
            state = unpack_units(body.entries, msg.tensor.to_torch())
        except EdgeswarmError as exc:
            metrics.count("states_dropped")
            log.error("dropped the state of unit %d from %s: %s", body.unit, msg.sender, exc)
            return
        with self._ready:
            held = self._held.get(body.job_id)
            if held is None:
                metrics.count("states_dropped")
                log.error("dropped a %s of unit %d of job %s from %s: this worker holds no stage of that job",
                          body.purpose, body.unit, body.job_id, msg.sender)
                return
            if body.purpose == "backup":
                if body.owner != msg.envelope.sender_node:
                    metrics.count("states_dropped")
                    _limited.log(logging.ERROR, "backup", "dropped a backup from %s that claims to be %s's",
                                 msg.sender, body.owner)
                    return
                if not held.add_backup(body.owner, body.epoch, body.round, body.unit, state):
                    log.info("dropped a stale backup of %s (epoch %d, round %d)", body.owner, body.epoch, body.round)
            elif body.purpose == "gather":
                held.add_snapshot(body.round, {body.unit: state})
            else:
                held.incoming[(body.epoch, body.round, body.unit)] = state
            self._ready.notify_all()

    def _on_send_state(self, msg: Inbound) -> None:
        assert isinstance(msg.body, StageSendState)
        threading.Thread(target=self._ship, args=(msg, msg.body), name="ship", daemon=True).start()

    def _ship(self, msg: Inbound, body: StageSendState) -> None:
        """Send the asked units to the restoring device, back to back on this link (other links run at the same
        time on their own threads), then answer."""
        started = time.monotonic()
        with self._ready:
            held = self._held.get(body.job_id)
            try:
                if held is None:
                    raise StateMissing(f"{self._ctx.node} holds no state of job {body.job_id}")
                units = held.units(body.round, body.owner, body.units)
            except StateMissing as exc:
                self._fail(msg, body.job_id, "bad_request", str(exc))
                return
        sent = 0
        try:
            for unit, state in units.items():
                sent += self._send_state(body.to, body.job_id, body.epoch, body.round, unit, state, body.purpose)
        except EdgeswarmError as exc:
            self._fail(msg, body.job_id, "error", f"sending units to {body.to}: {exc}")
            return
        self._ctx.metrics.count("state_bytes_sent", sent)
        self._ctx.bus.reply(msg, StageStateSent(job_id=body.job_id, to=body.to, units=body.units, nbytes=sent,
                                                seconds=time.monotonic() - started))

    def _on_inventory(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageInventory)
        with self._ready:
            held = self._held.get(body.job_id)
            snapshots = [HeldSnapshot(round=r, units=sorted(u))
                         for r, u in sorted(held.snapshots.items())] if held else []
            backups = [HeldBackup(owner=o, round=r, units=sorted(units)) for o, rounds in held.backups.items()
                       for r, (_epoch, units) in rounds.items()] if held else []
        self._ctx.bus.reply(msg, StageHeld(job_id=body.job_id, node=self._ctx.node, snapshots=snapshots,
                                           backups=backups))

    # --- tensors --------------------------------------------------------------------------------------

    def _tensor_stage(self, msg: Inbound, job_id: str, epoch: int, kind: str) -> _Stage | None:
        """The stage a peer's tensor is for, or None (counted and logged) when this worker holds no stage of its
        job and plan epoch."""
        with self._ready:
            st = self._stages.get(job_id)
        if st is None or epoch != st.spec.epoch:
            self._ctx.metrics.count("stage_tensors_dropped.epoch")
            _limited.log(logging.ERROR, "epoch", "dropped a %s tensor for job %s epoch %d from %s: this worker "
                         "holds %s", kind, job_id, epoch, msg.sender,
                         f"job {st.spec.job_id} epoch {st.spec.epoch}" if st else "no stage of that job")
            return None
        return st

    def _on_collective(self, msg: Inbound) -> None:
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
        _limited.log(logging.ERROR, refused.reason, "dropped %s", refused.detail)

    def _on_tensor(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageTensor)
        metrics = self._ctx.metrics
        st = self._tensor_stage(msg, body.job_id, body.epoch, body.kind)
        if st is None:
            return
        forged = _forged(st, body, msg)
        if forged is not None:  # dropped without failing the round: the genuine tensor still comes
            metrics.count("stage_tensors_dropped.sender")
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
        st.exchange.put(TensorKey(body.round, body.kind, body.micro_batch, body.sender), msg.tensor.to_torch())

    def _send(self, st: _Stage, stage: int, rank: int, tensor: Any, **tags: Any) -> None:
        """Queue ``tensor`` for rank ``rank`` of stage ``stage`` on that peer's outbox (it must not change after)."""
        spec = st.spec
        message = StageTensor(job_id=spec.job_id, epoch=spec.epoch, stage=stage, sender=spec.rank, **tags)
        st.exchange.send(spec.groups[stage][rank], tags["round"], message, tensor)

    def _on_abort(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageAbort)
        st = self._stage_of(body.job_id, body.epoch)
        if st is not None:
            st.exchange.abort(body.round, body.reason)

    # --- rounds ---------------------------------------------------------------------------------------

    def _on_round(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, RoundStart)
        st = self._stage_of(body.job_id, body.epoch)
        if st is None:
            self._fail(msg, body.job_id, "not_assigned", f"{self._ctx.node} holds no stage of job {body.job_id} "
                       f"epoch {body.epoch}")
            return
        threading.Thread(target=self._round, args=(msg, st, body.round), name="round", daemon=True).start()

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
            self._gauges()
        metrics.count("rounds")
        self._ctx.bus.reply(msg, done)

    def _run_round(self, st: _Stage, round_index: int) -> RoundDone:
        from edgeswarm.devices.compute import to_compute
        from edgeswarm.runtime.collectives import even_bounds, ring_all_reduce
        from edgeswarm.training.data import round_sample_ids
        from edgeswarm.training.executor import DeviceIO, Position, Recv, device_round, run_blocking
        from edgeswarm.training.routing import stage_sample_ids

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
                return device.run(partial(_synchronized, fn, on))

        def step() -> None:
            if st.optimizer is not None:
                device.run(partial(_synchronized, st.optimizer.step, on))
                st.optimizer.zero_grad(set_to_none=True)

        def recv(request: Recv) -> Any:
            key = TensorKey(round_index, request.kind, request.micro_batch, request.peer)
            return exchange.wait(key, rows=request.rows)

        def group_sum(flat: Any) -> Any:
            send_slice, recv_slice = st.collectives.ring(st.ring, r, round_index)
            return ring_all_reduce(flat, r, even_bounds(flat.numel(), len(st.ring)), send_slice, recv_slice)

        exchange.blocked_s = 0.0
        io = DeviceIO(batch=batch, send=send, compute=compute, after_forward=partial(self._check_memory, st),
                      step=step, blocked_s=lambda: exchange.blocked_s)
        at = Position(p, r, spec.shares, spec.micro_batches, spec.warmup)
        times = run_blocking(device_round(stage, at, io), recv, group_sum)
        t0 = time.perf_counter()
        if (round_index + 1) % spec.backup_interval == 0:
            self._snapshot(st, round_index + 1)
        snapshot = time.perf_counter() - t0
        done = RoundDone(job_id=spec.job_id, epoch=spec.epoch, round=round_index, stage=p, rank=r,
                         loss_sum=stage.loss_sum, correct=stage.correct, terms=stage.terms, compute_s=times.compute_s,
                         compute_cpu_s=times.compute_cpu_s, wait_s=times.wait_s, overhead_s=times.overhead_s,
                         forward_s=times.forward_s, backward_s=times.backward_s, allreduce_s=times.allreduce_s,
                         peak_live=stage.peak_live, peak_activation_bytes=stage.peak_held_bytes,
                         static_bytes=st.static_bytes, snapshot_s=snapshot)
        stage.end_round()
        return done

    def _gauges(self) -> None:
        """Publish how many jobs this worker holds and how many peer tensors wait to be taken (a tensor a finished
        round left behind is dropped with it: a count that grows says a peer sends what nobody takes)."""
        with self._ready:
            stages = list(self._stages.values())
        self._ctx.metrics.gauge("stage_jobs", len(stages))
        self._ctx.metrics.gauge("exchange_pending", sum(st.exchange.pending() for st in stages))

    def _check_memory(self, st: _Stage) -> None:
        with self._ready:
            others = sum(o.static_bytes for job, o in self._stages.items() if job != st.spec.job_id)
        need = others + st.static_bytes + st.stage.held_bytes
        budget = self._ctx.device.memory_budget_bytes
        if need > budget:
            beside = f" + {others / MIB:.1f} MiB of other jobs' stages" if others else ""
            raise MemoryBudgetError(
                f"stage {st.spec.stage} on {self._ctx.node} ({self._ctx.device.device_class}) needs {need / MIB:.1f} "
                f"MiB with {st.stage.live} micro-batches live ({st.static_bytes / MIB:.1f} MiB of weights, "
                f"gradients, optimizer state and buffers + {st.stage.held_bytes / MIB:.1f} MiB of activations"
                f"{beside}) but its memory budget is {budget / MIB:.1f} MiB")

    # --- saving ---------------------------------------------------------------------------------------

    def _on_save(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageSave)
        st = self._stage_of(body.job_id, body.epoch)
        if st is None:
            self._fail(msg, body.job_id, "not_assigned", f"{self._ctx.node} holds no stage of job {body.job_id}")
            return
        from edgeswarm.checkpoints.client import save_checkpoint
        from edgeswarm.devices.compute import host_copies
        from edgeswarm.training.layout import stage_entry
        from edgeswarm.training.unit_state import checkpoint_tensors

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


def _synchronized(fn: Any, compute: Any) -> Any:
    """``fn()``, returning once the kernels it queued on ``compute`` have finished: a round's compute figures (and
    the emulated slow-down) must cover the work itself, not only its launch on an accelerator."""
    from edgeswarm.devices.compute import synchronize

    result = fn()
    synchronize(compute)
    return result


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
