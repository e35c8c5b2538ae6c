"""Helpers the tests import (fixtures live in conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Fast liveness for tests: heartbeats every 0.25 s, suspect after 0.75 s of silence.
FAST_ENV = {
    "EDGESWARM_HEARTBEAT_INTERVAL_S": "0.25",
    "EDGESWARM_METRICS_INTERVAL_S": "0.5",
    "EDGESWARM_KEEPALIVE_S": "2",
    "EDGESWARM_LOG_LEVEL": "INFO",
}


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.05,
               message: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.1f} s waiting for {message}")
