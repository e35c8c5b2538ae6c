"""train-splitfed on a real local cluster (three devices, one edge server, every message over Mosquitto): the
command line follows the rounds and the model exports; no label reaches the MEC on the wire (and the vanilla
baseline's do, so the check can fail); an update with NaN values is refused and counted while the job goes on; a
restarted MEC resumes its round from its checkpoint, counted as a recovery; a device killed mid-round is left out and
the round completes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.bus.inbound import RawInbound
from edgeswarm.data import open_dataset
from edgeswarm.evaluation import held_out
from edgeswarm.local.forkserver import ForkServer
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.messages import MetricsReport
from edgeswarm.messages.jobs import JobEvent, JobState
from edgeswarm.models.zoo import build_model
from edgeswarm.observability.catalogue import RECOVERIES
from edgeswarm.planning.splitfed.types import SplitSelection
from edgeswarm.splitfed.spec import SplitfedProgress, SplitfedSpec
from edgeswarm.wire.observe import Observer
from edgeswarm.workloads import parse_spec_text
from edgeswarm.workloads.client import JobFollower, job_states, submit_job
from helpers import FAST_ENV, native_cluster, wait_until

pytestmark = pytest.mark.slow

DEVICES = 3
MEC = "edge-0"


class Cluster:
    def __init__(self, local: LocalCluster, bus: Bus, root: Path) -> None:
        self.local, self.bus, self.root = local, bus, root


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, forks: ForkServer) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("splitfed-cluster")
    env = {**FAST_ENV, "EDGESWARM_CHECKPOINT_DIR": str(root / "checkpoints"),
           "EDGESWARM_PROFILE_DIR": str(root / "profiles")}
    # The dashboard collects the devices' spans for `edgeswarm explain`.
    with native_cluster(DEVICES, root / "cluster", env, "splitfed-test", edges=1, dashboard=True,
                        forks=forks) as (local, bus):
        yield Cluster(local, bus, root)


def spec_text(name: str, **fields: object) -> str:
    spec = {"kind": "train-splitfed", "name": name, "rounds": 2, "participants": 2,
            "partition": {"kind": "dirichlet", "devices": DEVICES, "alpha": 0.5, "seed": 1},
            "training": {"epochs": 2, "batch_size": 32, "lr": 0.05}, "wait_s": 10, "seed": 0,
            # Memory-starved devices: LeNet-5's whole training (3.3 MB) does not fit, only cut 1 (1.5 MB).
            "memory_budget_bytes": 2_000_000, **fields}
    return json.dumps(spec)


def run(cluster: Cluster, text: str, timeout_s: float = 240) -> tuple[JobState, list[JobEvent]]:
    spec = parse_spec_text(text)
    assert isinstance(spec, SplitfedSpec)
    events: list[JobEvent] = []
    follower = JobFollower(cluster.bus, spec.name, on_event=events.append)
    submit_job(cluster.bus, text, submission=follower.submission)
    return follower.wait(timeout_s), events


def test_train_wait_prints_each_round_and_the_trained_model_exports(cluster: Cluster, tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text(spec_text("sf-cli", rounds=3))
    record = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "-m", "edgeswarm", "train", str(path), "--wait", "--hub",
                           cluster.local.hub_url, "--json", str(record)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for r in range(3):
        assert f"round {r}: " in done.stdout, done.stdout
    # --json writes every kind's record: its final state and its progress after each round.
    written = json.loads(record.read_text())
    assert written["state"]["status"] == "succeeded" and written["state"]["kind"] == "train-splitfed"
    assert [r["rounds_done"] for r in written["rounds"]] == [1, 2, 3], written["rounds"]
    assert "accuracy" in done.stdout and "MiB" in done.stdout, done.stdout
    # `edgeswarm explain`: the slowest trained device's planned compute, wait for the MEC (its tensors' transfers and
    # the MEC's half) and the round's other predicted seconds, beside its measured spans (its halves' forward, tail
    # and backward counted as its compute, its waits for the MEC) and what the round measured beyond them.

    def explained() -> dict[str, object] | None:
        result = subprocess.run([sys.executable, "-m", "edgeswarm", "explain", "sf-cli", "--json",
                                 str(tmp_path / "explain.json"), "--hub", cluster.local.hub_url],
                                capture_output=True, text=True, timeout=60)
        data = json.loads((tmp_path / "explain.json").read_text()) if result.returncode == 0 else None
        return data if data is not None and data["units"] else None

    data = wait_until(explained, 30, message="a complete round's spans for edgeswarm explain")
    assert data["unit"] == "round" and data["predicted_s"] and data["reported_s"], data  # type: ignore[index]
    ops = {o["name"]: o for o in data["operations"]}  # type: ignore[index,union-attr]
    assert {"compute", "wait for the MEC", "send", "outside spans"} <= set(ops), ops
    assert all(ops[n]["planned_s"] > 0 and ops[n]["measured_s"] > 0 for n in ("compute", "wait for the MEC")), ops
    assert data["planned_s"] == pytest.approx(data["predicted_s"]), data  # type: ignore[index]
    out = tmp_path / "model.safetensors"
    exported = subprocess.run([sys.executable, "-m", "edgeswarm", "export", "sf-cli", "--out", str(out), "--hub",
                               cluster.local.hub_url], capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    spec = parse_spec_text(path.read_text())
    assert isinstance(spec, SplitfedSpec)
    model = build_model(spec.model)
    state = load_file(str(out))
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state)
    accuracy, _ = held_out(model, open_dataset(spec.data, spec.model))
    final = next(s for s in job_states(cluster.bus) if s.job_id == "sf-cli")
    print(final.progress.model_dump_json())
    progress = final.progress_as(SplitfedProgress)
    assert progress.rounds_done == 3 and len(progress.history) == 3
    assert progress.accuracy == pytest.approx(accuracy, abs=1e-6)
    assert accuracy > 0.3  # digits has 10 classes: three rounds on two devices already learn
    for record in progress.history:
        trained = [p for p in record.participants if p.outcome == "trained"]
        assert len(trained) == 2, record
        assert all(1 <= p.cut < 12 and p.peak_bytes > 0 and p.loss is not None and p.setup_s > 0 for p in trained), \
            record
    # The closed loop corrects the planner's round time from the rounds measured before (round 0, the warm-up, left
    # out): nothing to go on for rounds 0 and 1; round 2 is priced as round 1 went (its gap to the prediction added,
    # or its ratio, had it run faster than predicted).
    first, second, third = progress.history
    assert first.refitted_s is None and second.refitted_s is None, progress.history
    gap = second.round_s - second.predicted_s
    expected = (third.predicted_s + gap if gap >= 0
                else third.predicted_s * max(0.25, second.round_s / second.predicted_s))
    assert third.refitted_s == pytest.approx(expected), progress.history


def test_the_bench_rows_of_a_job_give_each_round_with_the_hosts_load_over_it(cluster: Cluster) -> None:
    """``bench splitfed``'s rows (``job_rows``, also ``bench peers``'): a row per round with its measured and
    predicted time, and how busy the host's cores were over about that round, read from /proc/stat as it ran."""
    from edgeswarm.splitfed.bench_splitfed import job_rows

    rows = job_rows(cluster.bus, json.loads(spec_text("bench-rows", mode="fedavg", memory_budget_bytes=0)),
                    timeout_s=240)
    assert [(r.round, r.error) for r in rows] == [(0, None), (1, None)]
    for r in rows:
        assert r.round_s > 0 and r.predicted_s > 0
        assert r.host_busy is not None and 0 < r.host_busy <= 1


