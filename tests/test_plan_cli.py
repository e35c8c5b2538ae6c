"""``edgeswarm plan`` and ``edgeswarm bench planner`` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgeswarm.hpp.bench_planner import candidate_count
from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster
from edgeswarm.values.profiles import ClusterProfile
from helpers import FAST_ENV

GIB = 1024**3


def edgeswarm(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **FAST_ENV, "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "edgeswarm", *args], env=full, capture_output=True, text=True,
                          timeout=timeout)


def _saved(folder: Path) -> None:
    devs = [SyntheticDevice("nx-0", 1.0, 6 * GIB), SyntheticDevice("tx2-0", 2.5, 6 * GIB),
            SyntheticDevice("nano-0", 5.0, 3 * GIB), SyntheticDevice("nano-1", 5.0, 3 * GIB)]
    folder.mkdir()
    (folder / "cnn.json").write_text(synthetic_cluster(30, devs, bandwidth_bps=12.5e6).model_dump_json())
    (folder / "not-a-profile.json").write_text("{}")


def test_plan_from_saved_profiles_prints_table_json_and_png(tmp_path: Path) -> None:
    _saved(tmp_path / "profiles")
    png = tmp_path / "plan.png"
    out = edgeswarm("plan", "--model", "synthetic-cnn", "--profiles", str(tmp_path / "profiles"),
                    "--global-batch", "1024", "--png", str(png))
    assert out.returncode == 0, out.stderr
    for text in ("hpp plan", "memory used / budget", "samples/s", "single", "dp", "pp", "HPP speed-up", "nx-0"):
        assert text in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    js = edgeswarm("plan", "--model", "synthetic-cnn", "--profiles", str(tmp_path / "profiles"), "--global-batch",
                   "1024", "--micro-batches", "8", "--json")
    report = json.loads(js.stdout)
    assert report["hpp"]["options"]["micro_batches"] == 8
    assert sorted(d for s in report["hpp"]["stages"] for d in s["devices"]) == ["nano-0", "nano-1", "nx-0", "tx2-0"]
    assert {b["strategy"] for b in report["baselines"]} == {"single", "dp", "pp"}


def test_plan_explains_what_is_missing(tmp_path: Path) -> None:
    _saved(tmp_path / "profiles")
    wrong = edgeswarm("plan", "--model", "resnet50", "--profiles", str(tmp_path / "profiles"))
    assert wrong.returncode == 1 and "no profile for resnet50" in wrong.stderr and "synthetic-cnn" in wrong.stderr
    big = edgeswarm("plan", "--model", "synthetic-cnn", "--profiles", str(tmp_path / "profiles"), "--global-batch",
                    "4096", "--micro-batches", "2")
    assert big.returncode == 1 and "batch size" in big.stderr


@pytest.mark.alone
def test_plan_profiles_an_emulated_cluster_on_the_fly(tmp_path: Path) -> None:
    """The whole path: start a 2-device cluster, its profilers measure the model and the shaped link over MQTT."""
    cluster = tmp_path / "two.yaml"
    cluster.write_text("name: two\nnetwork: {bandwidth_mbps: 100, latency_ms: 0.5}\n"
                       "devices:\n  - {id: tx2-0, class: jetson-tx2}\n  - {id: nano-0, class: jetson-nano}\n")
    saved = tmp_path / "saved"
    out = edgeswarm("plan", "--model", "lenet5", "--cluster", str(cluster), "--batch-sizes", "1,8,32",
                    "--global-batch", "64", "--json", "--save-profiles", str(saved),
                    env={"EDGESWARM_PROFILE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert sorted(d for s in report["hpp"]["stages"] for d in s["devices"]) == ["nano-0", "tx2-0"]
    profile = ClusterProfile.model_validate_json(next(saved.glob("lenet5-*.json")).read_text())
    by_node = {e.device.node: e for e in profile.devices}
    nano, tx2 = by_node["nano-0"].compute, by_node["tx2-0"].compute
    # Measured, not read from the catalogue: a Nano-like device is slower than a TX2-like one (10x vs 4x).
    assert 1.5 < nano.speed_ratio / tx2.speed_ratio < 5
    link = next(lk for lk in profile.links if {lk.src, lk.dst} == {"nano-0", "tx2-0"})
    assert 0.5 * 12.5e6 < link.bandwidth_bps < 1.3 * 12.5e6


def test_candidate_count_matches_the_spec() -> None:
    assert candidate_count(213, 6) == 784_109 and candidate_count(56, 6) == 52_332


def test_bench_planner_time_only(tmp_path: Path) -> None:
    out = edgeswarm("bench", "planner", "--time-only", "--out", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "b.json").read_text())["planning_time"]
    assert [r["units"] for r in rows] == [213, 56] and all(r["seconds"] > 0 for r in rows)


def test_plan_stopped_by_sigterm_stops_the_cluster_it_started(tmp_path: Path) -> None:
    import re
    import signal
    import time

    from edgeswarm.local.broker import port_open

    cluster = tmp_path / "two.yaml"
    cluster.write_text("name: two\ndevices:\n  - {id: tx2-0, class: jetson-tx2}\n"
                       "  - {id: nano-0, class: jetson-nano}\n")
    log = tmp_path / "plan.log"
    env = {**os.environ, **FAST_ENV, "EDGESWARM_PROFILE_DIR": str(tmp_path / "cache")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgeswarm", "plan", "--model", "resnet18", "--cluster",
                                 str(cluster)], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"broker mqtt://127\.0\.0\.1:(\d+)", log.read_text())):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
        port = int(match.group(1))
        time.sleep(2)  # let the devices start profiling
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    hub = f"EDGESWARM_HUB_URL=mqtt://127.0.0.1:{port}".encode()
    leftovers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if hub in environ.split(b"\0"):
            leftovers.append(pid)
    assert leftovers == [] and not port_open("127.0.0.1", port)
