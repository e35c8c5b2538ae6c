"""Fault tolerance from the command line, on `up --local` clusters: a device killed with `edgeswarm chaos`, a device
that appears mid-job and a restarted coordinator, each followed by `train --wait` to an end with the weights of an
uninterrupted run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edgeswarm.messages.jobs import JobState
from helpers import wait_until
from test_cli import ENV, JOB, Up, edgeswarm


class _Following:
    """``edgeswarm train JOB --wait`` in the background, its output in a file."""

    def __init__(self, tmp_path: Path, job: str, url: str, *args: str) -> None:
        self.log = tmp_path / "train.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "edgeswarm", "train", job, "--hub", url, "--wait",
                                          *args], env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, text=True)

    def finish(self, timeout_s: float) -> str:
        try:
            self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
        return self.log.read_text()


def _running_from(url: str, name: str, round_index: int, timeout_s: float) -> JobState:
    """Job ``name``'s state once it runs with ``round_index`` rounds done, read from its retained state topic by a
    client of the test's own (polling `edgeswarm jobs` would start a process, 0.9 s of CPU, every few tenths of a
    second beside the cluster)."""
    from edgeswarm import topics
    from edgeswarm.bus import Inbound
    from edgeswarm.hpp.spec import TrainProgress
    from edgeswarm.runtime.client import client_bus
    from edgeswarm.settings import Settings
    from edgeswarm.workloads import typed_state

    seen: list[JobState] = []

    def on_state(msg: Inbound) -> None:
        assert isinstance(msg.body, JobState)
        seen.append(typed_state(msg.body))

    def reached() -> JobState | None:
        state = seen[-1] if seen else None
        if (state is not None and state.status == "running"
                and state.progress_as(TrainProgress).round >= round_index):
            return state
        return None

    bus = client_bus(Settings(hub_url=url))
    try:
        bus.subscribe(topics.job_state(name), on_state, schemas=(JobState,))
        return wait_until(reached, timeout_s, interval_s=0.1, message=f"job {name} at round {round_index}")
    finally:
        bus.stop()


FT_ROUNDS = 12
FT_JOB = JOB.replace("rounds: 6", f"rounds: {FT_ROUNDS}\ncheckpoint_interval: 4").replace("hidden: 64", "hidden: 256")
# Emulated devices this much slower than the host, so that a round lasts long enough to be interrupted (about a
# second with FT_JOB; at 60 it was as long while a spinning OpenMP barrier counted in the emulated CPU time).
FT_ENV = {"EDGESWARM_COMPUTE_SLOWDOWN": "300"}


@pytest.fixture(scope="module")
def ft_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The fault-tolerance tests' device settings and one profile cache for all of them: their devices are alike
    (Nano-like, FT_ENV's slow-down), so only the first test waits for its devices to be profiled."""
    return {"EDGESWARM_PROFILE_DIR": str(tmp_path_factory.mktemp("ft-profiles")), **FT_ENV}


class _Training:
    """An ``up --local`` cluster of ``devices`` Nano-like devices training FT_JOB as job ``name`` under
    ``train --wait`` (its report in run.json), waited for until the job has done ``at_round`` rounds."""

    def __init__(self, tmp_path: Path, up: list[Up], ft_env: dict[str, str], name: str, devices: int, at_round: int,
                 *train_args: str, rounds: int = FT_ROUNDS,
                 before_job: Callable[[_Training], None] | None = None) -> None:
        self.tmp_path = tmp_path
        self.env = {"EDGESWARM_CHECKPOINT_DIR": str(tmp_path / "checkpoints"), **ft_env}
        self.cluster = Up(tmp_path, "--devices", str(devices), "--device-class", "jetson-nano", env=self.env)
        up.append(self.cluster)
        self.cluster.status(devices=devices)
        if before_job is not None:
            before_job(self)
        self.job_text = FT_JOB.replace("mlp-teacher", name).replace(f"rounds: {FT_ROUNDS}", f"rounds: {rounds}")
        (tmp_path / f"{name}.yaml").write_text(self.job_text)
        self.train = _Following(tmp_path, str(tmp_path / f"{name}.yaml"), self.cluster.url, *train_args, "--json",
                                str(tmp_path / "run.json"))
        self.state = _running_from(self.cluster.url, name, at_round, 180)

    def finish(self) -> tuple[str, dict]:  # type: ignore[type-arg]
        """`train --wait`'s output and its report, once it exited 0."""
        out = self.train.finish(300)
        assert self.train.proc.returncode == 0, out
        return out, json.loads((self.tmp_path / "run.json").read_text())

    def assert_uninterrupted_weights(self, run: dict) -> None:  # type: ignore[type-arg]
        from helpers import assert_same_weights, parse_job_text, reference_weights, stored_weights

        job = parse_job_text(self.job_text)
        stages = len(run["state"]["plan"]["stages"])
        assert_same_weights(stored_weights(self.tmp_path / "checkpoints", job.name, stages),
                            reference_weights(job, run["state"]["progress"]["total_rounds"]))


