"""Who may write a job's checkpoints: its coordinator, and each stage's devices their own stage.

A pure core over what the coordinator publishes: the store follows the retained job states (only the hub may
write them under the cluster's ACL) and asks ``refusal`` before it writes a version. Writing a version is also
how old versions go (the store keeps the newest few), so this is what keeps a device from overwriting or
pruning a stage it does not hold. A job no coordinator has announced is not guarded: its checkpoints are
whoever's saves them (tools and tests that use the store directly).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgeswarm.messages.jobs import JobState

COORDINATOR = "coordinator"
_STAGE = re.compile(r"^stage-(\d{1,6})$")  # edgeswarm.state.layout.stage_entry


@dataclass(frozen=True)
class JobOwners:
    """The node of a job's coordinator and the devices of each stage of its current plan (none before it has
    one)."""

    coordinator: str
    stages: tuple[tuple[str, ...], ...] = ()


def owners_of(state: JobState, writer_node: str) -> JobOwners:
    """The owners a job state written by the coordinator on ``writer_node`` declares. A plan without pipeline
    stages (tensor-parallel serving, split learning) gives no device a stage: only the coordinator writes."""
    stages = tuple(tuple(_devices(s)) for s in getattr(state.plan, "stages", None) or ())
    return JobOwners(coordinator=writer_node, stages=stages)


def _devices(stage: object) -> list[str]:
    # A plan of a kind this service has not installed stays an opaque value: its stages are plain mappings.
    devices = stage.get("devices") if isinstance(stage, dict) else getattr(stage, "devices", None)
    return [d for d in devices if isinstance(d, str)] if isinstance(devices, (list, tuple)) else []


def refusal(owners: JobOwners | None, sender: str, job_id: str, stage: str) -> str | None:
    """Why node ``sender`` may not write checkpoint stage ``stage`` of ``job_id``, or None when it may."""
    if owners is None or sender == owners.coordinator:
        return None
    match = _STAGE.match(stage)
    index = int(match.group(1)) if match else -1
    if 0 <= index < len(owners.stages) and sender in owners.stages[index]:
        return None
    holders = ", ".join(owners.stages[index]) if 0 <= index < len(owners.stages) else "nobody (not a stage)"
    return (f"{sender} may not write {job_id}/{stage}: only the job's coordinator ({owners.coordinator}) and the "
            f"devices of that stage in its current plan ({holders}) may")
