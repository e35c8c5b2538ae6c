"""The stage-worker: one per device. It holds one stage of a job's plan and runs its share of every round.

A StageAssign builds the stage (units [start, end) of the zoo model, initialised from the model's seed, so every
replica starts identical) and its optimizer. A RoundStart runs the device's strict 1F1B order with K_p warm-up
forwards on a round thread: the first stage reads its samples by id, the last its labels; activations go to
the next group and gradient rows back to the device that sent them (spec 6.1); after the last backward the
group sums its gradients with a ring AllReduce over MQTT and every replica steps its optimizer. Tensors from
another job or plan epoch are dropped with a logged error; one of the wrong dtype or shape is dropped too and
fails the round it belongs to at once; every wait has a timeout.

The worker computes as its device class: forward, backward and the optimizer step run through
``DeviceProfile.run`` (the emulated slow-down) on the class's thread count, and a stage whose weights, gradients,
optimizer state and held activations (Eq. 3) exceed the memory budget fails with the numbers: the static part is
measured on torch's meta device and checked before the stage is built, the activations as they are allocated.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.errors import CheckpointTransferError, EdgeswarmError
from edgeswarm.logs import RateLimitedLog
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
from edgeswarm.runtime.program import ComputeGate, WorkerContext
from edgeswarm.runtime.service import Service
from edgeswarm.services.stage_worker.held import HeldState, StateMissing, UnitStates
from edgeswarm.services.stage_worker.outbox import Outbox
from edgeswarm.serving.stage import ServeStageProgram

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

WAIT_S = 120.0  # longest wait for one tensor from a peer before the round fails
REUSE_WAIT_S = 5.0  # how long a restore waits for an aborted round to leave the stage it would reuse


MIB = 1 << 20


class RoundTimeout(EdgeswarmError):
    """A peer's tensor did not arrive in time."""


class TensorFlowError(EdgeswarmError):
    """A tensor of the round could not be used (wrong dtype or shape) or could not be sent."""


class MemoryBudgetError(EdgeswarmError):
    """The stage needs more memory than the device's budget."""


class RoundAborted(EdgeswarmError):
    """The coordinator gave the round up."""


class RestoreError(EdgeswarmError):
    """A restoring stage could not get the state of its units."""


@dataclass
class _Job:
    spec: StageAssign
    stage: Any  # StageCompute
    optimizer: Any
    dataset: Any | None
    static_bytes: int  # weights + gradients + optimizer state + buffers
    in_shape: tuple[int, ...]  # one sample's input to this stage
    out_shape: tuple[int, ...]  # one sample's output of this stage
    names: list[frozenset[str]]  # every unit's parameter and buffer names
    inbox: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    bad: dict[int, str] = field(default_factory=dict)  # round -> why a tensor of it could not be used or sent
    aborted: dict[int, str] = field(default_factory=dict)  # round -> why the coordinator gave it up
    outboxes: dict[str, Outbox] = field(default_factory=dict)  # peer node -> its sender thread
    blocked_s: float = 0.0  # this round's time blocked waiting for a peer's tensor
    retired: bool = False  # a newer assignment arrived: rounds still waiting on this stage's peers give up

    def close(self) -> None:
        for outbox in self.outboxes.values():
            outbox.close()


