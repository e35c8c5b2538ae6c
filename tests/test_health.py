"""``edgeswarm health SERVICE``, compose's healthcheck: heartbeat stamps on disk (edgeswarm.runtime.health), read
by the command, against services run for real on Mosquitto."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edgeswarm.errors import ConfigError
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.runtime.health import HealthStamp, check_health, remove_stamp, stamp_path, write_stamp
from helpers import FAST_ENV, wait_until

NODE = "nano-1"
# FAST_ENV's heartbeat: a stamp is stale three intervals after it was written.
INTERVAL_S = float(FAST_ENV["EDGESWARM_HEARTBEAT_INTERVAL_S"])


def stamp(at: float, instance: str = "a1", stale_after_s: float = 6.0) -> HealthStamp:
    return HealthStamp(node=NODE, service="stage-worker", instance=instance, pid=123, at=at, heartbeat_interval_s=2.0,
                       stale_after_s=stale_after_s)


def test_a_stamp_is_fresh_until_its_own_limit_or_the_one_asked_for(tmp_path: Path) -> None:
    path = stamp_path(tmp_path / "health", NODE, "stage-worker")
    assert path == tmp_path / "health" / f"{NODE}.stage-worker.json"
    write_stamp(path, stamp(at=1000.0))
    assert check_health(path, now=1005.9).healthy
    stale = check_health(path, now=1006.5)
    assert not stale.healthy and "last heartbeat 6.5 s ago, more than 6 s" in stale.detail
    assert check_health(path, now=1006.5, max_age_s=10).healthy
    assert not check_health(path, now=1002.0, max_age_s=1).healthy
    with pytest.raises(ConfigError, match="--max-age must be a positive number"):
        check_health(path, max_age_s=0)


def test_a_missing_or_foreign_stamp_is_unhealthy(tmp_path: Path) -> None:
    missing = check_health(tmp_path / "none.json", now=0)
    assert not missing.healthy and "no heartbeat stamp" in missing.detail
    (tmp_path / "junk.json").write_text('{"at": "soon"}')
    assert "not a stamp edgeswarm wrote" in check_health(tmp_path / "junk.json").detail


def test_a_stopping_instance_removes_only_its_own_stamp(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    write_stamp(path, stamp(at=1.0, instance="new"))
    remove_stamp(path, "old")  # an old instance stopping after its successor started
    assert path.exists()
    remove_stamp(path, "new")
    assert not path.exists()
    remove_stamp(path, "new")  # already gone: nothing to do


def health(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgeswarm", "health", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_health_follows_a_real_service(broker: BrokerProcess, services, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = {**FAST_ENV, "EDGESWARM_NODE_ID": NODE, "EDGESWARM_HEALTH_DIR": str(tmp_path / "health")}
    before = health("node-agent", env=env)
    assert before.returncode == 1 and "unhealthy: no heartbeat stamp" in before.stderr

    proc = services.start("node-agent", NODE, broker.url, **env)
    wait_until(lambda: health("node-agent", env=env).returncode == 0 or proc.poll() is not None, 20,
               interval_s=0.2, message="node-agent to turn healthy")
    assert proc.poll() is None, services.log_of(proc)
    ok = health("node-agent", env=env)
    assert ok.returncode == 0 and f"healthy: node-agent on {NODE}" in ok.stdout and f"pid {proc.pid}" in ok.stdout
    # Another node's, or another service's, stamp is not this one's.
    assert health("node-agent", "--node", "other", env=env).returncode == 1
    assert health("profiler", env=env).returncode == 1

    # Alive but silent (a hung main loop): stale after three heartbeat intervals, fresh again once it resumes.
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: health("node-agent", env=env).returncode == 1, 10, interval_s=0.2,
                   message="a stopped service to turn unhealthy")
        assert "more than" in health("node-agent", env=env).stderr
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    wait_until(lambda: health("node-agent", env=env).returncode == 0, 10, interval_s=0.2,
               message="a resumed service to turn healthy again")

    # A clean stop removes the stamp at once.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, services.log_of(proc)
    stopped = health("node-agent", env=env)
    assert stopped.returncode == 1 and "no heartbeat stamp" in stopped.stderr


def test_a_killed_service_goes_stale(broker: BrokerProcess, services, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = {**FAST_ENV, "EDGESWARM_NODE_ID": NODE, "EDGESWARM_HEALTH_DIR": str(tmp_path / "health")}
    proc = services.start("stage-worker", NODE, broker.url, **env)
    wait_until(lambda: health("stage-worker", env=env).returncode == 0 or proc.poll() is not None, 30,
               interval_s=0.2, message="stage-worker to turn healthy")
    assert proc.poll() is None, services.log_of(proc)
    proc.kill()
    proc.wait(10)
    assert stamp_path(tmp_path / "health", NODE, "stage-worker").exists(), "SIGKILL leaves the stamp behind"
    wait_until(lambda: health("stage-worker", env=env).returncode == 1, 3 * INTERVAL_S + 5, interval_s=0.2,
               message="the stamp of a killed service to go stale")
    # A generous --max-age still reads it as fresh for a while: the limit is the caller's.
    assert health("stage-worker", "--max-age", "3600", env=env).returncode == 0


def test_health_usage_mistakes_give_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {"EDGESWARM_NODE_ID": NODE, "EDGESWARM_HEALTH_DIR": str(tmp_path)}
    unknown = health("nope", env=env)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: unknown service 'nope'")
    bad_age = health("planner", "--max-age", "-1", env=env)
    assert bad_age.returncode == 2 and "--max-age must be a positive number" in bad_age.stderr
    bad_setting = health("planner", env={**env, "EDGESWARM_HEARTBEAT_INTERVAL_S": "soon"})
    assert bad_setting.returncode == 2 and "EDGESWARM_HEARTBEAT_INTERVAL_S" in bad_setting.stderr
    for result in (unknown, bad_age, bad_setting):
        assert "Traceback" not in result.stderr
