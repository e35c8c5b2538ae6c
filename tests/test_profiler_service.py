"""The profiler service over the real broker, gathering a cluster profile, and ``edgeswarm profile``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edgeswarm import topics
from edgeswarm.cli.main import main
from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry, NetworkDefaults
from edgeswarm.errors import ProfileTimeoutError
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.local.forkserver import ForkServer
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.messages import Probe, ProbeReply, ProfileFailed, ProfileProgress, ProfileReport, ProfileRequest
from edgeswarm.profiling.gather import gather_cluster_profile
from edgeswarm.runtime.client import ClusterWatcher, client_bus, wait_for_service
from edgeswarm.settings import Settings
from edgeswarm.values.profiles import ClusterProfile, ModelSpec
from helpers import FAST_ENV, wait_until

TINY_MLP = ModelSpec(name="mlp", config={"image_size": 8, "hidden": 32})
NODE = "dev-a"


def request(request_id: str, spec: ModelSpec = TINY_MLP, batch_sizes: list[int] | None = None,
            **fields: object) -> ProfileRequest:
    return ProfileRequest(request_id=request_id, model=spec, batch_sizes=batch_sizes or [1, 4], **fields)  # type: ignore[arg-type]


def total_seconds(report_compute: object) -> float:
    return sum(sum(row) for row in report_compute.forward_s) + sum(sum(row) for row in report_compute.backward_s)  # type: ignore[attr-defined]


def test_a_request_gets_progress_a_retained_report_and_a_reply_then_a_cache_hit(
        broker: BrokerProcess, services, make_bus, tmp_path: Path) -> None:
    proc = services.start("profiler", NODE, broker.url, EDGESWARM_PROFILE_DIR=str(tmp_path / "profiles"),
                          EDGESWARM_DEVICE_CLASS="jetson-nx")
    client = make_bus("cli", "cli")
    progress: list[ProfileProgress] = []
    lock = threading.Lock()

    def on_progress(msg) -> None:  # type: ignore[no-untyped-def]
        with lock:
            progress.append(msg.body)

    client.subscribe(topics.ALL_PROFILE_PROGRESS, on_progress, schemas=(ProfileProgress,))
    client.peers.wait_for(NODE, "profiler", timeout_s=60)

    first = client.request(topics.request(NODE, "profiler"), request("r1"), timeout_s=60).body
    assert isinstance(first, ProfileReport), first
    assert first.request_id == "r1" and first.node == NODE and not first.cache_hit and first.links == []
    device, compute = first.entry.device, first.entry.compute
    assert device.node == NODE and device.device_class == "jetson-nx" and device.compute_flops > 0
    assert device.memory_budget_bytes == int(6.5 * 2**30)
    # The ratio itself is measured against the host's speed, which the other workers' load moves: that the emulated
    # slow-down shows in it is checked alone (tests/test_profiler_compute.py).
    assert compute.batch_sizes == [1, 4] and compute.method == "calibrated" and compute.speed_ratio > 0
    assert len(compute.forward_s) == len(first.model.units) and first.model.model == TINY_MLP
    wait_until(lambda: any(p.request_id == "r1" and p.fraction == 1.0 for p in progress), 5,
               message="the final progress event")
    with lock:
        mine = [p for p in progress if p.request_id == "r1"]
    assert len(mine) >= 2 and all(p.node == NODE for p in mine)
    assert [p.fraction for p in mine] == sorted(p.fraction for p in mine)

    # The report is retained per model: a late subscriber gets it.
    late = make_bus("late", "cli")
    retained: list[ProfileReport] = []
    late.subscribe(topics.profile_report(NODE, first.model.fingerprint), lambda m: retained.append(m.body),
                   schemas=(ProfileReport,))
    wait_until(lambda: retained, 5, message="the retained report")
    assert retained[0] == first

    second = client.request(topics.request(NODE, "profiler"), request("r2", batch_sizes=[4]), timeout_s=30).body
    assert isinstance(second, ProfileReport) and second.cache_hit
    assert second.entry.compute.batch_sizes == [4]
    assert second.entry.compute.forward_s == [[row[1]] for row in compute.forward_s]

    # Bad requests get a failure reply; the service stays up and keeps serving.
    for bad, needle in ((request("b1", ModelSpec(name="no-such-model")), "unknown model"),
                        (request("b2", batch_sizes=[8, 2]), "ascending"),
                        (request("b3", ModelSpec(name="mlp", config={"hidden": "wide"})), "hidden")):
        answer = client.request(topics.request(NODE, "profiler"), bad, timeout_s=30).body
        assert isinstance(answer, ProfileFailed), answer
        assert answer.reason == "bad_request" and needle in answer.detail and answer.request_id == bad.request_id
    answer = client.request(topics.request(NODE, "profiler"), request("b4", peers=["ghost"]), timeout_s=60).body
    assert isinstance(answer, ProfileFailed) and answer.reason == "link" and "ghost" in answer.detail
    probe = client.request(topics.request(NODE, "profiler"), Probe()).body
    assert isinstance(probe, ProbeReply) and probe.healthy and probe.handler_errors == 0
    again = client.request(topics.request(NODE, "profiler"), request("r3"), timeout_s=30).body
    assert isinstance(again, ProfileReport) and again.cache_hit
    assert proc.poll() is None
    assert sorted(p.name for p in (tmp_path / "profiles" / "compute" / first.model.fingerprint).iterdir()) == sorted(
        [f"{compute.device_fingerprint}.calibrated.json", f"{_host_fingerprint()}.measured.json"])


def _host_fingerprint() -> str:
    """The fingerprint the native profile of an emulated device is filed under: it is timed on one thread."""
    from edgeswarm.profiling.compute import host_fingerprint, torch_threads

    with torch_threads(1):
        return host_fingerprint()


@pytest.mark.alone
def test_gather_profiles_emulated_devices_and_their_shaped_links(tmp_path: Path, forks: ForkServer) -> None:
    spec = ClusterSpec(name="gather-test", network=NetworkDefaults(bandwidth_mbps=100, latency_ms=1),
                       devices=(DeviceEntry(id="server-0", device_class="edge-server"),
                                DeviceEntry(id="nano-0", device_class="jetson-nano"),
                                DeviceEntry(id="tx2-0", device_class="jetson-tx2")))
    nodes = [d.id for d in spec.devices]
    env = {**FAST_ENV, "EDGESWARM_PROFILE_DIR": str(tmp_path / "profiles")}
    seen: dict[str, float] = {}
    with LocalCluster(spec, port=0, workdir=tmp_path / "cluster", extra_env=env, dashboard_port=None,
                      forks=forks) as cluster:
        bus = client_bus(Settings(hub_url=cluster.hub_url))
        try:
            watcher = ClusterWatcher(bus)
            watcher.wait(settle_s=0.2, devices=3, timeout_s=30)
            # A device is online with its node agent; its profiler may come later (on a native device it asks
            # torch which accelerator there is first), and a request sent before it subscribed would be lost.
            assert wait_for_service(watcher, "profiler", nodes, 60) == []
            profile = gather_cluster_profile(bus, TINY_MLP, nodes, [1, 4], timeout_s=90,
                                             progress=lambda n, f, _m: seen.__setitem__(n, max(f, seen.get(n, 0))))
        finally:
            bus.stop()

    assert [d.device.node for d in profile.devices] == nodes
    assert set(seen) == set(nodes)
    classes = {d.device.node: d.device.device_class for d in profile.devices}
    assert classes == {"server-0": "edge-server", "nano-0": "jetson-nano", "tx2-0": "jetson-tx2"}
    # Slow-downs of 1, 10 and 4, measured (never read from the settings): ratios with wide tolerances.
    times = {d.device.node: total_seconds(d.compute) for d in profile.devices}
    assert times["nano-0"] > 3 * times["server-0"] and times["tx2-0"] > 1.5 * times["server-0"], times
    assert times["nano-0"] > 1.5 * times["tx2-0"], times
    flops = {d.device.node: d.device.compute_flops for d in profile.devices}
    assert flops["server-0"] > 3 * flops["nano-0"], flops

    pairs = {(link.src, link.dst): link for link in profile.links}
    assert set(pairs) == {(a, b) for a in nodes for b in nodes if a != b}
    for (a, b), link in pairs.items():
        assert link.bandwidth_bps == pairs[(b, a)].bandwidth_bps and link.latency_s == pairs[(b, a)].latency_s
        assert 0.6 < link.bandwidth_bps / 12.5e6 < 1.2, link
        assert link.latency_s > 0
    ClusterProfile.model_validate_json(profile.model_dump_json())


def test_gather_names_the_node_that_does_not_answer(broker: BrokerProcess, make_bus) -> None:
    import pytest


    bus = make_bus("cli", "cli")
    with pytest.raises(ProfileTimeoutError, match="absent-node"):
        gather_cluster_profile(bus, TINY_MLP, ["absent-node"], [1], timeout_s=1)


def test_profile_command_writes_a_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lenet5.json"
    env = {**os.environ, **FAST_ENV, "EDGESWARM_PROFILE_DIR": str(tmp_path / "profiles"), "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "edgeswarm", "profile", "--model", "lenet5", "--batch-sizes", "1,8"]
    result = subprocess.run([*cmd, "--out", str(out), "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    profile = ClusterProfile.model_validate_json(out.read_text())
    assert json.loads(result.stdout) == json.loads(out.read_text())
    (entry,) = profile.devices
    assert profile.model.model.name == "lenet5" and len(profile.model.units) == len(entry.compute.forward_s)
    assert entry.compute.batch_sizes == [1, 8] and entry.device.device_class == "native"
    assert all(t > 0 for row in entry.compute.forward_s for t in row)
    assert entry.compute.chain is not None and len(entry.compute.chain) == 2  # a stage priced by its extent
    assert sum(u.weight_bytes for u in profile.model.units) > 0 and profile.links == []

    # The same command in this process (cheaper than two more interpreters): a table, then a cache hit.
    monkeypatch.setenv("EDGESWARM_PROFILE_DIR", str(tmp_path / "profiles"))
    args = ["profile", "--model", "lenet5", "--batch-sizes", "1,8", "--device-class", "jetson-tx2"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "lenet5 on jetson-tx2 (calibrated)" in table and "features.0" in table and "GFLOP/s training" in table
    assert "a call after the device idled pays" in table and "each half of the model" in table
    assert main(args) == 0
    assert "lenet5 on jetson-tx2 (calibrated, from the cache)" in capsys.readouterr().out

    assert main(["profile", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'nope'" in err and "lenet5" in err
    assert main(["profile", "--model", "lenet5", "--batch-sizes", "8,x"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
