"""The training program's recovery state: snapshots, backups for peers, and restoring a stage from them.

At the start of every ``backup_interval``-th round a stage keeps a snapshot of its units and, when it is its group's
only device, sends them to its backup device (``StageState`` with purpose "backup", on one ``Outbox`` per peer,
in order). A restoring assignment loads each unit from this worker's own snapshot or backup, or from a peer that
ships it on request (``StageSendState``); ``StageInventory`` answers what this worker holds. The state itself is
``training.held.HeldState``, one per job, in the shared ``StageJobs`` table under its condition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from edgeswarm.bus import Inbound
from edgeswarm.errors import EdgeswarmError
from edgeswarm.hpp.held import StateMissing, UnitStates
from edgeswarm.hpp.stage_jobs import StageJobs, _Stage
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.training import (
    HeldBackup,
    HeldSnapshot,
    StageHeld,
    StageInventory,
    StageSendState,
    StageState,
    StageStateSent,
)
from edgeswarm.runtime.exchange import ExchangeTimeout
from edgeswarm.runtime.outbox import Outbox
from edgeswarm.runtime.senders import count_stranger

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

Fail = Callable[[Inbound, str, str, str], None]  # (request, job id, reason, detail): answers StageFailed


class RestoreError(EdgeswarmError):
    """A restoring stage could not get the state of its units."""


class StageRecovery:
    """Snapshots, backups and restores of every job's stage (see the module's docstring). ``wait_s`` is the longest
    wait, in seconds, for one unit state from a peer."""

    def __init__(self, jobs: StageJobs, wait_s: float, fail: Fail) -> None:
        self._jobs, self._ctx, self._wait_s, self._fail = jobs, jobs.ctx, wait_s, fail
        self._state_out: dict[str, Outbox] = {}  # peer -> sender of backups (of every job, in order)

    def close(self) -> None:
        for outbox in self._state_out.values():
            outbox.close(timeout_s=1.0)

    def restore(self, st: _Stage) -> int:
        """Load every unit's state at the start of the resume round from the sources the assignment names: this
        worker's own snapshot or backup, or a peer's StageState messages. Returns the bytes received from peers."""
        from edgeswarm.state.units import load_units, state_nbytes

        spec, node, jobs = st.spec, self._ctx.node, self._jobs
        states: UnitStates = {}
        deadline = time.monotonic() + self._wait_s
        received = 0
        with jobs.ready:
            held = jobs.held.get(spec.job_id)
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
                while (held := jobs.held.get(spec.job_id)) is None or key not in held.incoming:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ExchangeTimeout(f"the state of unit {source.unit} (round {spec.resume_round}) did not "
                                              f"arrive from {source.node} within {self._wait_s:.0f} s")
                    jobs.ready.wait(min(left, 1.0))
                states[source.unit] = held.incoming.pop(key)
                received += state_nbytes(states[source.unit])
        load_units(st.stage.module, st.optimizer, states, st.names)
        return received

    def restore_checkpoint(self, st: _Stage) -> int:
        """Load every unit's state from the checkpoint version the assignment names, reading only the checkpoint
        stages that hold this stage's units. Returns the bytes received from the store."""
        from edgeswarm.state.layout import load_stage
        from edgeswarm.state.units import checkpoint_units, load_units

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

    def snapshot(self, st: _Stage, round_index: int) -> None:
        """Keep this stage's state at the start of ``round_index`` and, for a single-device stage, send it to its
        backup device (in the background: the round goes on)."""
        from edgeswarm.state.units import extract_units

        spec, jobs = st.spec, self._jobs
        units = extract_units(st.stage.module, st.optimizer, st.names, spec.start, spec.end)
        with jobs.ready:
            held = jobs.held.get(spec.job_id)
            if jobs.stages.get(spec.job_id) is not st or held is None:
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
        from edgeswarm.state.units import pack_units

        entries, flat = pack_units(state)
        message = StageState(job_id=job_id, epoch=epoch, round=round_index, unit=unit, owner=self._ctx.node,
                             purpose=purpose, entries=entries)  # type: ignore[arg-type]
        return self._ctx.bus.send_tensor(to, self._ctx.service, message, flat)

    def _backup_failed(self, round_index: object, reason: str) -> None:
        self._ctx.metrics.count("backups_failed")
        log.error("the backup of round %s was not delivered: %s", round_index, reason)

    def on_state(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageState)
        from edgeswarm.state.units import unpack_units

        metrics, jobs = self._ctx.metrics, self._jobs
        if msg.tensor is None:
            log.error("dropped a unit state from %s without its tensor", msg.sender)
            return
        try:
            state = unpack_units(body.entries, msg.tensor.to_torch())
        except EdgeswarmError as exc:
            metrics.count("states_dropped")
            log.error("dropped the state of unit %d from %s: %s", body.unit, msg.sender, exc)
            return
        with jobs.ready:
            held = jobs.held.get(body.job_id)
            if held is None:
                metrics.count("states_dropped")
                log.error("dropped a %s of unit %d of job %s from %s: this worker holds no stage of that job",
                          body.purpose, body.unit, body.job_id, msg.sender)
                return
            if body.purpose == "backup":
                if body.owner != msg.envelope.sender_node:
                    metrics.count("states_dropped")
                    count_stranger(metrics)
                    _limited.log(logging.ERROR, "backup", "dropped a backup from %s that claims to be %s's",
                                 msg.sender, body.owner)
                    return
                if not held.add_backup(body.owner, body.epoch, body.round, body.unit, state):
                    log.info("dropped a stale backup of %s (epoch %d, round %d)", body.owner, body.epoch, body.round)
            elif body.purpose == "gather":
                held.add_snapshot(body.round, {body.unit: state})
            else:
                held.incoming[(body.epoch, body.round, body.unit)] = state
            jobs.ready.notify_all()

    def on_send_state(self, msg: Inbound) -> None:
        assert isinstance(msg.body, StageSendState)
        threading.Thread(target=self._ship, args=(msg, msg.body), name="ship", daemon=True).start()

    def _ship(self, msg: Inbound, body: StageSendState) -> None:
        """Send the asked units to the restoring device, back to back on this link (other links run at the same
        time on their own threads), then answer."""
        started = time.monotonic()
        with self._jobs.ready:
            held = self._jobs.held.get(body.job_id)
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

    def on_inventory(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, StageInventory)
        with self._jobs.ready:
            held = self._jobs.held.get(body.job_id)
            snapshots = [HeldSnapshot(round=r, units=sorted(u))
                         for r, u in sorted(held.snapshots.items())] if held else []
            backups = [HeldBackup(owner=o, round=r, units=sorted(units)) for o, rounds in held.backups.items()
                       for r, (_epoch, units) in rounds.items()] if held else []
        self._ctx.bus.reply(msg, StageHeld(job_id=body.job_id, node=self._ctx.node, snapshots=snapshots,
                                           backups=backups))
