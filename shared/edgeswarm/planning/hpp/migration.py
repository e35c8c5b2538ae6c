"""Topology-driven replication and concurrent unit migration (spec 5.3 and 5.5): pure functions over plans.

``backup_map`` says which device keeps the backup of every single-device stage (a ring over the stages).
After a failure, a join or a plain re-cut, ``plan_migration`` lists the unit transfers that turn the old
plan's placement into the new one: only units whose owner changed are sent, each from the holder with the
least bytes queued so far, so that every (src, dst) link sends its units back to back while different links
run concurrently. ``local_restores`` lists the units a device already holds as a backup and only has to load
locally.

Sizes are in bytes; units are indices into the model's unit sequence (``Plan.units``). No torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Set

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.errors import PlanningError
from edgeswarm.planning.hpp.types import Plan

__all__ = [
    "MigrationError",
    "UnitTransfer",
    "UnrecoverableError",
    "backup_map",
    "local_restores",
    "plan_migration",
    "unit_holders",
]


class MigrationError(PlanningError):
    """Two plans cannot be migrated into one another: different unit counts, a failed device in the new
    plan, a device listed twice, or unit sizes that do not match the plan."""


class UnrecoverableError(MigrationError):
    """Some units have no surviving copy: every device of their stage failed and so did the backup holder
    (or there was no backup). ``units`` and ``devices`` name what was lost; restore those units from an
    external checkpoint or re-initialise them."""

    def __init__(self, message: str, *, units: list[int], devices: list[str]) -> None:
        super().__init__(message)
        self.units = units
        self.devices = devices


class UnitTransfer(BaseModel):
    """One unit's state (weights + optimizer state + buffers, ``nbytes`` bytes) sent from ``src`` to ``dst``.

    ``from_backup_of`` is None when ``src`` sends its own live state, else the failed device whose backup
    ``src`` holds and sends. ``src == dst`` only for a local restore (``local_restores``): the device loads
    the backup it holds, nothing crosses a link.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    unit: int = Field(ge=0)
    src: str = Field(min_length=1)
    dst: str = Field(min_length=1)
    nbytes: int = Field(ge=0)
    from_backup_of: str | None = None

    @model_validator(mode="after")
    def _self_only_from_backup(self) -> UnitTransfer:
        if self.src == self.dst and self.from_backup_of is None:
            raise ValueError(f"unit {self.unit}: {self.src} cannot send its own live state to itself")
        return self


# --- replication (spec 5.3) -----------------------------------------------------------------------------


def backup_map(plan: Plan, free_memory_bytes: dict[str, int] | None = None) -> dict[str, str]:
    """BACKUP_MAP: for every single-device stage p, the device of stage (p + 1) mod P that keeps its backup.

    The last stage backs up to the first, so the map is a ring over the stages. Multi-device stages get no
    entry (after each AllReduce their replicas are identical, so a survivor restores a failed member), and
    neither does a one-stage plan (there is nowhere else to replicate: rely on a local checkpoint). In a
    multi-device target stage the device with the most free memory is chosen; ``free_memory_bytes``
    (bytes per node; missing nodes fall back to the plan's ``memory_budget_bytes - memory_bytes``) overrides
    the plan's prediction. A target device that already holds a backup is avoided when another one is free,
    then ties go to the name, so the map is deterministic. Returns {source device: backup device}.
    """
    _stage_index(plan, "plan")  # a device listed twice would back up into itself
    n_stages = len(plan.stages)
    if n_stages == 1:
        return {}
    free: dict[str, int] = {}
    for stage in plan.stages:
        for d, used, budget in zip(stage.devices, stage.memory_bytes, stage.memory_budget_bytes, strict=True):
            free[d] = budget - used
    free.update(free_memory_bytes or {})
    chosen: dict[str, int] = {}  # backups each device holds so far
    backups: dict[str, str] = {}
    for p, stage in enumerate(plan.stages):
        if len(stage.devices) != 1:
            continue
        source = stage.devices[0]
        # With P >= 2, (p + 1) mod P != p, so the target never contains the source; the filter is a guard.
        targets = [d for d in plan.stages[(p + 1) % n_stages].devices if d != source]
        # The ring sends each stage at most one source; counting still spreads the load if the rule changes.
        target = min(targets, key=lambda d: (chosen.get(d, 0), -free.get(d, 0), d))
        backups[source] = target
        chosen[target] = chosen.get(target, 0) + 1
    return backups