def test_a_device_prepares_for_a_job_before_its_rounds_and_refuses_a_prepare_it_cannot_do(cluster: Cluster) -> None:
    """SplitPrepare: the device trains a throwaway step of the job's model on its partition and answers with a
    round's setup as it timed it; a partition the job does not have is answered with a failure, and the device goes
    on serving. A job prepares its devices before round 0's clock, and says so; its MEC reports the part of each
    round its devices took (``devices_s``, from which the coordinator measures the round's fixed cost)."""
    import edgeswarm.messages as m
    from edgeswarm.messages.splitfed import RoundSetup
    from edgeswarm.runtime.client import ClusterWatcher, nodes_running

    spec = parse_spec_text(spec_text("sf-prepare", rounds=1))
    assert isinstance(spec, SplitfedSpec)
    setup = RoundSetup(model=spec.model, dataset=spec.data, partition=spec.partition, training=spec.local_training())
    view, _ = ClusterWatcher(cluster.bus).wait(settle_s=0.5, devices=DEVICES + 1, timeout_s=30)
    device = sorted(nodes_running(view, "stage-worker"))[0]
    request = topics.request(device, "stage-worker")
    reply = cluster.bus.request(request, m.SplitPrepare(job_id="sf-prepare", index=0, setup=setup), timeout_s=60).body
    assert isinstance(reply, m.SplitPrepared), reply
    assert reply.node == device and reply.job_id == "sf-prepare" and 0 < reply.setup_s < 10, reply
    assert 0 < reply.step_s < 10, reply  # the whole model's local step, timed after the throwaway one
    refused = cluster.bus.request(request, m.SplitPrepare(job_id="sf-prepare", index=DEVICES + 4, setup=setup),
                                  timeout_s=60).body
    assert isinstance(refused, m.StageFailed) and refused.reason == "bad_request", refused
    updates, lock = _mec_traffic(cluster, "hub", "coordinator")
    final, events = run(cluster, spec_text("sf-prepare", rounds=2))
    assert final.status == "succeeded", final.detail
    history = final.progress_as(SplitfedProgress).history
    with lock:
        devices_s = {o.fields["round"]: o.fields["devices_s"] for o in updates  # type: ignore[attr-defined]
                     if o.schema_name == "edgeswarm.splitfed.update" and o.fields.get("job_id") == "sf-prepare"}
    assert sorted(devices_s) == [0, 1], devices_s
    assert all(0 < devices_s[h.round] < h.round_s for h in history), (devices_s, history)
    said = [e.detail for e in events if e.kind == "profiling"]
    assert any(d.startswith("round 0: preparing ") for d in said), said
    assert any(" devices prepared; a round's setup takes them " in d for d in said), said


