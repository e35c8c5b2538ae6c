"""``edgeswarm service NAME``: run one service in this process, configured by EDGESWARM_* variables."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from pydantic import ValidationError

from edgeswarm.cli.failures import exit_status, settings_problem
from edgeswarm.errors import ConfigError
from edgeswarm.logs import configure_cli_logging, configure_logging
from edgeswarm.netns.clock import keep_sleep_working
from edgeswarm.service_registry import service_class
from edgeswarm.settings import Settings

_PR_SET_PDEATHSIG = 1


def load_settings() -> Settings:
    """Settings from the environment. Raises ConfigError naming the offending variables."""
    try:
        return Settings()
    except ValidationError as exc:
        raise ConfigError(settings_problem(exc)) from None


def service_process(name: str) -> int:
    """All of ``edgeswarm service NAME`` once its command line is read (what a fork server's child runs too): the
    service until SIGTERM or SIGINT; returns the exit status, a configuration mistake reported in one line (2)."""
    configure_cli_logging("INFO")  # until the service configures its own, with its node and name
    return exit_status(lambda: _run_service(name))


def _run_service(name: str) -> int:
    """Run service ``name`` until SIGTERM or SIGINT; returns the exit status."""
    cls = service_class(name)
    settings = load_settings()
    configure_logging(settings.node_id, name, settings.log_level, settings.log_json)
    keep_sleep_working()  # a node whose clock chaos can skew
    _die_with_parent()
    return cls(settings).run()


def _die_with_parent() -> None:
    # Children of `edgeswarm up --local` get SIGTERM when the launcher dies, even by SIGKILL (Linux only).
    parent = os.environ.get("EDGESWARM_DIE_WITH_PARENT")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the launcher died before prctl took effect
        raise SystemExit(1)
