"""The one module that runs ``ip``, ``tc`` and ``nft``: commands in the root namespace or in a node's namespace,
and the checks that say, before anything is created, why a namespace cluster cannot run here."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from edgeswarm.errors import EdgeswarmError

log = logging.getLogger(__name__)

PROBE_PREFIX = "esprobe"  # netem_available's scratch namespace, named with the prober's pid
COMMAND_TIMEOUT_S = 20.0  # one ip/tc/nft call; they return in milliseconds unless the kernel is stuck
TOOLS = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables", "iptables": "iptables", "mosquitto": "mosquitto"}


class NetnsUnavailableError(EdgeswarmError):
    """This machine cannot run a namespace cluster (not root, a tool missing, a kernel feature missing). The
    message names what is missing and how to get it."""


class HostCommandError(EdgeswarmError):
    """An ``ip``/``tc``/``nft`` command failed; the message has the command and what it printed."""


def preflight(tools: Sequence[str] = ("ip", "tc", "nft", "iptables", "mosquitto")) -> None:
    """Raise NetnsUnavailableError unless this process is root and every one of ``tools`` is on PATH."""
    problems = []
    if os.geteuid() != 0:
        problems.append("network namespaces need root (run it with sudo, or use `edgeswarm up --local`)")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        packages = sorted({TOOLS.get(t, t) for t in missing})
        problems.append(f"{', '.join(missing)} not found on PATH (apt-get install -y {' '.join(packages)})")
    if problems:
        raise NetnsUnavailableError("cannot start a namespace cluster: " + "; ".join(problems))


def run(cmd: Sequence[str], *, ns: str | None = None, stdin: str | None = None, check: bool = True) -> str:
    """Run ``cmd`` (in network namespace ``ns`` when given) and return its stdout. Raises HostCommandError when it
    exits non-zero and ``check`` is set."""
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    try:
        done = subprocess.run(full, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostCommandError(f"{' '.join(full)}: {exc}") from None
    if check and done.returncode != 0:
        said = done.stderr.strip() or done.stdout.strip()
        raise HostCommandError(f"{' '.join(full)} exited {done.returncode}: {said}")
    log.debug("%s -> %d", " ".join(full), done.returncode)
    return done.stdout


def netns_names() -> list[str]:
    """The network namespaces ``ip netns`` knows."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


@functools.lru_cache(maxsize=1)
def netem_available() -> bool:
    """Whether this kernel has ``sch_netem`` (delay, jitter and loss as a qdisc). Probed once, on a dummy link of
    a scratch namespace; some kernels (minimal VM images) are built without it."""
    scratch = f"{PROBE_PREFIX}{os.getpid()}"
    try:
        for name in netns_names():  # a probe killed by SIGKILL left its namespace behind
            pid = name[len(PROBE_PREFIX):]
            if name.startswith(PROBE_PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                run(["ip", "netns", "del", name], check=False)
        run(["ip", "netns", "add", scratch])
        run(["ip", "link", "add", "probe0", "type", "dummy"], ns=scratch)
        return subprocess.run(["ip", "netns", "exec", scratch, "tc", "qdisc", "add", "dev", "probe0", "root", "netem",
                               "delay", "1ms"], capture_output=True, timeout=COMMAND_TIMEOUT_S).returncode == 0
    except (HostCommandError, OSError, subprocess.TimeoutExpired):
        return False
    finally:
        run(["ip", "netns", "del", scratch], check=False)
