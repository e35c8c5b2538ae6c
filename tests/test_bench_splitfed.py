"""`edgeswarm bench splitfed`, run as a real process at --quick sizes: the planner section's figures in the JSON,
the simulation's accuracy rows, and checked arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from edgeswarm.cli.main import main
from edgeswarm.splitfed.simulation import SimulationConfig, simulate
from helpers import FAST_ENV

ENV = {**os.environ, **FAST_ENV, "COLUMNS": "200"}


def edgeswarm(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgeswarm", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_bench_splitfed_planner_quick_writes_every_method(tmp_path: Path) -> None:
    out = tmp_path / "splitfed.json"
    proc = edgeswarm("bench", "splitfed", "--sections", "planner", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    (quality,) = report["quality"]
    assert quality["instances"] == 5 and quality["worse_than_initial"] == 0
    assert 0.0 <= quality["within"] <= 1.0
    rows = {r["method"]: r for r in report["planner"]}
    assert set(rows) == {"smartsplit", "fedavg", "splitfed"}
    for r in rows.values():
        assert r["model"] == "lenet5" and r["error"] is None
        assert r["participants"] == 10 and r["round_s"] > 0 and r["wan_bytes"] > 0
    # SmartSplit's WAN carries the global model to and from the MECs only; FedAvg's devices fetch it over the WAN.
    assert rows["smartsplit"]["wan_bytes"] < rows["fedavg"]["wan_bytes"]
    assert rows["splitfed"]["cuts"] == [3] and rows["fedavg"]["cuts"] == [11]
    cap = {r["method"]: r for r in report["cap"]}
    assert cap["smartsplit"]["participants"] == 10  # VGG16 under 256 MiB still trains by splitting
    assert cap["fedavg"]["participants"] == 0 and cap["fedavg"]["error"]
    assert "I6" in proc.stdout and "U6" in proc.stdout


def test_simulation_trains_and_fedavg_loses_devices_the_whole_model_does_not_fit() -> None:
    fed = simulate(SimulationConfig(method="fedavg", rounds=2, devices=20, mecs=2, participants=4))
    smart = simulate(SimulationConfig(method="smartsplit", rounds=2, devices=20, mecs=2, participants=4))
    for r in (fed, smart):
        assert len(r.accuracies) == 2 and all(0.0 <= a <= 1.0 for a in r.accuracies)
        assert r.participants == [4, 4]
    # Budgets are scaled so that the median fits LeNet-5 whole: FedAvg's local training leaves some devices out,
    # SmartSplit's shallow cuts fewer.
    assert fed.excluded_devices > smart.excluded_devices


def test_bench_splitfed_refuses_unknown_sections() -> None:
    assert main(["bench", "splitfed", "--sections", "nope"]) != 0
