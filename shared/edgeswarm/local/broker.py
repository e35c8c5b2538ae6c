"""Starting a local MQTT broker: Mosquitto when it is on PATH, otherwise the embedded amqtt broker.

The broker runs as a child process bound to loopback; callers stop it by its PID.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from edgeswarm.errors import BrokerUnavailableError, ConfigError, MissingExtraError
from edgeswarm.extras import has_extra, require_extra

log = logging.getLogger(__name__)

BrokerKind = Literal["mosquitto", "amqtt"]
DEFAULT_MAX_PACKET_BYTES = 16 * 1024 * 1024


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def port_bindable(host: str, port: int) -> bool:
    """Whether a listening socket could bind ``host:port`` now (as the broker will, with SO_REUSEADDR): False when
    another socket holds it, listening or not."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class BrokerSecurity:
    """What a secured local broker enforces: the cluster's users and ACL (from ``edgeswarm credentials``), and
    TLS when ``cert_file`` is set (the server certificate and key, and the CA that signed the clients' view)."""

    mosquitto_passwd: Path
    mosquitto_acl: Path
    amqtt_passwd: Path
    amqtt_acl: Path
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None


# How Mosquitto queues QoS 1 messages for a client (deploy/mosquitto/mosquitto.conf says the same). No in-flight
# limit: 2.0 keeps what exceeds one in a queue that later messages overtake, which reorders a topic; the client's
# inbox pushes back through TCP instead (edgeswarm.bus.inbox). The queue of a disconnected client's kept session is
# bounded by its bytes, its count far beyond any burst, so a member paused for a while gets every message again.
# (Not `max_queued_messages 0`, no count limit: 2.0.11 then fails the connection of a client whose QoS 1 publish
# its ACL refuses, "Bad socket read/write", instead of answering with the refusal.)
QUEUE_OPTIONS = ("max_inflight_messages 0", "max_queued_messages 1000000", "max_queued_bytes 1073741824")


def mosquitto_config(port: int, host: str = "127.0.0.1", *, max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES,
                     persistence_dir: Path | None = None, security: BrokerSecurity | None = None) -> str:
    """A mosquitto.conf for one listener, with the settings research/mqtt-stack.md found necessary.

    TCP_NODELAY (0.24 ms instead of 88 ms QoS 1 round trips), an explicit ``max_packet_size`` (2.1
    changed its default), and the QoS 1 queueing of ``QUEUE_OPTIONS``. With ``security``,
    no anonymous client, the cluster's password file and ACL, and TLS if it has a certificate.
    """
    lines = [f"listener {port} {host}"]
    if security is None:
        lines.append("allow_anonymous true")
    else:
        if os.geteuid() == 0:
            # Started as root, Mosquitto would switch to its own user, which cannot read our private files.
            lines.append(f"user {pwd.getpwuid(0).pw_name}")
        lines += ["allow_anonymous false", f"password_file {security.mosquitto_passwd}",
                  f"acl_file {security.mosquitto_acl}"]
        if security.cert_file is not None:
            lines += [f"certfile {security.cert_file}", f"keyfile {security.key_file}",
                      *([f"cafile {security.ca_file}"] if security.ca_file else [])]
    lines += [
        "set_tcp_nodelay true",
        f"max_packet_size {max_packet_bytes}",
        *QUEUE_OPTIONS,
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
    ]
    if persistence_dir is None:
        lines.append("persistence false")
    else:
        lines += ["persistence true", f"persistence_location {persistence_dir}/", "autosave_interval 60"]
    return "\n".join(lines) + "\n"


@dataclass
class BrokerProcess:
    """A broker child process. ``stop()`` ends it by PID (SIGTERM, then SIGKILL)."""

    kind: BrokerKind
    host: str
    port: int
    process: subprocess.Popen[bytes]
    workdir: Path
    _owns_workdir: bool = field(default=False, repr=False)
    tls: bool = False

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the broker and wait for it; kill it if it does not exit within ``timeout_s``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def resolve_kind(requested: str) -> BrokerKind:
    """``auto`` means Mosquitto if it is on PATH, else amqtt. Raises ConfigError for a missing Mosquitto, and
    MissingExtraError when it is amqtt and the ``broker`` extra is not installed."""
    if requested == "auto":
        if mosquitto_binary():
            return "mosquitto"
        if not has_extra("broker"):
            raise MissingExtraError("no MQTT broker to start: install Mosquitto (Debian: apt-get install mosquitto) "
                                    "or the embedded one: pip install 'edgeswarm[broker]'")
        return "amqtt"
    if requested == "mosquitto" and not mosquitto_binary():
        raise ConfigError("--broker mosquitto: no `mosquitto` on PATH (Debian: apt-get install mosquitto)")
    if requested not in ("mosquitto", "amqtt"):
        raise ConfigError(f"unknown broker {requested!r}; choose auto, mosquitto or amqtt")
    if requested == "amqtt":
        require_extra("broker")
    return requested  # type: ignore[return-value]


def mosquitto_binary() -> str | None:
    """Path of the mosquitto executable (PATH, then /usr/sbin where Debian puts it), or None."""
    return shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")


def start_broker(kind: str = "auto", *, host: str = "127.0.0.1", port: int = 0,
                 max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES, workdir: Path | None = None,
                 persistent: bool = False, timeout_s: float = 10.0,
                 security: BrokerSecurity | None = None) -> BrokerProcess:
    """Start a broker on ``host:port`` (port 0: a free one) and wait until it accepts connections.

    With ``security`` it lets in only the cluster's users, applies the ACL, and speaks TLS when the security
    has a certificate (``url`` is then ``mqtts://``). Raises ConfigError if the port is taken and
    BrokerUnavailableError if the broker does not come up.
    """
    resolved = resolve_kind(kind)
    port = port or free_port(host)
    if port_open(host, port) or not port_bindable(host, port):
        raise ConfigError(f"port {port} on {host} is already in use; pick another with --port, or --port 0 for "
                          "any free one")
    owns = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="edgeswarm-broker-")) if workdir is None else workdir.resolve()
    wd.mkdir(parents=True, exist_ok=True)
    log_file = open(wd / f"{resolved}.log", "ab")  # noqa: SIM115 - the child process owns it
    if resolved == "mosquitto":
        conf = wd / "mosquitto.conf"
        conf.write_text(mosquitto_config(port, host, max_packet_bytes=max_packet_bytes,
                                         persistence_dir=wd if persistent else None, security=security))
        cmd = [mosquitto_binary() or "mosquitto", "-c", str(conf)]
    else:
        cmd = [sys.executable, "-m", "edgeswarm.local.amqtt_broker", "--host", host, "--port", str(port)]
        if security is not None:
            cmd += ["--password-file", str(security.amqtt_passwd), "--acl-file", str(security.amqtt_acl)]
            if security.cert_file is not None:
                cmd += ["--certfile", str(security.cert_file), "--keyfile", str(security.key_file)]
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=wd, start_new_session=True)
    log_file.close()
    broker = BrokerProcess(resolved, host, port, proc, wd, owns, tls=security is not None and
                           security.cert_file is not None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (wd / f"{resolved}.log").read_text(errors="replace")[-800:]
            broker.stop()
            raise BrokerUnavailableError(f"{resolved} exited with code {proc.returncode} on start:\n{tail}")
        if port_open(host, port):
            log.info("started %s (pid %d) on %s", resolved, proc.pid, broker.url)
            return broker
        time.sleep(0.05)
    broker.stop()
    raise BrokerUnavailableError(f"{resolved} did not accept connections on {host}:{port} within {timeout_s:.0f} s")
