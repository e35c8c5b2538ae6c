"""The training state a stage-worker keeps for recovery: its own snapshots and the backups of other devices.

Snapshots are this device's units at the start of a round (after the previous round's optimizer step); backups
are a single-device stage's units sent here by that device (spec 5.3). Both are kept for the last ``KEEP``
rounds they were taken at, so a failure while the newest backup is still on the wire can fall back one backup
interval. A backup from an older plan epoch never replaces a newer one of the same round.

Snapshots hold tensors where the stage computes (clones on its compute device, so restoring one is a device-side
copy); backups and states from peers arrive in host memory. ``unit_state.load_units`` copies either kind into the
stage's own tensors, so a restored stage stays on its device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KEEP = 2  # rounds of snapshots and of backups per owner

UnitStates = dict[int, dict[str, Any]]  # unit -> entry name -> tensor


class StateMissing(LookupError):
    """The worker holds no state of a unit at the round asked for."""


@dataclass
class HeldState:
    """One job's recovery state on one worker. Not thread-safe: the worker holds its lock."""

    job_id: str
    epoch: int = 0  # the plan epoch this worker now runs: backups sent under an older one are stale
    snapshots: dict[int, UnitStates] = field(default_factory=dict)  # round -> units
    # owner -> round -> (epoch, units)
    backups: dict[str, dict[int, tuple[int, UnitStates]]] = field(default_factory=dict)
    # (epoch, round, unit) -> state sent for a restore that has not taken it yet
    incoming: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)

    def add_snapshot(self, round_index: int, units: UnitStates) -> None:
        """Keep ``units`` as this device's state at the start of ``round_index`` (merged with units already held
        for that round: a device that hands units over keeps serving them until they are pruned)."""
        self.snapshots.setdefault(round_index, {}).update(units)
        for old in sorted(self.snapshots)[:-KEEP]:
            del self.snapshots[old]

    def add_backup(self, owner: str, epoch: int, round_index: int, unit: int, state: dict[str, Any]) -> bool:
        """Keep ``owner``'s unit state at the start of ``round_index`` from plan ``epoch``; False when a backup of
        a newer epoch for that round is already held, or the sender's epoch is older than this worker's (a round that
        was given up): the stale one is dropped."""
        if epoch < self.epoch:
            return False
        rounds = self.backups.setdefault(owner, {})
        held = rounds.get(round_index)
        if held is not None and held[0] > epoch:
            return False
        if held is None or held[0] < epoch:
            held = rounds[round_index] = (epoch, {})
        held[1][unit] = state
        for old in sorted(rounds)[:-KEEP]:
            del rounds[old]
        return True

    def forget_after(self, round_index: int) -> None:
        """Drop every snapshot and backup taken after the start of ``round_index``: the job resumes there, and a
        later state belongs to rounds that are run again."""
        for r in [r for r in self.snapshots if r > round_index]:
            del self.snapshots[r]
        for rounds in self.backups.values():
            for r in [r for r in rounds if r > round_index]:
                del rounds[r]

    def units(self, round_index: int, owner: str | None, units: list[int]) -> UnitStates:
        """The held state of ``units`` at the start of ``round_index``: this device's own (``owner`` None) or the
        backup of ``owner``. Raises StateMissing naming what is not held."""
        if owner is None:
            source = self.snapshots.get(round_index, {})
            what = "its own snapshot"
        else:
            source = self.backups.get(owner, {}).get(round_index, (0, {}))[1]
            what = f"the backup of {owner}"
        missing = [u for u in units if u not in source]
        if missing:
            raise StateMissing(f"no state of units {missing} at the start of round {round_index} in {what} (held: "
                               f"snapshots of rounds {sorted(self.snapshots)}, backups "
                               f"{ {o: sorted(r) for o, r in self.backups.items()} })")
        return {u: source[u] for u in units}
