"""Heartbeat stamps on disk, for container healthchecks.

A service rewrites its stamp after every heartbeat it has handed to the broker connection and removes it when it
stops; ``edgeswarm health SERVICE`` (compose's healthcheck) calls the service healthy only while the stamp is
fresh. A process that is alive but no longer heartbeating (hung main loop, lost hub) goes stale like a dead one.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgeswarm.errors import ConfigError

log = logging.getLogger(__name__)


class HealthStamp(BaseModel):
    """What a service writes on each heartbeat. Times are seconds: ``at`` is wall-clock (epoch), ``stale_after_s``
    the silence after which the cluster would take the service for suspect."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    service: str
    instance: str
    pid: int
    at: float
    heartbeat_interval_s: float = Field(gt=0)
    stale_after_s: float = Field(gt=0)


class HealthVerdict(BaseModel):
    """The answer of ``check_health``: healthy or not, and why, in one line."""

    model_config = ConfigDict(frozen=True)

    healthy: bool
    detail: str


def stamp_path(health_dir: Path, node: str, service: str) -> Path:
    """The stamp file of ``service`` on ``node`` in ``health_dir``."""
    return health_dir / f"{node}.{service}.json"


def write_stamp(path: Path, stamp: HealthStamp) -> None:
    """Replace ``path`` with ``stamp`` atomically (a reader never sees half a file). Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(stamp.model_dump_json())
    os.replace(tmp, path)


def remove_stamp(path: Path, instance: str) -> None:
    """Remove ``path`` if it is still ``instance``'s (a newer instance's stamp stays)."""
    try:
        current = HealthStamp.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError):
        return
    if current.instance == instance:
        try:
            path.unlink()
        except OSError as exc:
            log.warning("could not remove the health stamp %s: %s", path, exc)


def check_health(path: Path, *, max_age_s: float | None = None, now: float | None = None) -> HealthVerdict:
    """Whether the stamp at ``path`` is fresh: written at most ``max_age_s`` seconds before ``now`` (default: the
    stamp's own ``stale_after_s``, three heartbeat intervals). Raises ConfigError when ``max_age_s`` is not
    positive."""
    if max_age_s is not None and max_age_s <= 0:
        raise ConfigError(f"--max-age must be a positive number of seconds, not {max_age_s:g}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        return HealthVerdict(healthy=False, detail=f"no heartbeat stamp at {path}: the service is not running (or "
                             "is still starting), or EDGESWARM_NODE_ID / EDGESWARM_HEALTH_DIR differ from its own")
    except OSError as exc:
        return HealthVerdict(healthy=False, detail=f"cannot read the heartbeat stamp {path}: {exc.strerror or exc}")
    try:
        stamp = HealthStamp.model_validate_json(text)
    except ValidationError:
        return HealthVerdict(healthy=False, detail=f"the heartbeat stamp {path} is not a stamp edgeswarm wrote")
    limit = stamp.stale_after_s if max_age_s is None else max_age_s
    age = (time.time() if now is None else now) - stamp.at
    who = f"{stamp.service} on {stamp.node} (instance {stamp.instance}, pid {stamp.pid})"
    if age > limit:
        return HealthVerdict(healthy=False, detail=f"{who}: last heartbeat {age:.1f} s ago, more than {limit:g} s")
    return HealthVerdict(healthy=True, detail=f"{who}: last heartbeat {max(0.0, age):.1f} s ago")