def _mec_traffic(cluster: Cluster, node: str = MEC, service: str = "mec-manager") -> tuple[list[object],
                                                                                        threading.Lock]:
    seen: list[object] = []
    lock = threading.Lock()
    observer = Observer()

    def on_raw(raw: RawInbound) -> None:
        obs = observer.observe(raw.topic, raw.payload, raw.retained)
        if obs is not None:
            with lock:
                seen.append(obs)

    cluster.bus.subscribe_raw(f"edgeswarm/node/{node}/{service}/data/+", on_raw, plane="data")
    return seen, lock


def test_the_central_manager_plans_on_speeds_and_links_the_nodes_profilers_measured(cluster: Cluster) -> None:
    """What a round's selection is planned on comes from each node's profiler (its units timed at the job's batch
    size, each device's link to its MEC probed), never from a device's class: only the links a round needs."""
    import math

    from edgeswarm.runtime.client import ClusterWatcher, nodes_running
    from edgeswarm.splitfed import gather
    from edgeswarm.splitfed.profiling import model_cost

    spec = parse_spec_text(spec_text("sf-measure"))
    assert isinstance(spec, SplitfedSpec)
    cost = model_cost(spec.model, spec.training.batch_size)
    view, _ = ClusterWatcher(cluster.bus).wait(settle_s=0.5, devices=DEVICES + 1, timeout_s=30)
    devices = nodes_running(view, "stage-worker")
    mec_of = gather.assign_mecs(devices, [MEC])
    measured = gather.Measured()
    nodes, pairs = measured.missing(devices, [MEC], mec_of)
    gather.measure(cluster.bus, spec.model, cost, measured, nodes, pairs, timeout_s=120)
    assert sorted(measured.speeds) == sorted([*devices, MEC])
    assert all(0 < s < math.inf for s in measured.speeds.values()), measured.speeds
    assert sorted(measured.links) == sorted((d, MEC) for d in devices), measured.links
    assert all(0 < x.bandwidth_bps < math.inf and 0 < x.per_message_s < 1 for x in measured.links.values()), \
        measured.links
    assert measured.missing(devices, [MEC], mec_of) == ([], [])
    planned = gather.split_devices(view, devices, mec_of, {}, {}, measured, 0)
    assert [(d.speed_flops, d.link_bytes_s, d.link_message_s) for d in planned] == [
        (measured.speeds[d], measured.links[(d, MEC)].bandwidth_bps, measured.links[(d, MEC)].per_message_s)
        for d in devices]


