"""Each node's own Mosquitto, run in its namespace with the deployment's configuration: ``deploy/mosquitto/
mosquitto.conf`` (TLS on 8883, the cluster's password file and generated ACL, persistence), the container paths it
names mapped to this cluster's files."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from edgeswarm.errors import BrokerUnavailableError, ConfigError
from edgeswarm.local.broker import mosquitto_binary
from edgeswarm.netns.state import BROKER_PORT, NetnsNode

log = logging.getLogger(__name__)

DEPLOY_CONF = Path(__file__).resolve().parents[3] / "deploy" / "mosquitto" / "mosquitto.conf"
START_TIMEOUT_S = 15.0


def deployment_config(*, cert: Path, key: Path, ca: Path, passwd: Path, acl: Path, data_dir: Path,
                      source: Path = DEPLOY_CONF) -> str:
    """The deployment's mosquitto.conf with its ``/run/secrets`` and ``/mosquitto/data`` paths replaced by these
    files. Raises ConfigError when the file is missing (an installed package without the repository's deploy/)."""
    if not source.exists():
        raise ConfigError(f"{source} not found: namespace clusters run the deployment's broker configuration from a "
                          "checkout of the repository")
    paths = {"/run/secrets/broker-cert": cert, "/run/secrets/broker-key": key, "/run/secrets/edgeswarm-ca": ca,
             "/run/secrets/broker-passwd": passwd, "/run/secrets/broker-acl": acl, "/mosquitto/data/": f"{data_dir}/"}
    lines = []
    for line in source.read_text().splitlines():
        for container, real in paths.items():
            line = line.replace(container, str(real))
        lines.append(line)
    if os.geteuid() == 0:  # as root Mosquitto would switch to its own user, which cannot read our private files
        lines.append("user root")
    return "\n".join(lines) + "\n"


def _accepting(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.3):
            return True
    except OSError:
        return False


def start(node: NetnsNode, conf: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``node``'s broker in its namespace from ``conf`` and wait until it accepts connections on the node's
    address (reached from the root namespace over the bridge). Raises BrokerUnavailableError."""
    binary = mosquitto_binary()
    if binary is None:
        raise ConfigError("no `mosquitto` on PATH (apt-get install -y mosquitto)")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(["ip", "netns", "exec", node.netns, binary, "-c", str(conf)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-600:]
            raise BrokerUnavailableError(f"the broker of {node.node} exited with code {proc.returncode}:\n{tail}")
        if _accepting(node.address, BROKER_PORT):
            log.info("broker of %s (pid %d) on %s", node.node, proc.pid, node.broker_url)
            return proc
        time.sleep(0.05)
    stop(proc)
    raise BrokerUnavailableError(f"the broker of {node.node} did not accept connections on {node.broker_url} within "
                                 f"{START_TIMEOUT_S:.0f} s")


def stop(proc: subprocess.Popen[bytes], *, kill: bool = False, timeout_s: float = 5.0) -> None:
    """End a broker: SIGTERM (it saves its retained messages) or, with ``kill``, SIGKILL (a crash)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)

