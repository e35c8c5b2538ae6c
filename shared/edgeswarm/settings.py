"""Settings of a service instance, read from ``EDGESWARM_*`` environment variables.

compose.yaml sets these variables and tests/test_deploy.py checks that every one it sets is a field here.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from edgeswarm.errors import ConfigError
from edgeswarm.wire.schema import NAME_PATTERN

MIB = 1024 * 1024


class LinkSpec(BaseModel):
    """An emulated link to one peer: bandwidth in bytes per second, one-way latency in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_bps: float = Field(gt=0)
    latency_s: float = Field(ge=0)


class BrokerAddress(BaseModel):
    """A broker's host and port, parsed from ``mqtt://host:port``."""

    model_config = ConfigDict(frozen=True)

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse ``mqtt://host[:port]`` (or ``tcp://``); the port defaults to 1883. Raises ConfigError."""
    parts = urlsplit(url if "://" in url else f"mqtt://{url}")
    if parts.scheme not in ("mqtt", "tcp") or not parts.hostname:
        raise ConfigError(f"broker URL {url!r} is not of the form mqtt://host:port")
    try:
        port = parts.port or 1883
    except ValueError:
        raise ConfigError(f"broker URL {url!r} has an invalid port") from None
    return BrokerAddress(host=parts.hostname, port=port)


def default_profile_dir() -> Path:
    """Where profiles are cached: ``$XDG_CACHE_HOME/edgeswarm/profiles``, else ``~/.cache/edgeswarm/profiles``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgeswarm" / "profiles"


def default_checkpoint_dir() -> Path:
    """Where checkpoints are kept: ``$XDG_DATA_HOME/edgeswarm/checkpoints``, else
    ``~/.local/share/edgeswarm/checkpoints``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "edgeswarm" / "checkpoints"


def default_node_id() -> str:
    """This host's name, reduced to the characters a node id may contain."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64] or "node"


class Settings(BaseSettings):
    """Everything a service instance is configured by. Sizes are bytes, times are seconds."""

    model_config = SettingsConfigDict(env_prefix="EDGESWARM_", extra="ignore", frozen=True)

    node_id: str = Field(default_factory=default_node_id, pattern=NAME_PATTERN)
    hub_url: str = "mqtt://127.0.0.1:1883"
    # The broker that tensors for this node arrive on; the hub when unset (one broker for everything).
    data_url: str | None = None
    device_class: str = "native"
    links: dict[str, LinkSpec] = Field(default_factory=dict)
    memory_budget_bytes: int | None = Field(default=None, ge=0)
    compute_slowdown: float | None = Field(default=None, ge=1.0)

    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    heartbeat_timeout_factor: float = Field(default=3.0, gt=1)
    keepalive_s: int = Field(default=10, ge=1)
    metrics_interval_s: float = Field(default=10.0, gt=0)

    mqtt_protocol: Literal["auto", "5", "3.1.1"] = "auto"
    max_packet_bytes: int = Field(default=16 * MIB, ge=4096)
    chunk_bytes: int = Field(default=1 * MIB, ge=1024)
    max_tensor_bytes: int = Field(default=2048 * MIB, ge=1)
    max_reassembly_bytes: int = Field(default=4096 * MIB, ge=1)
    reassembly_timeout_s: float = Field(default=30.0, gt=0)
    inbox_capacity: int = Field(default=1024, ge=16)
    workers: int = Field(default=4, ge=1)
    outbound_window_messages: int = Field(default=32, ge=1)
    publish_timeout_s: float = Field(default=30.0, gt=0)
    request_timeout_s: float = Field(default=10.0, gt=0)

    # Profiles measured on this node, reused across runs (edgeswarm.profiling.cache).
    profile_dir: Path = Field(default_factory=default_profile_dir)

    # The checkpoint-store service (edgeswarm.checkpoints): where it keeps checkpoints, how many versions
    # per job and stage, and the largest checkpoint (sum of its tensors' bytes) it accepts.
    checkpoint_dir: Path = Field(default_factory=default_checkpoint_dir)
    checkpoint_keep: int = Field(default=3, ge=1)
    checkpoint_max_bytes: int = Field(default=2048 * MIB, ge=1)

    # The coordinator's training jobs: the longest any one step (profiling, a round, a save) may take.
    job_step_timeout_s: float = Field(default=600.0, gt=0)

    # The planner service: the longest one plan or re-plan may take. A request estimated above it is refused
    # "too_large" before it starts, and a search still running at it is stopped. The default leaves a job's
    # plan request (120 s timeout) room to wait behind another; a slow planner host should lower it.
    plan_time_budget_s: float = Field(default=30.0, gt=0)

    log_level: str = "INFO"
    log_json: bool = False

    @field_validator("data_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value  # `EDGESWARM_DATA_URL=` in an .env file means "not set"

    @field_validator("hub_url", "data_url")
    @classmethod
    def _valid_url(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_broker_url(value)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None  # pydantic reports ValueErrors with the field name
        return value

    @property
    def data_plane_url(self) -> str:
        """The broker this node's tensors arrive on."""
        return self.data_url or self.hub_url

    @property
    def heartbeat_timeout_s(self) -> float:
        """Silence after which a service is suspect, in seconds."""
        return self.heartbeat_interval_s * self.heartbeat_timeout_factor