class StageWorkerService(Service):
    name = "stage-worker"

    def setup(self) -> None:
        self._job: _Job | None = None
        self._held: HeldState | None = None  # the current job's snapshots and the backups held for others
        self._state_out: dict[str, Outbox] = {}  # peer -> sender of backups
        self._ready = threading.Condition()
        # Held by a round while it uses the stage's module, and by a build while it traces a model: torch.fx patches
        # Module.__call__ for every thread while it traces, so a forward pass elsewhere meanwhile (another assignment's,
        # or a round's) failed with NameError ("module is not installed as a submodule").
        self._computing = threading.Lock()
        request = topics.request(self.node, self.name)
        self.bus.subscribe(request, self._on_assign, schemas=(StageAssign,))
        self.bus.subscribe(request, self._on_round, schemas=(RoundStart,))
        self.bus.subscribe(request, self._on_save, schemas=(StageSave,))
        self.bus.subscribe(request, self._on_abort, schemas=(StageAbort,))
        self.bus.subscribe(request, self._on_send_state, schemas=(StageSendState,))
        self.bus.subscribe(request, self._on_inventory, schemas=(StageInventory,))
        data = topics.data(self.node, self.name)
        self.bus.subscribe(data, self._on_tensor, schemas=(StageTensor,), plane="data")
        self.bus.subscribe(data, self._on_state, schemas=(StageState,), plane="data")
        self.serving = ServeStageProgram(WorkerContext(self.bus, self.node, self.name, self.device, self.metrics,
                                                       ComputeGate()))
        self.bus.subscribe(request, self.serving.on_request, schemas=self.serving.handles)
        self.bus.subscribe(data, self.serving.on_tensor, schemas=self.serving.tensors, plane="data")

    def teardown(self) -> None:
        self.serving.close()
        for outbox in self._state_out.values():
            outbox.close(timeout_s=1.0)

    # --- assignment ---------------------------------------------------------------------------------

    def _on_assign(self, msg: Inbound) -> None:
        # Building (and restoring, which waits for peers' state) runs apart from the request topic's thread, so
        # the requests that make peers send that state, and probes, are still answered meanwhile.
        assert isinstance(msg.body, StageAssign)
        threading.Thread(target=self._assign, args=(msg, msg.body), name="assign", daemon=True).start()

    def _assign(self, msg: Inbound, spec: StageAssign) -> None:
        started = time.monotonic()
        with self._ready:
            if self._job is not None:
                # A round of the old plan may wait for tensors that will never come (its peers were re-assigned,
                # or the broker restarted and lost them): it gives up now rather than at its timeout.
                self._job.retired = True
            if self._held is None or self._held.job_id != spec.job_id:
                # Peers may send the units this assignment restores while the stage is still being built.
                self._held = HeldState(spec.job_id)
            self._ready.notify_all()
        try:
            job = self._reuse(spec)
            if job is None:
                with self._computing:
                    job = self._build(spec)
            restored = (self._restore(job) if spec.restore else
                        self._restore_checkpoint(job) if spec.checkpoint is not None else 0)
        except EdgeswarmError as exc:
            self._fail(msg, spec.job_id, "memory" if isinstance(exc, MemoryBudgetError) else
                       "timeout" if isinstance(exc, RoundTimeout) else "bad_request", str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the requester must hear of it rather than wait out its timeout
            log.exception("building stage %d of job %s failed", spec.stage, spec.job_id)
            self._fail(msg, spec.job_id, "error", f"building the stage failed: {type(exc).__name__}: {exc}")
            return
        with self._ready:
            old, self._job = self._job, job
            if self._held is None or self._held.job_id != spec.job_id:
                self._held = HeldState(spec.job_id)  # another job's assignment came in meanwhile
            self._held.forget_after(spec.resume_round)
            self._held.epoch = spec.epoch
            self._ready.notify_all()
        if old is not None:
            old.close()
        self._snapshot(job, spec.resume_round)
        params = sum(p.numel() for p in job.stage.parameters())
        log.info("job %s epoch %d: stage %d rank %d holds units [%d, %d) (%d parameters)%s", spec.job_id, spec.epoch,
                 spec.stage, spec.rank, spec.start, spec.end, params,
                 f", restored at round {spec.resume_round} ({restored} bytes from peers)" if spec.restore else "")
        self.bus.reply(msg, StageReady(job_id=spec.job_id, epoch=spec.epoch, stage=spec.stage, rank=spec.rank,
                                       parameters=params, restored_bytes=restored,
                                       restore_s=time.monotonic() - started))

    def _reuse(self, spec: StageAssign) -> _Job | None:
        """For a restore that keeps this worker's units (a recovery that moved only other devices' cut points, or
        none), the stage already built, without its aborted round's gradients: the restore then only loads the
        snapshot, with no model to build and no kernels to warm up. None when the stage must be built anew."""
        from edgeswarm.training.stage import StageCompute

        old = self._job
        if old is None or not spec.restore:
            return None
        was, now = old.spec, spec
        last = len(now.groups) - 1
        if (was.job_id, was.model, was.start, was.end, was.optimizer, was.data, was.seed) != \
                (now.job_id, now.model, now.start, now.end, now.optimizer, now.data, now.seed) or \
                old.stage.first != (now.stage == 0) or old.stage.last != (now.stage == last):
            return None
        if not self._computing.acquire(timeout=REUSE_WAIT_S):
            return None  # a round still computes on it: build a fresh one rather than wait
        try:
            for p in old.stage.parameters():
                p.grad = None
            stage = StageCompute(old.stage.module, first=now.stage == 0, last=now.stage == last,
                                 loss_scale=now.loss_scale)
        finally:
            self._computing.release()
        return _Job(spec, stage, old.optimizer, old.dataset, old.static_bytes, old.in_shape, old.out_shape, old.names)

    def _build(self, spec: StageAssign) -> _Job:
        import torch

        from edgeswarm.models.sequence import layer_sequence
        from edgeswarm.models.zoo import build_model
        from edgeswarm.training.data import open_dataset
        from edgeswarm.training.footprint import stage_footprint
        from edgeswarm.training.jobs import make_optimizer
        from edgeswarm.training.stage import StageCompute
        from edgeswarm.training.unit_state import unit_names

        # Measured on the meta device, before any weight exists: an assignment too large for this device is refused
        # without allocating it (Eq. 3's static part; activations are counted as rounds run, in _check_memory).
        static = stage_footprint(spec.model, spec.start, spec.end).static_bytes(spec.optimizer.name)
        if static > self.device.memory_budget_bytes:
            raise MemoryBudgetError(
                f"stage {spec.stage} (units [{spec.start}, {spec.end})) needs {static / MIB:.1f} MiB for weights, "
                f"gradients, {spec.optimizer.name} state and buffers alone, but {self.node} "
                f"({self.device.device_class}) has a memory budget of {self.device.memory_budget_bytes / MIB:.1f} MiB")
        if self.device.compute_threads is not None:
            torch.set_num_threads(self.device.compute_threads)
        last = spec.stage == len(spec.groups) - 1
        sequence = layer_sequence(build_model(spec.model))
        module = sequence.build_stage(spec.start, spec.end)
        in_shape, out_shape, sample = _sample_shapes(sequence, spec)
        stage = StageCompute(module, first=spec.stage == 0, last=last, loss_scale=spec.loss_scale)
        share = spec.shares[spec.stage][spec.rank]
        if share and not spec.restore and spec.checkpoint is None:
            # A restore skips it: the job is down until every stage is ready; the replayed round pays instead.
            stage.warm_up(sample[:1].expand(share, *sample.shape[1:]).contiguous())
        dataset = open_dataset(spec.data, spec.model) if spec.stage == 0 or last else None
        params = list(stage.parameters())
        optimizer = make_optimizer(spec.optimizer, params) if params else None  # a stage may have no weights
        return _Job(spec, stage, optimizer, dataset, static, in_shape, out_shape, unit_names(sequence))

    # --- recovery state -----------------------------------------------------------------------------

    def _restore(self, job: _Job) -> int:
        """Load every unit's state at the start of the resume round from the sources the assignment names: this
        worker's own snapshot or backup, or a peer's StageState messages. Returns the bytes received from peers."""
        from edgeswarm.training.unit_state import load_units, state_nbytes

        spec = job.spec
        states: UnitStates = {}
        deadline = time.monotonic() + WAIT_S
        received = 0
        with self._ready:
            held = self._held if self._held is not None and self._held.job_id == spec.job_id else None
            for source in spec.restore:
                if source.node != self.node:
                    continue
                if held is None:
                    raise RestoreError(f"{self.node} holds no state of job {spec.job_id} to restore from")
                try:
                    states.update(held.units(spec.resume_round, source.owner, [source.unit]))
                except StateMissing as exc:
                    raise RestoreError(f"{self.node} cannot restore unit {source.unit}: {exc}") from None
            for source in spec.restore:
                if source.node == self.node:
                    continue
                key = (spec.epoch, spec.resume_round, source.unit)
                while self._held is None or key not in self._held.incoming:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RoundTimeout(f"the state of unit {source.unit} (round {spec.resume_round}) did not "
                                           f"arrive from {source.node} within {WAIT_S:.0f} s")
                    self._ready.wait(min(left, 1.0))
                states[source.unit] = self._held.incoming.pop(key)
                received += state_nbytes(states[source.unit])
        load_units(job.stage.module, job.optimizer, states, job.names)
        return received

    def _restore_checkpoint(self, job: _Job) -> int:
        """Load every unit's state from the checkpoint version the assignment names, reading only the checkpoint
        stages that hold this stage's units. Returns the bytes received from the store."""
        from edgeswarm.training.layout import load_stage
        from edgeswarm.training.unit_state import checkpoint_units, load_units

        spec, source = job.spec, job.spec.checkpoint
        assert source is not None
        tensors: dict[str, Any] = {}
        for k, (start, end) in enumerate(source.stages):
            if start < spec.end and end > spec.start:
                try:
                    tensors.update(load_stage(self.bus, source.store_node, spec.job_id, k, source.version,
                                              timeout_s=WAIT_S))
                except EdgeswarmError as exc:
                    raise RestoreError(f"{self.node} cannot load stage {k} of checkpoint version {source.version} "
                                       f"of job {spec.job_id}: {exc}") from exc
        load_units(job.stage.module, job.optimizer,
                   checkpoint_units(tensors, job.stage.module, job.names, spec.start, spec.end), job.names)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _snapshot(self, job: _Job, round_index: int) -> None:
        """Keep this stage's state at the start of ``round_index`` and, for a single-device stage, send it to its
        backup device (in the background: the round goes on)."""
        from edgeswarm.training.unit_state import extract_units

        spec = job.spec
        units = extract_units(job.stage.module, job.optimizer, job.names, spec.start, spec.end)
        with self._ready:
            if self._job is not job or self._held is None:
                return  # a newer assignment replaced this stage while it finished an aborted round
            self._held.add_snapshot(round_index, units)
        if spec.backup_to:
            outbox = self._state_out.get(spec.backup_to)
            if outbox is None:
                outbox = self._state_out[spec.backup_to] = Outbox(spec.backup_to, self._backup_failed)
            for unit, state in units.items():
                outbox.put(round_index, partial(self._send_state, spec.backup_to, spec.job_id, spec.epoch, round_index,
                                                unit, state, "backup"))

    def _send_state(self, to: str, job_id: str, epoch: int, round_index: int, unit: int, state: dict[str, Any],
                    purpose: str) -> int:
        from edgeswarm.training.unit_state import pack_units

        entries, flat = pack_units(state)
        message = StageState(job_id=job_id, epoch=epoch, round=round_index, unit=unit, owner=self.node,
                             purpose=purpose, entries=entries)  # type: ignore[arg-type]
        return self.bus.send_tensor(to, self.name, message, flat)

    def _backup_failed(self, round_index: int, reason: str) -> None:
        self.metrics.count("backups_failed")
        log.error("the backup of round %d was not delivered: %s", round_index, reason)

    def _on_state(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageState)
        from edgeswarm.training.unit_state import unpack_units

        if msg.tensor is None:
            log.error("dropped a unit state from %s without its tensor", msg.sender)
            return
        try:
            state = unpack_units(body.entries, msg.tensor.to_torch())
        except EdgeswarmError as exc:
            self.metrics.count("states_dropped")
            log.error("dropped the state of unit %d from %s: %s", body.unit, msg.sender, exc)
            return
        with self._ready:
            held = self._held
            if held is None or held.job_id != body.job_id:
                self.metrics.count("states_dropped")
                log.error("dropped a %s of unit %d of job %s from %s: this worker holds no stage of that job",
                          body.purpose, body.unit, body.job_id, msg.sender)
                return
            if body.purpose == "backup":
                if body.owner != msg.envelope.sender_node:
                    self.metrics.count("states_dropped")
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
            held = self._held
            try:
                if held is None or held.job_id != body.job_id:
                    raise StateMissing(f"{self.node} holds no state of job {body.job_id}")
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
        self.metrics.count("state_bytes_sent", sent)
        self.bus.reply(msg, StageStateSent(job_id=body.job_id, to=body.to, units=body.units, nbytes=sent,
                                           seconds=time.monotonic() - started))

    def _on_inventory(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageInventory)
        with self._ready:
            held = self._held if self._held is not None and self._held.job_id == body.job_id else None
            snapshots = [HeldSnapshot(round=r, units=sorted(u))
                         for r, u in sorted(held.snapshots.items())] if held else []
            backups = [HeldBackup(owner=o, round=r, units=sorted(units)) for o, rounds in held.backups.items()
                       for r, (_epoch, units) in rounds.items()] if held else []
        self.bus.reply(msg, StageHeld(job_id=body.job_id, node=self.node, snapshots=snapshots, backups=backups))

    # --- tensors ------------------------------------------------------------------------------------

    def _on_tensor(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageTensor)
        with self._ready:
            job = self._job
            if job is None or body.job_id != job.spec.job_id or body.epoch != job.spec.epoch:
                self.metrics.count("stage_tensors_dropped.epoch")
                _limited.log(logging.ERROR, "epoch", "dropped a %s tensor for job %s epoch %d from %s: this worker "
                             "holds %s", body.kind, body.job_id, body.epoch, msg.sender,
                             f"job {job.spec.job_id} epoch {job.spec.epoch}" if job else "no job")
                return
            forged = _forged(job, body, msg)
            if forged is not None:  # dropped without failing the round: the genuine tensor still comes
                self.metrics.count("stage_tensors_dropped.sender")
                _limited.log(logging.ERROR, "sender", "dropped %s", forged)
                return
            problem = _tensor_problem(job, body, msg)
            if problem is not None:
                self.metrics.count("stage_tensors_dropped.shape")
                log.error("dropped %s; round %d fails", problem, body.round)
                job.bad.setdefault(body.round, f"dropped {problem}")
                self._ready.notify_all()
                return
            key = (body.round, body.kind, body.micro_batch, body.step, body.sender)
            job.inbox[key] = msg.tensor.to_torch()
            self._ready.notify_all()

    def _wait(self, job: _Job, key: tuple[Any, ...], rows: int | None) -> Any:
        started = time.monotonic()
        deadline = started + WAIT_S
        with self._ready:
            while key not in job.inbox:
                if key[0] in job.bad:
                    raise TensorFlowError(job.bad[key[0]])
                if key[0] in job.aborted:
                    raise RoundAborted(f"round {key[0]} aborted: {job.aborted[key[0]]}")
                if job.retired:
                    raise RoundAborted(f"round {key[0]} given up: a new assignment replaces the stage")
                left = deadline - time.monotonic()
                if left <= 0 or self._job is not job:
                    raise RoundTimeout(f"no {key[1]} tensor (round {key[0]}, micro-batch {key[2]}, step {key[3]}, "
                                       f"from rank {key[4]}) within {WAIT_S:.0f} s")
                self._ready.wait(min(left, 1.0))
            value = job.inbox.pop(key)
        job.blocked_s += time.monotonic() - started
        if rows is not None and value.shape[0] != rows:
            raise EdgeswarmError(f"a {key[1]} tensor of {value.shape[0]} rows where the routing expects {rows}")
        return value

    def _send(self, job: _Job, stage: int, rank: int, tensor: Any, **tags: Any) -> None:
        """Queue ``tensor`` for rank ``rank`` of stage ``stage`` on that peer's outbox (it must not change after)."""
        spec = job.spec
        message = StageTensor(job_id=spec.job_id, epoch=spec.epoch, stage=stage, sender=spec.rank, **tags)
        peer = spec.groups[stage][rank]
        outbox = job.outboxes.get(peer)
        if outbox is None:
            outbox = job.outboxes[peer] = Outbox(peer, partial(self._send_failed, job))
        outbox.put(tags["round"], partial(self.bus.send_tensor, peer, self.name, message,
                                          tensor.detach().contiguous()))

    def _send_failed(self, job: _Job, round_index: int, reason: str) -> None:
        with self._ready:
            job.bad.setdefault(round_index, reason)
            self._ready.notify_all()

    def _on_abort(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageAbort)
        with self._ready:
            job = self._job
            if job is not None and body.job_id == job.spec.job_id and body.epoch == job.spec.epoch:
                job.aborted[body.round] = body.reason
                self._ready.notify_all()

    # --- rounds -------------------------------------------------------------------------------------

    def _on_round(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, RoundStart)
        job = self._job
        if job is None or body.job_id != job.spec.job_id or body.epoch != job.spec.epoch:
            self._fail(msg, body.job_id, "not_assigned", f"{self.node} holds no stage of job {body.job_id} epoch "
                       f"{body.epoch}")
            return
        threading.Thread(target=self._round, args=(msg, job, body.round), name="round", daemon=True).start()

    def _round(self, msg: Inbound, job: _Job, round_index: int) -> None:
        try:
            with self._computing:
                done = self._run_round(job, round_index)
        except EdgeswarmError as exc:
            self.metrics.count("rounds_failed")
            log.error("round %d of job %s failed: %s", round_index, job.spec.job_id, exc)
            reason = ("timeout" if isinstance(exc, RoundTimeout) else "aborted" if isinstance(exc, RoundAborted) else
                      "memory" if isinstance(exc, MemoryBudgetError) else "error")
            self._fail(msg, job.spec.job_id, reason, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the requester must hear of it rather than wait out its timeout
            self.metrics.count("rounds_failed")
            log.exception("round %d of job %s failed", round_index, job.spec.job_id)
            self._fail(msg, job.spec.job_id, "error", f"round {round_index}: {type(exc).__name__}: {exc}")
            return
        self.metrics.count("rounds")
        self.bus.reply(msg, done)

    def _run_round(self, job: _Job, round_index: int) -> RoundDone:
        import torch

        from edgeswarm.planning.schedule import stage_order
        from edgeswarm.training.allreduce import ring_allreduce
        from edgeswarm.training.data import round_sample_ids
        from edgeswarm.training.routing import pieces, routing_matrix, stage_sample_ids

        spec, stage = job.spec, job.stage
        p, r, n_stages = spec.stage, spec.rank, len(spec.groups)
        b = sum(spec.shares[0])
        ids = (round_sample_ids(round_index, b * spec.micro_batches, job.dataset.train_size, spec.seed)
               if job.dataset is not None else None)
        into = [pc for pc in pieces(routing_matrix(spec.shares[p - 1], spec.shares[p])) if pc.receiver == r] \
            if p > 0 else []
        out_of = [pc for pc in pieces(routing_matrix(spec.shares[p], spec.shares[p + 1])) if pc.sender == r] \
            if p < n_stages - 1 else []
        compute = loop = cpu = 0.0
        job.blocked_s = 0.0
        times = {"F": [0.0] * spec.micro_batches, "B": [0.0] * spec.micro_batches}  # per micro-batch
        share = spec.shares[p][r]
        for kind, mb in stage_order(spec.warmup, spec.micro_batches):
            if share == 0:
                continue  # no samples: the weights still join the AllReduce with a zero gradient
            started = time.perf_counter()
            if kind == "F":
                held = stage_sample_ids(spec.shares, ids[mb * b:(mb + 1) * b])[p][r] if ids is not None else None
                if p == 0:
                    assert job.dataset is not None and held is not None
                    x = job.dataset.inputs(held)
                else:
                    x = torch.cat([self._wait(job, (round_index, "activation", mb, 0, pc.sender), pc.rows)
                                   for pc in into])
                labels = job.dataset.labels(held) if p == n_stages - 1 and job.dataset is not None else None
                t0, c0 = time.perf_counter(), time.thread_time()
                out = self.device.run(partial(stage.forward, mb, x, labels))
                times[kind][mb] = time.perf_counter() - t0
                cpu += time.thread_time() - c0
                compute += times[kind][mb]
                self._check_memory(job)
                for pc in out_of:
                    self._send(job, p + 1, pc.receiver, out[pc.sender_start:pc.sender_start + pc.rows],
                               round=round_index, kind="activation", micro_batch=mb)
            else:
                grad = None
                if p < n_stages - 1:
                    grad = torch.cat([self._wait(job, (round_index, "gradient", mb, 0, pc.receiver), pc.rows)
                                      for pc in out_of])
                t0, c0 = time.perf_counter(), time.thread_time()
                grad_in = self.device.run(partial(stage.backward, mb, grad))
                times[kind][mb] = time.perf_counter() - t0
                cpu += time.thread_time() - c0
                compute += times[kind][mb]
                if grad_in is not None:
                    for pc in into:
                        self._send(job, p - 1, pc.sender, grad_in[pc.receiver_start:pc.receiver_start + pc.rows],
                                   round=round_index, kind="gradient", micro_batch=mb)
            loop += time.perf_counter() - started
        blocked = job.blocked_s
        t0 = time.perf_counter()
        group = len(spec.groups[p])
        if group > 1:
            def send(to: int, step: int, chunk: Any) -> None:
                self._send(job, p, to, chunk, round=round_index, kind="allreduce", step=step)

            def recv(frm: int, step: int) -> Any:
                return self._wait(job, (round_index, "allreduce", 0, step, frm), None)

            stage.set_flat_gradients(ring_allreduce(stage.flat_gradients(), r, group, send, recv))
        if job.optimizer is not None:
            self.device.run(job.optimizer.step)
            job.optimizer.zero_grad(set_to_none=True)
        allreduce = time.perf_counter() - t0
        t0 = time.perf_counter()
        if (round_index + 1) % spec.backup_interval == 0:
            self._snapshot(job, round_index + 1)
        snapshot = time.perf_counter() - t0
        done = RoundDone(job_id=spec.job_id, epoch=spec.epoch, round=round_index, stage=p, rank=r,
                         loss_sum=stage.loss_sum, correct=stage.correct, terms=stage.terms, compute_s=compute,
                         compute_cpu_s=cpu,
                         wait_s=blocked, overhead_s=max(0.0, loop - compute - blocked), forward_s=times["F"],
                         backward_s=times["B"],
                         allreduce_s=allreduce, peak_live=stage.peak_live,
                         peak_activation_bytes=stage.peak_held_bytes, static_bytes=job.static_bytes,
                         snapshot_s=snapshot)
        stage.end_round()
        return done

    def _check_memory(self, job: _Job) -> None:
        need = job.static_bytes + job.stage.held_bytes
        budget = self.device.memory_budget_bytes
        if need > budget:
            raise MemoryBudgetError(
                f"stage {job.spec.stage} on {self.node} ({self.device.device_class}) needs {need / MIB:.1f} MiB with "
                f"{job.stage.live} micro-batches live ({job.static_bytes / MIB:.1f} MiB of weights, gradients, "
                f"optimizer state and buffers + {job.stage.held_bytes / MIB:.1f} MiB of activations) but its memory "
                f"budget is {budget / MIB:.1f} MiB")

    # --- saving -------------------------------------------------------------------------------------

    def _on_save(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageSave)
        job = self._job
        if job is None or body.job_id != job.spec.job_id or body.epoch != job.spec.epoch:
            self._fail(msg, body.job_id, "not_assigned", f"{self.node} holds no stage of job {body.job_id}")
            return
        from edgeswarm.checkpoints.client import save_checkpoint
        from edgeswarm.training.layout import stage_entry
        from edgeswarm.training.unit_state import checkpoint_tensors

        name = stage_entry(job.spec.stage)
        # Weights, buffers (BatchNorm statistics: the first device of the group's, as data parallelism keeps) and
        # optimizer state, the same on every replica of the group.
        tensors = checkpoint_tensors(job.stage.module, job.optimizer)
        try:
            info = save_checkpoint(self.bus, body.store_node, body.job_id, name, body.version, tensors)
        except EdgeswarmError as exc:
            # "timeout": the store is away (restarting, say) and a later try may work; "error": it refused.
            self._fail(msg, body.job_id, "timeout" if isinstance(exc, CheckpointTransferError) else "error",
                       f"saving stage {job.spec.stage}: {exc}")
            return
        self.bus.reply(msg, StageSaved(job_id=body.job_id, stage=job.spec.stage, version=body.version,
                                       checkpoint_stage=name, nbytes=info.nbytes))

    def _fail(self, msg: Inbound, job_id: str, reason: str, detail: str) -> None:
        self.metrics.count(f"stage_failed.{reason}")
        log.warning("job %s: %s: %s", job_id, reason, detail)
        self.bus.reply(msg, StageFailed(job_id=job_id, reason=reason, detail=detail[:4096]))  # type: ignore[arg-type]


def _sample_shapes(sequence: Any, spec: StageAssign) -> tuple[tuple[int, ...], tuple[int, ...], Any]:
    """One sample's input and output shape for units [start, end), and an example input batch, found by running
    the model's example input through the units before it (no gradients, evaluation mode so BatchNorm
    statistics stay untouched)."""
    import torch

    from edgeswarm.models.zoo import example_input

    x = example_input(spec.model, 2)
    if spec.start > 0:
        before = sequence.build_stage(0, spec.start)
        with torch.no_grad():
            before.eval()
            x = before(x)
            before.train()
    stage = sequence.build_stage(spec.start, spec.end)
    with torch.no_grad():
        stage.eval()
        out = stage(x)
        stage.train()
    return tuple(x.shape[1:]), tuple(out.shape[1:]), x


def _forged(job: _Job, body: StageTensor, msg: Inbound) -> str | None:
    """Why a tensor does not come from the device of the plan whose stage and rank it claims, or None."""
    spec = job.spec
    source = {"activation": spec.stage - 1, "gradient": spec.stage + 1, "allreduce": spec.stage}[body.kind]
    group = spec.groups[source] if 0 <= source < len(spec.groups) and body.stage == spec.stage else []
    if body.sender < len(group) and group[body.sender] == msg.envelope.sender_node:
        return None
    return (f"a {body.kind} tensor from {msg.sender} for stage {body.stage}, claiming rank {body.sender} of stage "
            f"{source}: that is not {msg.envelope.sender_node} in this plan")


def _tensor_problem(job: _Job, body: StageTensor, msg: Inbound) -> str | None:
    """Why a peer's tensor cannot be used by this stage (wrong dtype, or rows of the wrong sample shape), or None."""
    what = f"a {body.kind} tensor (round {body.round}, micro-batch {body.micro_batch}) from {msg.sender}"
    if msg.tensor is None or msg.tensor.dtype != "float32":
        return f"{what}: expected float32, got {None if msg.tensor is None else msg.tensor.dtype}"
    expected = {"activation": job.in_shape, "gradient": job.out_shape}.get(body.kind)
    shape = msg.tensor.shape
    if expected is not None and (len(shape) != len(expected) + 1 or shape[1:] != expected):
        return f"{what}: shape {list(shape)}, but this stage expects [rows, {', '.join(map(str, expected))}]"
    return None
