"""Every user-facing command, run as a real process: up, status, topics, service, bench transport, train."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edgeswarm.local.broker import free_port
from edgeswarm.local.launcher import DEVICE_SERVICES, HUB_SERVICES
from edgeswarm.topics import TOPIC_TREE
from helpers import FAST_ENV, wait_until

ENV = {**os.environ, **FAST_ENV, "COLUMNS": "200"}


def edgeswarm(*args: str, timeout: float = 120, check: bool = True,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "edgeswarm", *args], env={**ENV, **(env or {})},
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"edgeswarm {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


class Up:
    """``edgeswarm up --local`` in the background; stopped with SIGTERM (SIGKILL as a last resort)."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"mqtt://127.0.0.1:{self.port}"
        self.log = tmp_path / "up.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "edgeswarm", "up", "--local", "--port", str(self.port),
                 "--workdir", str(tmp_path / "cluster"), *args],
                env={**ENV, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                text=True)

    def status(self, devices: int) -> dict[str, object]:
        result = edgeswarm("status", "--hub", self.url, "--json", "--wait-devices", str(devices), "--timeout", "60")
        return json.loads(result.stdout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            pytest.fail(f"edgeswarm up ignored SIGTERM:\n{self.log.read_text()}")


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_up_local_starts_a_cluster_status_shows_it_and_sigterm_stops_every_process(tmp_path: Path, up) -> None:
    cluster = Up(tmp_path, "--devices", "asteroid-env-d-100mbps")
    up.append(cluster)
    # The hub's services come online in their own time (the coordinator imports torch), so ask until they have.
    view: dict = {}

    def complete() -> bool:
        # A device counts as online with its node agent; its profiler and stage-worker may come a little later.
        nonlocal view
        view = cluster.status(devices=4)
        counts = {n["node"]: len(n["services"]) for n in view["nodes"]}
        return counts.pop("hub", 0) == len(HUB_SERVICES) and all(c == len(DEVICE_SERVICES) for c in counts.values())

    wait_until(complete, 60, interval_s=1.0, message="every service in the view")
    nodes = {n["node"]: n for n in view["nodes"]}
    assert set(nodes) == {"hub", "tx2-0", "nano-0", "nano-1", "nano-2"}
    assert nodes["tx2-0"]["device_class"] == "jetson-tx2" and nodes["nano-2"]["device_class"] == "jetson-nano"
    assert all(n["state"] == "online" for n in nodes.values())
    assert sorted(s["service"] for s in nodes["hub"]["services"]) == sorted(HUB_SERVICES)
    # Emulated Jetsons compute on the CPU whatever torch could use; the hub's services compute nothing.
    assert all(nodes[n]["compute"] == "cpu" for n in nodes if n != "hub") and nodes["hub"]["compute"] == ""

    table = edgeswarm("status", "--hub", cluster.url).stdout
    assert "view from coordinator" in table
    for node in nodes:
        assert node in table
    assert "heartbeat age" in table and "online" in table
    assert re.search(r"tx2-0\s*[│|]\s*jetson-tx2\s*[│|]\s*cpu\s*[│|]", table), table

    # A plain MQTT tool sees the retained statuses.
    mosquitto_sub = shutil.which("mosquitto_sub")
    assert mosquitto_sub, "mosquitto_sub is missing (apt-get install -y mosquitto-clients)"
    sub = subprocess.run([mosquitto_sub, "-h", "127.0.0.1", "-p", str(cluster.port), "-v",
                          "-t", "edgeswarm/node/+/+/status",
                          "-W", "2", "-F", "%t"], capture_output=True, text=True, timeout=10)
    topics_seen = set(sub.stdout.split())
    assert {f"edgeswarm/node/{n}/{'coordinator' if n == 'hub' else 'node-agent'}/status" for n in nodes} <= topics_seen

    pids = [s["pid"] for n in nodes.values() for s in n["services"]]
    services = len(HUB_SERVICES) + 4 * len(DEVICE_SERVICES)  # the hub's services and each device's
    assert len(pids_alive(pids)) == services
    assert cluster.stop() == 0
    assert pids_alive(pids) == [], "every service process is gone"
    log = cluster.log.read_text()
    assert "broker: mosquitto" in log and f"stopped {services + 1} processes" in log
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/", log), log  # the hub's dashboard, on a free port
    broker_pid = int(re.search(r"broker: mosquitto \(pid (\d+)\)", log).group(1))
    assert pids_alive([broker_pid]) == []


# How long the amqtt cluster may take to come up. The pure-Python broker and seven services that import torch are
# slow on a loaded host: this bounds the wait without being a deadline the test could miss for being slow.
AMQTT_READY_S = 600


def _online_view(cluster: Up, devices: int, nodes: int) -> dict | None:  # type: ignore[type-arg]
    """The cluster view once ``nodes`` nodes, ``devices`` of them devices, are online, else None. One ``status
    --wait-devices`` call, which itself waits (for the broker too) up to 120 s; fails at once if ``up`` exited."""
    if cluster.proc.poll() is not None:
        pytest.fail(f"edgeswarm up exited {cluster.proc.returncode}:\n{cluster.log.read_text()}")
    result = edgeswarm("status", "--hub", cluster.url, "--json", "--wait-devices", str(devices), "--timeout", "120",
                       check=False, timeout=300)
    if result.returncode != 0:
        return None
    view = json.loads(result.stdout)
    return view if sum(1 for n in view["nodes"] if n["state"] == "online") == nodes else None


def test_the_amqtt_fallback_brings_up_a_cluster_that_status_shows(tmp_path: Path, up) -> None:
    # `up` waits for its devices as long as the test does, so neither gives up on a cluster that is merely slow.
    cluster = Up(tmp_path, "--broker", "amqtt", "--devices", "2", "--ready-timeout", str(AMQTT_READY_S))
    up.append(cluster)
    view = wait_until(lambda: _online_view(cluster, devices=2, nodes=3), AMQTT_READY_S, interval_s=1.0,
                      message="the hub and both devices online in `edgeswarm status`")
    assert {n["node"] for n in view["nodes"] if n["state"] == "online"} == {"hub", "tx2-0", "nano-1"}
    # Stop only once `up` itself saw the cluster ready: a SIGTERM while it still waits is an interrupted start.
    wait_until(lambda: "cluster up" in cluster.log.read_text(), AMQTT_READY_S, interval_s=0.5,
               message="`edgeswarm up` reporting the cluster up")
    log = cluster.log.read_text()
    assert "broker: amqtt" in log and "MQTT 3.1.1 only" in log
    assert cluster.stop() == 0


def test_status_without_a_broker_says_how_to_start_one() -> None:
    result = edgeswarm("status", "--hub", f"mqtt://127.0.0.1:{free_port()}", check=False, timeout=60)
    assert result.returncode == 1
    assert "cannot connect to the MQTT broker" in result.stderr and "edgeswarm up --local" in result.stderr


def test_status_reports_missing_devices_with_a_nonzero_exit(tmp_path: Path, up) -> None:
    cluster = Up(tmp_path, "--devices", "1")
    up.append(cluster)
    cluster.status(devices=1)
    result = edgeswarm("status", "--hub", cluster.url, "--wait-devices", "3", "--timeout", "1", check=False)
    assert result.returncode == 1 and "only 1 of 3 devices online" in result.stdout


def test_topics_lists_the_tree() -> None:
    listed = json.loads(edgeswarm("topics", "--json").stdout)
    assert [t["pattern"] for t in listed] == [t.pattern for t in TOPIC_TREE]
    table = edgeswarm("topics").stdout
    assert "edgeswarm/cluster/view" in table and "retained" in table


def test_service_command_rejects_unknown_services_and_up_needs_local() -> None:
    result = edgeswarm("service", "bogus", check=False)
    available = "available: checkpoint-store, coordinator, dashboard, gateway, mec-manager, node-agent"
    assert result.returncode == 2 and available in result.stderr
    result = edgeswarm("up", check=False)
    assert result.returncode == 2 and "docker compose up" in result.stderr
    result = edgeswarm("up", "--local", "--devices", "no-such-file", check=False)
    assert result.returncode == 2 and "asteroid-env-d-100mbps" in result.stderr


def test_bench_transport_quick_reports_ratios_round_trip_and_codec(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = edgeswarm("bench", "transport", "--quick", "--json", "--out", str(out), timeout=300)
    report = json.loads(result.stdout)
    assert json.loads(out.read_text()) == report
    sizes = [row["size_bytes"] for row in report["rows"]]
    assert sizes == [1024, 64 * 1024, 1024 * 1024, 16 * 1024 * 1024]
    for row in report["rows"]:
        assert row["mqtt_mb_s"] > 0 and row["tcp_mb_s"] > 0
    assert report["rtt_samples"] == 200 and report["rtt_1kb_qos1_median_ms"] > 0
    assert report["codec"]["decode_zero_copy"] is True
    assert report["broker_protocol"] == "5" and report["target"] == "bench-sink/node-agent"


JOB = """name: mlp-teacher
model: {name: mlp, config: {hidden: 64, layers: 2}}
data: {kind: teacher, size: 1024, test_size: 128}
global_batch: 64
micro_batches: 2
optimizer: {name: momentum, lr: 0.05}
rounds: 6
"""


def test_train_jobs_and_cancel_on_a_local_cluster(tmp_path: Path, up) -> None:
    """`train --wait` through the coordinator with every output, a measured comparison with DP, then `jobs` and
    `cancel` on a job submitted without --wait."""
    cluster = Up(tmp_path, "--devices", "3", env={"EDGESWARM_PROFILE_DIR": str(tmp_path / "profiles"),
                                                   "EDGESWARM_CHECKPOINT_DIR": str(tmp_path / "checkpoints")})
    up.append(cluster)
    cluster.status(devices=3)
    (tmp_path / "job.yaml").write_text(JOB)
    out = edgeswarm("train", str(tmp_path / "job.yaml"), "--hub", cluster.url, "--wait", "--json",
                    str(tmp_path / "run.json"), "--loss-png", str(tmp_path / "loss.png"), "--timeline-png",
                    str(tmp_path / "timeline.png"), "--compare", "dp", "--compare-rounds", "2", timeout=300)
    text = out.stdout + out.stderr
    assert "hpp plan" in out.stdout and "final model in the checkpoint store" in out.stdout, text
    assert re.search(r"\n\S*\s*dp\s.*\d+\.\d+x", out.stdout), text  # the measured comparison row
    assert "the last refitted prediction" in out.stdout and "measured / refitted" in out.stdout, text
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["state"]["progress"]["refitted_round_s"] > 0
    assert run["state"]["status"] == "succeeded" and run["state"]["progress"]["checkpoint_version"] == 6
    assert 0.0 <= run["state"]["progress"]["test_accuracy"] <= 1.0
    assert "held-out accuracy of the saved model" in out.stdout
    assert [r["round"] for r in run["rounds"]] == list(range(1, 7))
    assert run["rounds"][-1]["loss"] < run["rounds"][0]["loss"]
    assert {p["strategy"] for p in run["state"]["progress"]["predictions"]} == {"hpp", "dp", "pp", "single"}
    devices = {d for s in run["state"]["plan"]["stages"] for d in s["devices"]}
    assert len(devices) == 3
    saved = list((tmp_path / "checkpoints" / "mlp-teacher").iterdir())
    assert {p.name for p in saved} == {f"stage-{s['index']}" for s in run["state"]["plan"]["stages"]} | {"layout"}
    for png in ("loss.png", "timeline.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"

    # Split learning on a cluster without an edge server fails at once (not after the job's wait), naming the fix.
    (tmp_path / "sf.yaml").write_text("kind: train-splitfed\nname: sf-no-mec\nmodel: {name: lenet5}\n"
                                      "data: {kind: digits}\npartition: {kind: iid, devices: 3}\nparticipants: 2\n"
                                      "wait_s: 600\n")
    # (Had it waited the job's 600 s for one, the command's 300 s timeout would fail the test.)
    failed = edgeswarm("train", str(tmp_path / "sf.yaml"), "--hub", cluster.url, "--wait", check=False, timeout=300)
    assert failed.returncode == 1 and "no mec-manager is online" in failed.stdout + failed.stderr, failed
    assert "--edges 1" in failed.stdout + failed.stderr, failed

    (tmp_path / "long.yaml").write_text(JOB.replace("mlp-teacher", "long").replace("rounds: 6", "rounds: 100000"))
    out = edgeswarm("train", str(tmp_path / "long.yaml"), "--hub", cluster.url)
    assert "job long submitted" in out.stdout

    def status_of(name: str) -> str | None:
        states = json.loads(edgeswarm("jobs", "--hub", cluster.url, "--json").stdout)
        return next((s["status"] for s in states if s["job_id"] == name), None)

    wait_until(lambda: status_of("long") == "running", 120, interval_s=0.5, message="job long running")
    assert "cancelling" in edgeswarm("cancel", "long", "--hub", cluster.url).stdout
    wait_until(lambda: status_of("long") == "cancelled", 60, interval_s=0.5, message="job long cancelled")
    table = edgeswarm("jobs", "--hub", cluster.url).stdout
    assert re.search(r"mlp-teacher\s.*succeeded", table) and re.search(r"mlp-teacher-dp\s.*succeeded", table), table
    again = edgeswarm("cancel", "long", "--hub", cluster.url, check=False)
    assert again.returncode == 1 and "already cancelled" in again.stderr


def test_train_refuses_an_invalid_job_with_the_field(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(JOB.replace("global_batch: 64", "global_batch: 0"))
    out = edgeswarm("train", str(tmp_path / "bad.yaml"), "--hub", "mqtt://127.0.0.1:1", check=False)
    assert out.returncode == 2 and "global_batch" in out.stderr and "greater than or equal to 1" in out.stderr


@pytest.fixture(scope="module")
def bench_profiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One profile cache for the benchmarks on emulated Env D with the same tiny model: only the first profiles its
    devices' compute."""
    return tmp_path_factory.mktemp("bench-profiles")


def test_bench_training_measures_every_strategy(tmp_path: Path, bench_profiles: Path) -> None:
    """`edgeswarm bench training` on emulated Env D with a tiny model: every strategy trains on the stage-workers
    (PP may give a weightless unit a device of its own) and the report has its measured and predicted times."""
    out = edgeswarm("bench", "training", "--envs", "d", "--model", "mlp", "--config", "hidden=32", "--strategies",
                    "hpp,pp", "--rounds", "2", "--global-batch", "32", "--profile-dir", str(bench_profiles),
                    "--out", str(tmp_path / "bench.json"), timeout=300)
    rows = json.loads((tmp_path / "bench.json").read_text())["strategies"]
    assert [(r["env"], r["strategy"], r["error"]) for r in rows] == [("d", "hpp", None), ("d", "pp", None)], out.stdout
    for r in rows:
        assert r["measured_round_s"] > 0 and r["predicted_round_s"] > 0 and r["replayed_round_s"] > 0
        assert r["refitted_round_s"] > 0  # the coordinator's closed loop priced the plan on the measured compute
        assert r["micro_batches"] == 4 and r["overhead_per_micro_batch_s"] >= 0
        assert 0 < r["host_busy"] <= 1  # the host's cores busy over the job, read from /proc/stat
    assert rows[1]["stages"] == 4 and all(w in out.stdout for w in ("predicted", "refitted", "replayed", "host busy"))
    assert "round-time cells: measured / predicted within 15% in " in out.stdout  # the verdict, misses explained


def test_bench_training_misprofiled_starts_a_job_on_wrong_speeds_and_the_loop_measures_them(
        tmp_path: Path, bench_profiles: Path) -> None:
    """`edgeswarm bench training --sections misprofiled`: a first job learns the cluster's speeds, then a job starts
    from speeds saved 3x too fast for the device whose units the correct plan loads most and 5x for one link; the
    closed loop measures that device slower than it was said to be and saves it so. (A model wide enough that
    computing, not the runtime's per-call costs, is most of a micro-batch.)"""
    out = edgeswarm("bench", "training", "--sections", "misprofiled", "--envs", "d", "--model", "mlp", "--config",
                    "hidden=768", "--config", "layers=3", "--global-batch", "32", "--learn-rounds", "4",
                    "--loop-rounds", "6", "--profile-dir", str(bench_profiles), "--out", str(tmp_path / "m.json"),
                    timeout=300)
    report = json.loads((tmp_path / "m.json").read_text())
    assert list(report) == ["misprofiled"], report
    (row,) = report["misprofiled"]
    assert row["error"] is None, out.stdout
    device, link = row["device"], row["link"]
    assert device in {"tx2-0", "nano-0", "nano-1", "nano-2"} and "<->" in link
    learned, wrong = row["learned"], row["started_from"]
    assert wrong[device] == pytest.approx(learned.get(device, 1.0) / 3)
    assert wrong[link] == pytest.approx(learned.get(link, 1.0) / 5)
    assert len(row["rounds_s"]) == 6 and row["correct_layout"] and row["started_layout"] and row["final_layout"]
    # Made 3x faster than measured, the device is given more work, not less: the loop measures it, and what it
    # saves for the next job is slower than the wrong speed it started from.
    seen = {k: row[k] for k in ("learned", "started_from", "saved", "correct_layout", "started_layout", "final_layout",
                                "replans", "rounds_s", "refitted_s")}
    assert row["saved"][device] > 1.2 * wrong[device], json.dumps(seen, indent=1)
    assert "a job started on speeds wrong about one device and one link" in out.stdout


def test_bench_recovery_drops_a_device_and_compares_light_with_heavy(tmp_path: Path, bench_profiles: Path) -> None:
    """`edgeswarm bench recovery` on emulated Env D with a tiny model: the device dies mid-round under each mode,
    the job recovers without it, and the report has the detection, the recovery and the bytes moved."""
    out = edgeswarm("bench", "recovery", "--model", "mlp", "--config", "hidden=32", "--victims", "nano-2",
                    "--rounds", "5", "--profile-dir", str(bench_profiles), "--out", str(tmp_path / "rec.json"),
                    timeout=300)
    rows = json.loads((tmp_path / "rec.json").read_text())
    assert [(r["victim"], r["mode"], r["error"]) for r in rows] == [("nano-2", "light", None),
                                                                     ("nano-2", "heavy", None)], out.stdout
    for r in rows:
        assert "nano-2" in {d for s in r["stages_before"] for d in s}
        assert "nano-2" not in {d for s in r["stages_after"] for d in s}
        assert 0 < r["detection_s"] < 10 and r["recovery_s"] > 0 and r["resume_round"] <= r["interrupted_round"]
    assert rows[1]["gather_s"] > 0 and "heavy / light" in out.stdout


def test_bench_hmp_writes_a_trace_whose_communication_overlaps_the_gemms(tmp_path: Path) -> None:
    """`edgeswarm bench hmp --sections trace`: one Galaxy pass in threads over the in-memory ring at 125 Mbps, written
    as a Chrome trace in which communication spans overlap GEMM spans. (The sections that serve jobs on emulated
    clusters submit, ask and cancel serve-hmp jobs as tests/test_hmp_serving.py does, end to end.)"""
    out = edgeswarm("bench", "hmp", "--sections", "trace", "--trace", str(tmp_path / "t.json"), "--json",
                    str(tmp_path / "hmp.json"), timeout=300)
    report = json.loads((tmp_path / "hmp.json").read_text())
    assert report["trace_overlaps"] > 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["cat"] for e in events} >= {"compute", "comm"}
    assert "perfetto" in out.stdout


def test_bench_llm_splits_a_quantized_file_over_emulated_devices(tmp_path: Path) -> None:
    """`edgeswarm bench llm --sections split,batch`: a one-layer SmolLM2-shaped GGUF file written in Q4_0, split
    over each device set by Galaxy's planner, decoded over the in-memory ring (one stream, then three together);
    every rank holds its share of the file. (The llamacpp section builds llama-cpp-python from source: not in the
    suite.)"""
    out = edgeswarm("bench", "llm", "--model", "smollm2-135m", "--layers", "1", "--quant", "Q4_0", "--sections",
                    "split,batch", "--streams", "3", "--decode", "2", "--out", str(tmp_path), "--json",
                    str(tmp_path / "llm.json"), timeout=300)
    report = json.loads((tmp_path / "llm.json").read_text())
    assert [r["label"] for r in report["split"]] == ["4 Nano", "3 Nano", "mixed"]
    for row in report["split"]:
        assert row["token_s"] > 0 and 0 <= row["network_share"] < 1
        assert all(abs(w / s - 1) <= 0.05 for w, s in zip(row["weight_bytes"], row["share_bytes"], strict=True))
        assert all(c % 32 == 0 for c in row["columns"])
    assert report["batch"]["streams"] == 3 and report["batch"]["many_tps"] > 0 and report["batch"]["one_tps"] > 0
    assert "network" in out.stdout and "3 streams together" in out.stdout and list(tmp_path.glob("*.gguf"))
    bad = edgeswarm("bench", "llm", "--model", "gpt2-tiny", "--out", str(tmp_path), check=False)
    assert bad.returncode == 2 and "not a llama-family preset" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_hmp_refuses_unknown_environments_and_models() -> None:
    result = edgeswarm("bench", "hmp", "--envs", "a,z", "--models", "gpt5", check=False)
    assert result.returncode != 0 and "env z" in result.stderr and "model gpt5" in result.stderr