def test_a_device_killed_with_chaos_shows_in_train_wait_and_the_job_ends_as_if_uninterrupted(
        tmp_path: Path, up, ft_env: dict[str, str]) -> None:
    """`edgeswarm chaos kill` on a device of a running job's plan: `train --wait` shows the loss and the recovery
    (from the job's event topic), the job completes on the survivors, and its weights are those of a run without
    the failure."""
    job = _Training(tmp_path, up, ft_env, "chaos", 3, 3, "--recovery", "light", rounds=8)
    victim = job.state.plan.stages[-1].devices[-1]  # type: ignore[union-attr]
    killed = edgeswarm("chaos", "kill", victim, "--hub", job.cluster.url)
    assert f"killed stage-worker on {victim}" in killed.stdout, killed.stdout
    out, run = job.finish()
    assert re.search(rf"device_lost.*{victim}", out) and re.search(r"recovered.*light recovery", out), out
    assert run["state"]["status"] == "succeeded" and run["state"]["progress"]["reconfigurations"] == 1
    assert victim not in {d for s in run["state"]["plan"]["stages"] for d in s["devices"]}
    assert [r["round"] for r in run["rounds"]] == list(range(1, 9))
    job.assert_uninterrupted_weights(run)


def test_a_device_that_appears_mid_job_is_added_at_a_round_boundary(tmp_path: Path, up, ft_env: dict[str, str],
                                                                    services: Any) -> None:
    """A third device's services started while a job trains on two: the job re-plans with it at the next round
    start, moves only the units whose owner changed, and ends with the weights of an uninterrupted run."""
    # The late device's node-agent and profiler start before the job (no stage-worker: nothing is planned on it);
    # its stage-worker at round 1 makes it appear. Only that one service must then start, and the device be profiled,
    # while the job runs: 22 rounds of about two seconds leave it most of a minute (alone it joined at round 5).
    # (With all its services started at round 1, beside another worker's browser test, joining once took more than
    # 16 rounds of 2.6 s.)
    # The late device computes 3x as fast as the others: the plan with it gains far more than its links, profiled
    # while the job's own traffic runs, can cost (alike, a loaded machine once priced the grown plan 0.412 s a round
    # against 0.401 s, and the coordinator rightly kept its plan).
    late = {"EDGESWARM_COMPUTE_SLOWDOWN": "100", "EDGESWARM_DEVICE_CLASS": "jetson-nano"}

    def late_device(job: _Training) -> None:
        for name in ("node-agent", "profiler"):
            services.start(name, "late-0", job.cluster.url, **{**job.env, **late})
        job.cluster.status(devices=3)  # its node-agent online

    job = _Training(tmp_path, up, ft_env, "grow", 2, 1, rounds=22, before_job=late_device)
    services.start("stage-worker", "late-0", job.cluster.url, **{**job.env, **late})
    out, run = job.finish()
    assert re.search(r"joined.*late-0 joined", out), out
    assert run["state"]["progress"]["reconfigurations"] == 1
    assert "late-0" in {d for s in run["state"]["plan"]["stages"] for d in s["devices"]}
    job.assert_uninterrupted_weights(run)


def test_a_restarted_coordinator_takes_the_job_over_and_it_ends_as_if_uninterrupted(tmp_path: Path, up,
                                                                                   ft_env: dict[str, str],
                                                                                   services: Any) -> None:
    """The coordinator killed (SIGKILL, with `edgeswarm chaos`) while a job trains, and a new one started on the hub:
    it reads the job's retained state, the devices restore their snapshots, `train --wait` follows the job to its
    end, and the weights are those of a run without the restart."""
    job = _Training(tmp_path, up, ft_env, "handover", 2, 6)
    killed = edgeswarm("chaos", "kill", "hub", "--service", "coordinator", "--hub", job.cluster.url)
    assert "killed coordinator on hub" in killed.stdout, killed.stdout
    services.start("coordinator", "hub", job.cluster.url, **job.env)
    out, run = job.finish()
    assert re.search(r"resumed.*takes the job over at round \d+", out), out
    assert run["state"]["status"] == "succeeded" and run["state"]["progress"]["checkpoint_version"] == FT_ROUNDS
    assert [r["round"] for r in run["rounds"]] == list(range(1, FT_ROUNDS + 1))
    job.assert_uninterrupted_weights(run)