# --- migration (spec 5.5) -------------------------------------------------------------------------------


def unit_holders(plan: Plan, failed: Set[str], backups: dict[str, str]) -> dict[int, list[tuple[str, str | None]]]:
    """Who has valid state of every unit of ``plan`` once the devices in ``failed`` are gone.

    For unit l: the surviving devices of l's stage, as (device, None) in stage order; if every device of the
    stage failed, the surviving backup holders ``backups[d]`` of its devices, as (holder, d). ``backups`` is
    the old plan's ``backup_map``. Raises UnrecoverableError naming the units and devices when some unit
    has no holder (a single-device stage and its backup holder both failed, or it had no backup).
    """
    _stage_index(plan, "plan")
    holders: dict[int, list[tuple[str, str | None]]] = {}
    lost_units: list[int] = []
    lost_devices: list[str] = []
    reasons: list[str] = []
    for stage in plan.stages:
        survivors: list[tuple[str, str | None]] = [(d, None) for d in stage.devices if d not in failed]
        if not survivors:
            seen: set[str] = set()
            for d in stage.devices:
                holder = backups.get(d)
                if holder is not None and holder not in failed and holder != d and holder not in seen:
                    survivors.append((holder, d))
                    seen.add(holder)
        if not survivors:
            lost_units.extend(range(stage.start, stage.end))
            lost_devices.extend(stage.devices)
            why = [f"{d}'s backup holder {backups[d]} failed too" if d in backups else f"{d} had no backup"
                   for d in stage.devices]
            reasons.append(f"units {_span(stage.start, stage.end)} of stage {stage.index} "
                           f"({', '.join(stage.devices)}): {'; '.join(why)}")
        for unit in range(stage.start, stage.end):
            holders[unit] = list(survivors)
    if lost_units:
        raise UnrecoverableError(
            "no surviving copy of " + " and ".join(reasons)
            + ". Restore these units from an external checkpoint, or re-plan and re-initialise them.",
            units=lost_units, devices=lost_devices)
    return holders


def plan_migration(old: Plan, new: Plan, failed: Set[str], backups: dict[str, str],
                   unit_bytes: list[int]) -> list[UnitTransfer]:
    """MIGRATE: the transfers that give every device of ``new`` the state of the units it owns.

    For every unit l and every device dst of l's stage in ``new`` that does not already hold valid state
    of l, one transfer from a holder (``unit_holders(old, failed, backups)``). A dst holds l when it is a
    surviving member of l's old stage; a dst that holds l's backup is not sent l either (it loads it
    locally, see ``local_restores``). So only units whose owner changed move, and failed devices are never
    src nor dst. ``unit_bytes[l]`` is the bytes of unit l's state (weights + optimizer state + buffers).

    The source balances the links: the holder with the fewest bytes queued to send so far, then the holder
    whose stage in ``new`` is the same as or next to dst's, then by name. Works for failures, joins (a new
    device receives all its units; ``failed`` empty) and plain re-cuts. Output is sorted by unit, then dst.
    Raises MigrationError if the plans have different unit counts, ``new`` contains a failed device, a
    device is listed twice, or ``unit_bytes`` does not have one non-negative entry per unit; and
    UnrecoverableError if a unit that has to move has no surviving holder.
    """
    holders, new_stage = _prepare(old, new, failed, backups, unit_bytes)
    queued: dict[str, int] = {}  # bytes each holder sends, the quantity balanced across links
    transfers: list[UnitTransfer] = []
    for stage in new.stages:
        for unit in range(stage.start, stage.end):
            have = {h for h, _ in holders[unit]}
            for dst in sorted(stage.devices):
                if dst in have:
                    continue  # own live state (surviving member of the old stage) or a local backup

                def rank(h: tuple[str, str | None], dst: str = dst) -> tuple[int, int, str]:
                    hs = new_stage.get(h[0])
                    # A holder in dst's stage or the next one is a short hop on the new pipeline's links;
                    # a holder outside the new plan (a device leaving gracefully) comes last.
                    near = 2 if hs is None else (0 if abs(hs - new_stage[dst]) <= 1 else 1)
                    return queued.get(h[0], 0), near, h[0]

                src, of = min(holders[unit], key=rank)
                transfers.append(UnitTransfer(unit=unit, src=src, dst=dst, nbytes=unit_bytes[unit],
                                              from_backup_of=of))
                queued[src] = queued.get(src, 0) + unit_bytes[unit]
    return transfers


