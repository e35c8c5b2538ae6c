"""Settings of a service instance, read from ``EDGESWARM_*`` environment variables.

compose.yaml sets these variables and tests/test_deploy.py checks that every one it sets is a field here.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Literal
from urllib.parse import SplitResult, unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from edgeswarm.errors import ConfigError
from edgeswarm.wire.schema import NAME_PATTERN

MIB = 1024 * 1024

# Defaults that the code using them (edgeswarm.membership, edgeswarm.checkpoints.uploads) shares with the fields
# below, where the comments explain them. Settings sit below everything, so they live here.
DEFAULT_RETENTION_S = 300.0
DEFAULT_MAX_NODES = 128
DEFAULT_MAX_INSTANCES_PER_NODE = 16
DEFAULT_MAX_OPEN_UPLOADS = 64
DEFAULT_MAX_OPEN_UPLOADS_PER_SENDER = 16


class LinkSpec(BaseModel):
    """An emulated link to one peer: bandwidth in bytes per second, one-way latency in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_bps: float = Field(gt=0)
    latency_s: float = Field(ge=0)


class BrokerAddress(BaseModel):
    """A broker's host and port, parsed from ``mqtt://host:port`` (or ``mqtts://`` for TLS). It never holds
    credentials: ``url`` is safe to log and to advertise."""

    model_config = ConfigDict(frozen=True)

    host: str
    port: int
    tls: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'mqtts' if self.tls else 'mqtt'}://{host}:{self.port}"


_SCHEMES = {"mqtt": False, "tcp": False, "mqtts": True, "ssl": True, "tls": True}


def _split(url: str) -> SplitResult:
    """``url`` split into parts; a URL without a scheme is taken as ``mqtt://``."""
    return urlsplit(url if "://" in url else f"mqtt://{url}")


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse ``mqtt://host[:port]`` (also ``tcp://``; port 1883) or ``mqtts://host[:port]`` (TLS; also ``ssl://``;
    port 8883). A ``user:password@`` part is not kept here (see ``url_credentials``). Raises ConfigError."""
    parts = _split(url)
    if parts.scheme not in _SCHEMES or not parts.hostname:
        raise ConfigError(f"broker URL {redact_url(url)!r} is not of the form mqtt://host:port or mqtts://host:port")
    tls = _SCHEMES[parts.scheme]
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError:
        raise ConfigError(f"broker URL {redact_url(url)!r} has an invalid port") from None
    return BrokerAddress(host=parts.hostname, port=port, tls=tls)


def url_credentials(url: str) -> tuple[str | None, str | None]:
    """The (user name, password) in a broker URL's ``user:password@`` part, percent-decoded; None where absent."""
    parts = _split(url)
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    return user, password


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages and logs."""
    parts = _split(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (localhost, 127.0.0.0/8, ::1). Names are not resolved: any other
    name may reach beyond this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BrokerCredentials(BaseModel):
    """How this node proves who it is to every broker of the cluster, and how it checks the brokers (TLS).

    ``password`` is a SecretStr: it never appears in a repr or a log line.
    """

    model_config = ConfigDict(frozen=True)

    username: str | None = None
    password: SecretStr | None = None
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @property
    def anonymous(self) -> bool:
        """True when this node presents neither a user name nor a client certificate."""
        return self.username is None and self.cert_file is None


def default_profile_dir() -> Path:
    """Where profiles are cached: ``$XDG_CACHE_HOME/edgeswarm/profiles``, else ``~/.cache/edgeswarm/profiles``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgeswarm" / "profiles"