def test_no_label_reaches_the_mec_on_the_wire_and_the_vanilla_baseline_would_show_it(cluster: Cluster) -> None:
    seen, lock = _mec_traffic(cluster)
    final, _ = run(cluster, spec_text("sf-labels", rounds=1))
    assert final.status == "succeeded", final.detail
    with lock:
        usplit = [o for o in seen if o.fields.get("job_id") == "sf-labels"]  # type: ignore[attr-defined]
    activations = [o for o in usplit if o.schema_name == "edgeswarm.splitfed.tensor"]  # type: ignore[attr-defined]
    assert activations, "no activation reached the MEC"
    for o in usplit:
        assert o.fields.get("labels") is None, o  # type: ignore[attr-defined]
        if o.tensor is not None:  # type: ignore[attr-defined]
            assert o.tensor.dtype.startswith("float"), o  # type: ignore[attr-defined]  labels are int64
    final, _ = run(cluster, spec_text("sf-vanilla", rounds=1, mode="splitfed", memory_budget_bytes=0))
    assert final.status == "succeeded", final.detail
    with lock:
        vanilla = [o for o in seen if o.fields.get("job_id") == "sf-vanilla"  # type: ignore[attr-defined]
                   and o.schema_name == "edgeswarm.splitfed.tensor"]  # type: ignore[attr-defined]
    assert any(o.fields.get("labels") for o in vanilla)  # type: ignore[attr-defined]


def test_updates_with_nan_values_are_refused_and_counted_and_the_job_goes_on(cluster: Cluster) -> None:
    # Weight decay of lr x wd = 10 multiplies every weight by -9 a step: within a round the devices' weights overflow,
    # so their updates hold NaN or infinite values.
    final, _ = run(cluster, spec_text("sf-nan", rounds=2, training={"epochs": 2, "batch_size": 32, "lr": 10.0,
                                                                    "weight_decay": 1.0}))
    assert final.status == "succeeded", final.detail
    progress = final.progress_as(SplitfedProgress)
    assert progress.rounds_done == 2
    assert progress.refused >= 1
    refused = [p for r in progress.history for p in r.participants if p.outcome == "refused"]
    assert refused and all(r.refused >= 0 for r in progress.history)


def _mec_checkpoint(cluster: Cluster, job: str) -> dict[str, object]:
    path = cluster.root / "checkpoints" / "mec" / MEC / job / "round.json"
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