def local_restores(old: Plan, new: Plan, failed: Set[str], backups: dict[str, str],
                   unit_bytes: list[int]) -> list[UnitTransfer]:
    """The units a device of ``new`` owns and already holds only as a backup of a failed device: it loads
    them from its backup store, no link is used. Returned as UnitTransfers with ``src == dst`` and
    ``from_backup_of`` set, sorted by unit. Same arguments and errors as ``plan_migration``; together the
    two lists cover every unit a device of ``new`` owns but held no live state of."""
    holders, _ = _prepare(old, new, failed, backups, unit_bytes)
    restores: list[UnitTransfer] = []
    for stage in new.stages:
        for unit in range(stage.start, stage.end):
            for holder, of in holders[unit]:
                if of is not None and holder in stage.devices:
                    restores.append(UnitTransfer(unit=unit, src=holder, dst=holder, nbytes=unit_bytes[unit],
                                                 from_backup_of=of))
    return sorted(restores, key=lambda t: (t.unit, t.dst))


# --- helpers ----------------------------------------------------------------------------------------------


def _prepare(old: Plan, new: Plan, failed: Set[str], backups: dict[str, str],
             unit_bytes: list[int]) -> tuple[dict[int, list[tuple[str, str | None]]], dict[str, int]]:
    """Validate a migration's inputs; the holders of every old unit and the new plan's device -> stage map."""
    if old.units != new.units:
        raise MigrationError(f"the old plan has {old.units} units and the new one {new.units}: "
                             "a migration moves units of the same model (re-plan from the same profile)")
    if len(unit_bytes) != old.units or any(b < 0 for b in unit_bytes):
        raise MigrationError(f"unit_bytes needs {old.units} non-negative entries (bytes of each unit's state), "
                             f"got {len(unit_bytes)}")
    bad = sorted(set(new.devices) & set(failed))
    if bad:
        raise MigrationError(f"the new plan still contains failed device(s) {', '.join(bad)}: "
                             "re-plan without them first")
    new_stage = _stage_index(new, "new plan")
    # The new plan owns every unit, so a unit without a holder is always a loss: unit_holders raises.
    return unit_holders(old, failed, backups), new_stage


def _stage_index(plan: Plan, what: str) -> dict[str, int]:
    """Device -> stage index; raises MigrationError if a device appears twice (in one stage or two)."""
    index: dict[str, int] = {}
    for p, stage in enumerate(plan.stages):
        for d in stage.devices:
            if d in index:
                raise MigrationError(f"the {what} lists device {d} twice (stages {index[d]} and {p}); "
                                     "a device runs one replica of one stage")
            index[d] = p
    return index


def _span(start: int, end: int) -> str:
    """Units [start, end) as '3' or '3-5' (inclusive, as people read them)."""
    return str(start) if end - start == 1 else f"{start}-{end - 1}"