def default_checkpoint_dir() -> Path:
    """Where checkpoints are kept: ``$XDG_DATA_HOME/edgeswarm/checkpoints``, else
    ``~/.local/share/edgeswarm/checkpoints``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "edgeswarm" / "checkpoints"


def default_health_dir() -> Path:
    """Where services stamp their heartbeats for ``edgeswarm health``: a folder of this user's under the system's
    temporary folder (one per user, so two users' services on one host never share stamps)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"edgeswarm-health-{uid}"


def default_node_id() -> str:
    """This host's name, reduced to the characters a node id may contain."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64] or "node"


class Settings(BaseSettings):
    """Everything a service instance is configured by. Sizes are bytes, times are seconds."""

    model_config = SettingsConfigDict(env_prefix="EDGESWARM_", extra="ignore", frozen=True)

    node_id: str = Field(default_factory=default_node_id, pattern=NAME_PATTERN)
    hub_url: str = "mqtt://127.0.0.1:1883"
    # The broker that tensors for this node arrive on, as the other nodes reach it: advertised in every status. The
    # hub when unset (one broker for everything). Checked at start (edgeswarm.runtime.reachability).
    data_url: str | None = None
    # Where this node's own services connect to that broker, when it differs from the advertised address: inside a
    # compose stack the node's broker is `broker`, a name only this node's containers resolve. Unset: data_url.
    data_connect_url: str | None = None
    device_class: str = "native"
    links: dict[str, LinkSpec] = Field(default_factory=dict)
    memory_budget_bytes: int | None = Field(default=None, ge=0)
    compute_slowdown: float | None = Field(default=None, ge=1.0)
    # Where workers and the profiler compute (edgeswarm.devices.compute): auto takes CUDA when torch can use it,
    # else MPS, else the CPU. Emulated device classes compute on the CPU whatever this says.
    compute: Literal["auto", "cpu", "cuda", "mps"] = "auto"

    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    heartbeat_timeout_factor: float = Field(default=3.0, gt=1)
    keepalive_s: int = Field(default=10, ge=1)
    # How long a worker waits for one tensor or unit state from a peer before it gives its round up as stalled
    # (seconds; the coordinator then replays the round). Long enough for the slowest stage of a big model.
    peer_wait_s: float = Field(default=120.0, gt=0, le=3600)
    metrics_interval_s: float = Field(default=10.0, gt=0)
    # The coordinator's closed loop (planning.refit): a training job re-plans at a snapshot round, and a serving
    # pipeline between two items, when its devices' measured compute says another plan is predicted more than 15%
    # faster; a training job saves what it measured of each device and link (profiling.refits) for the next job.
    rebalance: bool = True

    mqtt_protocol: Literal["auto", "5", "3.1.1"] = "auto"
    # Authentication (one identity per node, the same on every broker of the cluster). The user name is the node
    # id (the brokers' ACL lets a node write only its own topics); the password comes from the environment or,
    # better, a file (compose secrets). A ``user:password@`` in EDGESWARM_HUB_URL fills these too.
    mqtt_username: str | None = None
    mqtt_password: SecretStr | None = None
    mqtt_password_file: Path | None = None
    # TLS for mqtts:// brokers: the cluster's CA (EDGESWARM_TLS_CA_FILE; unset: the system's CAs) and, to log in
    # with a client certificate instead of a password, this node's certificate and key.
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # A service refuses to run on a broker beyond this machine that let it in without credentials: anyone who
    # reaches such a broker is the cluster. Set true only for a trusted, isolated development network.
    allow_anonymous: bool = False
    max_packet_bytes: int = Field(default=16 * MIB, ge=4096)
    chunk_bytes: int = Field(default=1 * MIB, ge=1024)
    max_tensor_bytes: int = Field(default=2048 * MIB, ge=1)
    max_reassembly_bytes: int = Field(default=4096 * MIB, ge=1)
    # What the incomplete transfers of one sender node may hold: one peer cannot starve the others.
    max_reassembly_bytes_per_sender: int = Field(default=2048 * MIB, ge=1)
    reassembly_timeout_s: float = Field(default=30.0, gt=0)
    inbox_capacity: int = Field(default=1024, ge=16)
    # How long a full inbox shard may hold a broker connection's network thread (TCP backpressure) before the QoS 1
    # message waiting for room is handed back for the broker to send again (seconds; at most half the keepalive,
    # which nothing is sent during).
    inbox_hold_s: float = Field(default=5.0, gt=0, le=600)
    # How long a broker keeps a connection's session (subscriptions, unacknowledged QoS 1 messages) after it ends,
    # so a reconnect within it gets again what was left unacknowledged (seconds, MQTT 5).
    session_expiry_s: int = Field(default=120, ge=0, le=86400)
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
    # Uploads open at once (each holds its tensors and its commit's metadata, up to about 1 MB, until complete):
    # a job saves one upload per stage at a time, so 64 leaves room for several jobs' saves together while a
    # flood of commits whose tensors never come holds at most some 70 MB of metadata.
    checkpoint_max_open_uploads: int = Field(default=DEFAULT_MAX_OPEN_UPLOADS, ge=1)
    # One sender node's share of those uploads (of the bytes: one EDGESWARM_CHECKPOINT_MAX_BYTES, half the total),
    # so a member that floods the store with commits whose tensors never come leaves the rest for the others'
    # saves. 16: a node saves one upload per stage it holds, and holds far fewer stages.
    checkpoint_max_open_uploads_per_sender: int = Field(default=DEFAULT_MAX_OPEN_UPLOADS_PER_SENDER, ge=1)

    # Membership (the coordinator's cluster view, and `edgeswarm status`): a service instance silent (no status
    # or heartbeat) for longer than the retention is forgotten, offline or not, so a departed node stays listed
    # as offline, with its reason, for a few minutes and then goes. At most ``membership_max_nodes`` nodes of at
    # most ``membership_max_instances_per_node`` instances each are held; newcomers beyond that are refused (and
    # logged) until retention frees room, so forged heartbeats cannot grow the view without bound.
    # Five minutes: long enough that `edgeswarm status` run after a failure still shows which node left and why;
    # short enough that a flood of forged node ids stops crowding out newcomers within minutes. 128 nodes is far
    # beyond a cluster of edge devices, 16 instances twice the services one node runs. A flood of forged
    # heartbeats then leaves a view of about 40 KB; every slot filled with the longest statuses, a few MB.
    membership_retention_s: float = Field(default=DEFAULT_RETENTION_S, gt=0)
    membership_max_nodes: int = Field(default=DEFAULT_MAX_NODES, ge=1)
    membership_max_instances_per_node: int = Field(default=DEFAULT_MAX_INSTANCES_PER_NODE, ge=1)

    # The coordinator's training jobs: the longest any one step (profiling, a round, a save) may take.
    job_step_timeout_s: float = Field(default=600.0, gt=0)

    # The planner service: the longest one plan or re-plan may take. A request estimated above it is refused
    # "too_large" before it starts, and a search still running at it is stopped. The default leaves a job's
    # plan request (120 s timeout) room to wait behind another; a slow planner host should lower it.
    plan_time_budget_s: float = Field(default=30.0, gt=0)

    # The dashboard service (edgeswarm.dashboard): where its page listens and the file holding the bearer token it
    # asks of every request. A host beyond loopback without a token is refused at start: the page shows the whole
    # cluster. ``dashboard_token_create`` makes a random token in that file when it does not exist yet (a container
    # whose operator reads it from the log or the file). ``dashboard_push_interval_s``: the fewest seconds between
    # two snapshots pushed to the open pages.
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = Field(default=8080, ge=0, le=65535)
    dashboard_token_file: Path | None = None
    dashboard_token_create: bool = False
    dashboard_push_interval_s: float = Field(default=0.5, gt=0, le=60)

    # The gateway service (edgeswarm.gateway): where its OpenAI-compatible API listens and the file holding the bearer
    # token it asks of every request; as the dashboard's, a host beyond loopback needs a token, which
    # ``gateway_token_create`` makes when the file does not exist yet.
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(default=8000, ge=0, le=65535)
    gateway_token_file: Path | None = None
    gateway_token_create: bool = False

    # Each service rewrites a small stamp here on every heartbeat; `edgeswarm health SERVICE` (compose's healthcheck)
    # reads it, so a container whose service stopped heartbeating turns unhealthy.
    health_dir: Path = Field(default_factory=default_health_dir)

    log_level: str = "INFO"
    log_json: bool = False

    @model_validator(mode="before")
    @classmethod
    def _credentials_from_url(cls, values: object) -> object:
        # user:password@ in the hub URL moves into the credential fields, so no URL held here carries a secret.
        if not isinstance(values, dict):
            return values
        values = dict(values)
        for key in ("hub_url", "data_url", "data_connect_url"):
            url = values.get(key)
            if not isinstance(url, str) or "@" not in url:
                continue
            user, password = url_credentials(url)
            if key != "hub_url" and (user, password) != url_credentials(str(values.get("hub_url", ""))):
                raise ValueError(f"EDGESWARM_{key.upper()} carries credentials: a node has one identity for every "
                                 "broker; set EDGESWARM_MQTT_USERNAME and EDGESWARM_MQTT_PASSWORD_FILE instead")
            if user is not None and values.get("mqtt_username") in (None, ""):
                values["mqtt_username"] = user
            if password is not None and values.get("mqtt_password") in (None, ""):
                values["mqtt_password"] = password
            parts = _split(url)
            values[key] = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()
        return values

    @model_validator(mode="after")
    def _consistent_credentials(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("EDGESWARM_TLS_CERT_FILE and EDGESWARM_TLS_KEY_FILE go together")
        if self.mqtt_password is not None and self.mqtt_password_file is not None:
            raise ValueError("set EDGESWARM_MQTT_PASSWORD or EDGESWARM_MQTT_PASSWORD_FILE, not both")
        return self

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, value: str) -> str:
        # Checked here, where the variable can be named: logging itself would fail later with a traceback.
        if not isinstance(logging.getLevelName(value.upper()), int):
            raise ValueError("expected a logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)")
        return value.upper()

    @field_validator("data_url", "data_connect_url", "dashboard_token_file", "gateway_token_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value  # `EDGESWARM_DATA_URL=` in an .env file means "not set"

    @field_validator("hub_url", "data_url", "data_connect_url")
    @classmethod
    def _valid_url(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_broker_url(value)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None  # pydantic reports ValueErrors with the field name
        return value

    @model_validator(mode="after")
    def _retention_outlasts_suspicion(self) -> Settings:
        # Forgetting a service before it could even turn suspect would make live services blink in and out.
        if self.membership_retention_s <= self.heartbeat_timeout_s:
            raise ValueError(
                f"EDGESWARM_MEMBERSHIP_RETENTION_S ({self.membership_retention_s:g} s) must exceed "
                "EDGESWARM_HEARTBEAT_INTERVAL_S x EDGESWARM_HEARTBEAT_TIMEOUT_FACTOR "
                f"({self.heartbeat_timeout_s:g} s), or live services would be forgotten before they turn suspect: "
                "raise the retention")
        return self

    def credentials(self) -> BrokerCredentials:
        """This node's credentials, the password read from its file now. Without an explicit user name, a node
        with a password logs in as its node id. Raises ConfigError when the password file cannot be read."""
        password = self.mqtt_password
        if self.mqtt_password_file is not None:
            try:
                text = self.mqtt_password_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read EDGESWARM_MQTT_PASSWORD_FILE {self.mqtt_password_file}: "
                                  f"{exc.strerror or exc}") from None
            if not text:
                raise ConfigError(f"EDGESWARM_MQTT_PASSWORD_FILE {self.mqtt_password_file} is empty")
            password = SecretStr(text)
        username = self.mqtt_username or (self.node_id if password is not None else None)
        return BrokerCredentials(username=username, password=password, ca_file=self.tls_ca_file,
                                 cert_file=self.tls_cert_file, key_file=self.tls_key_file)

    @property
    def data_plane_url(self) -> str:
        """The broker this node's tensors arrive on, as other nodes reach it (what its statuses advertise)."""
        return self.data_url or self.hub_url

    @property
    def data_connect_plane_url(self) -> str:
        """The same broker as this node's own services reach it (they subscribe to their data topics there)."""
        return self.data_connect_url or self.data_plane_url

    @property
    def heartbeat_timeout_s(self) -> float:
        """Silence after which a service is suspect, in seconds."""
        return self.heartbeat_interval_s * self.heartbeat_timeout_factor