def test_a_restarted_mec_resumes_its_round_from_its_checkpoint(cluster: Cluster) -> None:
    # Dirichlet(0.1) with seed 7 leaves the three devices 769, 181 and 488 samples: any two differ by 1.6x or
    # more, so one finishes well before the other.
    # wait_s: the devices wait for the restarted MEC, which imports torch again (over 10 s on a loaded CI machine).
    text = spec_text("sf-mec", rounds=2, gamma=1.0, partition={"kind": "dirichlet", "devices": DEVICES,
                                                                "alpha": 0.1, "seed": 7},
                     training={"epochs": 3, "batch_size": 16}, wait_s=45)
    events: list[JobEvent] = []
    follower = JobFollower(cluster.bus, "sf-mec", on_event=events.append)
    submit_job(cluster.bus, text, submission=follower.submission)

    def one_finished() -> bool:
        meta = _mec_checkpoint(cluster, "sf-mec")
        return meta.get("round") == 0 and any(r["outcome"] == "trained" for r in meta.get("reports", []))

    wait_until(one_finished, 180, interval_s=0.02, message="the MEC's first finished device of round 0")
    # Frozen at once, so it dies mid-round: a moment later it could have taken the other report too, and then
    # nothing would be left to resume.
    mec = next(c for c in reversed(cluster.local.children) if (c.node, c.service) == (MEC, "mec-manager"))
    mec.process.send_signal(signal.SIGSTOP)
    reports = _mec_checkpoint(cluster, "sf-mec").get("reports", [])
    mec.process.kill()
    mec.process.wait(10)
    cluster.local.restart(MEC, "mec-manager")
    assert sum(r["outcome"] == "trained" for r in reports) == 1, reports  # one participant of two
    final = follower.wait(300)
    assert final.status == "succeeded", final.detail
    assert any(e.kind == "mec_restarted" for e in events), [e.kind for e in events]
    first = final.progress_as(SplitfedProgress).history[0]
    assert sorted(p.outcome for p in first.participants if p.outcome != "skipped") == ["trained", "trained"], first
    log = next(c for c in reversed(cluster.local.children) if (c.node, c.service) == (MEC, "mec-manager")).log_path
    assert "already finished" in log.read_text()
    # The restart counts as a recovery, as every coordinator program's does (edgeswarm_recoveries_total).
    counted: list[int] = []

    def on_report(msg: Inbound) -> None:
        assert isinstance(msg.body, MetricsReport)
        counters = msg.body.counters
        counted.append(sum(v for k, v in counters.items() if k.startswith(RECOVERIES) and k.endswith(".sf-mec")))

    cluster.bus.subscribe(topics.metrics("+", "coordinator"), on_report, schemas=(MetricsReport,), qos=0)
    wait_until(lambda: counted and counted[-1] >= 1, 10, message="a recovery of sf-mec in the coordinator's metrics")


# The SplitFed baseline's fixed cut: the devices exchange every step's tensors with the MEC, whose wait for the next
# one ends when they stop. FedAvg: each device trains alone and sends nothing until its round's end, so the MEC
# learns of its death from its stage-worker's Last Will (its epochs long enough to be killed while training).
@pytest.mark.parametrize(("mode", "epochs"), [("splitfed", 4), ("fedavg", 20)])
def test_a_device_killed_mid_round_is_left_out_and_the_round_completes(cluster: Cluster, mode: str,
                                                                       epochs: int) -> None:
    name = f"sf-kill-{mode}"
    text = spec_text(name, rounds=1, mode=mode, wait_s=4, training={"epochs": epochs, "batch_size": 8},
                     memory_budget_bytes=0)
    events: list[JobEvent] = []
    follower = JobFollower(cluster.bus, name, on_event=events.append)
    submit_job(cluster.bus, text, submission=follower.submission)
    # The event and the state that carries the plan come on different topics, handled on different threads:
    # wait for both.
    wait_until(lambda: any(e.kind == "round_started" for e in events) and follower.state is not None
               and isinstance(follower.state.plan, SplitSelection), 120, message="round 0 started")
    state = follower.state
    assert state is not None and isinstance(state.plan, SplitSelection)
    node = state.plan.selected[0].node
    time.sleep(1.0)  # mid-round: the devices are training
    victim = next(c for c in cluster.local.children if (c.node, c.service) == (node, "stage-worker") and c.alive())
    victim.process.kill()
    victim.process.wait(10)
    try:
        final = follower.wait(300)
    finally:
        cluster.local.restart(node, "stage-worker")
    assert final.status == "succeeded", final.detail
    first = final.progress_as(SplitfedProgress).history[0]
    # Noticed as soon as the device stopped, not when the round's bound (``wait_s`` per local step) ran out.
    assert first.round_s < 60, first
    outcomes = {p.node: p.outcome for p in first.participants}
    assert outcomes[node] in ("lost", "failed"), outcomes
    assert sum(o == "trained" for o in outcomes.values()) == 1, outcomes
    assert first.accuracy is not None

