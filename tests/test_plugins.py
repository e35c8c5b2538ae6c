"""A job kind and a service from another installed package: the toy plug-in (tests/plugins/edgeswarm-toy) is built
and installed into a fresh environment, found through its entry points, and a toy job goes through a local cluster
started there: submit, plan (by edgeswarm's planner service), deploy (to the plug-in's own toy-worker service),
progress, ``jobs``, ``cancel`` and a coordinator take-over; then the workload contract test runs for the toy kind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeswarm.local.broker import free_port
from helpers import FAST_ENV, REPO, venv_with_wheel, wait_until

pytestmark = pytest.mark.slow

PLUGIN = REPO / "tests" / "plugins" / "edgeswarm-toy"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh environment holding the toy plug-in; edgeswarm and its dependencies come from this
    test's own environment (a site directory added by a .pth file), so nothing is downloaded."""
    pytest.importorskip("setuptools", reason="building the plug-in's wheel without a download needs setuptools")
    tmp = tmp_path_factory.mktemp("plugin")
    src = shutil.copytree(PLUGIN, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    python, site = venv_with_wheel(src, tmp, "edgeswarm_toy-*.whl")
    here = sysconfig.get_paths()["purelib"]
    (site / "edgeswarm-host.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    return python


def run(python: Path, *args: str, timeout: float = 120, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout,
                            env={**clean, **FAST_ENV, **(env or {})}, stdin=subprocess.DEVNULL, cwd=REPO / "tests")
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def test_the_plugin_is_found_only_where_it_is_installed(fresh: Path) -> None:
    probe = ("from edgeswarm.workloads import KINDS, worker_programs; from edgeswarm.service_registry import "
             "services; print(sorted(KINDS), sorted(services()), worker_programs('toy-worker'))")
    there = run(fresh, "-c", probe).stdout
    assert "'toy'" in there and "'toy-worker'" in there and "edgeswarm_toy.worker:ToyProgram" in there, there
    here = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "toy" not in here, here


@pytest.fixture(scope="module")
def cluster(fresh: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local cluster of two native devices started from the fresh environment: its hub URL."""
    tmp = tmp_path_factory.mktemp("plugin-cluster")
    port = free_port()
    url = f"mqtt://127.0.0.1:{port}"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(tmp / "up.log", "w") as out:
        up = subprocess.Popen([str(fresh), "-m", "edgeswarm", "up", "--local", "--devices", "2", "--device-class",
                               "native", "--port", str(port), "--workdir", str(tmp / "cluster")],
                              env={**clean, **FAST_ENV}, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    try:
        def toy_workers() -> bool:
            status = run(fresh, "-m", "edgeswarm", "status", "--hub", url, "--json", "--wait-devices", "2",
                         "--timeout", "60", check=False)
            if status.returncode != 0:
                return False
            nodes = json.loads(status.stdout)["nodes"]
            return sum(1 for n in nodes for s in n["services"] if s["service"] == "toy-worker"
                       and s["state"] == "online") == 2

        wait_until(toy_workers, 240, interval_s=1.0, message="a toy-worker online on both devices")
        yield url
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(5)


def _spec(tmp_path: Path, name: str, steps: int, step_s: float) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"kind: toy\nname: {name}\nsteps: {steps}\nstep_s: {step_s}\n")
    return str(path)


def _job(fresh: Path, url: str, name: str) -> dict[str, object] | None:
    listed = json.loads(run(fresh, "-m", "edgeswarm", "jobs", "--hub", url, "--json").stdout)
    return next((j for j in listed if j["job_id"] == name), None)


def test_a_toy_job_is_planned_deployed_run_and_listed(fresh: Path, cluster: str, tmp_path: Path) -> None:
    out = run(fresh, "-m", "edgeswarm", "train", _spec(tmp_path, "toy-run", 12, 0.0), "--hub", cluster, "--wait",
              "--timeout", "120").stdout
    assert "planned 2 devices" in out and "deployed" in out, out
    assert "toy-run succeeded: step 12/12; doubled sum 156" in out, out  # 2 * (1 + ... + 12)
    job = _job(fresh, cluster, "toy-run")
    assert job is not None and job["kind"] == "toy" and job["status"] == "succeeded"
    assert job["progress"] == {"steps_done": 12, "total": 12, "doubled_sum": 156}
    assert sorted(d for stage in job["stages"] for d in stage) == ["native-0", "native-1"], job
    table = run(fresh, "-m", "edgeswarm", "jobs", "--hub", cluster).stdout
    assert "toy-run" in table and "step 12/12" in table, table


def test_a_toy_job_is_cancelled(fresh: Path, cluster: str, tmp_path: Path) -> None:
    run(fresh, "-m", "edgeswarm", "train", _spec(tmp_path, "toy-cancel", 1000, 0.2), "--hub", cluster)
    wait_until(lambda: (_job(fresh, cluster, "toy-cancel") or {}).get("status") == "running", 60,
               interval_s=0.5, message="the toy job running")
    out = run(fresh, "-m", "edgeswarm", "cancel", "toy-cancel", "--hub", cluster).stdout
    assert "cancelling" in out, out
    wait_until(lambda: (_job(fresh, cluster, "toy-cancel") or {}).get("status") == "cancelled", 30,
               interval_s=0.5, message="the toy job cancelled")


def test_a_restarted_coordinator_takes_a_toy_job_over(fresh: Path, cluster: str, tmp_path: Path) -> None:
    run(fresh, "-m", "edgeswarm", "train", _spec(tmp_path, "toy-handover", 60, 0.25), "--hub", cluster)
    wait_until(lambda: ((_job(fresh, cluster, "toy-handover") or {}).get("progress") or {}).get("steps_done", 0) >= 3,
               60, interval_s=0.3, message="the toy job three steps in")
    killed = run(fresh, "-m", "edgeswarm", "chaos", "kill", "hub", "--service", "coordinator", "--hub", cluster).stdout
    assert "killed coordinator on hub" in killed, killed
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(tmp_path / "coordinator.log", "w") as out:
        coordinator = subprocess.Popen([str(fresh), "-m", "edgeswarm", "service", "coordinator"],
                                       env={**clean, **FAST_ENV, "EDGESWARM_NODE_ID": "hub",
                                            "EDGESWARM_HUB_URL": cluster},
                                       stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            job = _job(fresh, cluster, "toy-handover")
            if job is not None and job["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
        assert job is not None and job["status"] == "succeeded", job
        # Every step counted once across the two coordinators: 2 * (1 + ... + 60).
        assert job["progress"] == {"steps_done": 60, "total": 60, "doubled_sum": 3660}, job
    finally:
        coordinator.terminate()
        try:
            coordinator.wait(15)
        except subprocess.TimeoutExpired:
            coordinator.kill()
            coordinator.wait(5)
    log = (tmp_path / "coordinator.log").read_text()
    assert "taking it over" in log, log


def test_the_toy_kind_passes_the_workload_contract(fresh: Path) -> None:
    result = run(fresh, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_workload_contract.py",
                 timeout=600, check=False, env={"EDGESWARM_CONTRACT_KINDS": "toy"})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "passed" in result.stdout and "failed" not in result.stdout, result.stdout[-3000:]


def test_the_toy_kind_adds_its_own_benchmark(fresh: Path, tmp_path: Path) -> None:
    """``edgeswarm bench toy`` comes from the plug-in (its kind's ``benches``), runs on a cluster the command line
    starts for it, and is offered only where the plug-in is installed."""
    assert "toy jobs on a local cluster" in run(fresh, "-m", "edgeswarm", "bench", "--help").stdout
    here = subprocess.run([sys.executable, "-m", "edgeswarm", "bench", "--help"], capture_output=True, text=True,
                          check=True, timeout=60).stdout
    assert "toy" not in here and "splitfed" in here
    out = tmp_path / "toy.json"
    result = run(fresh, "-m", "edgeswarm", "bench", "toy", "--steps", "20", "--json", str(out), timeout=300)
    figures = json.loads(out.read_text())
    assert (figures["status"], figures["steps"], figures["doubled_sum"]) == ("succeeded", 20, 420), figures
    assert figures["ms_per_step"] > 0 and "toy jobs on a local cluster" in result.stdout
