"""The node's memory ledger (``runtime.ledger``): reservations against the device's budget, shared by every program
and process of a node; idle training jobs give way; a dead holder's reservations go. Then over the real Mosquitto: a
training stage and a serving stage on one device's budget see each other, and status shows what is reserved."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgeswarm.errors import MemoryBudgetError
from edgeswarm.runtime.ledger import MIB, MemoryLedger, ledger_path, read_reserved
from helpers import ask_stage_workers, wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_reserve_refuse_naming_the_holder_and_release(tmp_path: Path) -> None:
    ledger = MemoryLedger("n0", 10 * MIB, tmp_path / "l.json")
    ledger.reserve("training", "t1", 6 * MIB, what="training job t1 (stage 0)")
    assert ledger.held_by("training", "t1") == 6 * MIB
    assert ledger.reserved_bytes() == 6 * MIB
    with pytest.raises(MemoryBudgetError, match=r"serving job s1 needs 5.0 MiB, but 6.0 MiB of the memory budget of "
                                                r"10.0 MiB on n0 are held .*training job t1 \(stage 0\) holds 6.0 MiB"):
        ledger.reserve("serving", "s1", 5 * MIB, what="serving job s1")
    assert ledger.held_by("serving", "s1") == 0
    ledger.reserve("serving", "s1", 4 * MIB, what="serving job s1")  # fits beside
    ledger.release("training", "t1")
    assert ledger.reserved_bytes() == 4 * MIB
    ledger.reserve("training", "t1", 6 * MIB, what="training job t1")  # again, now that it fits
    # A job's new reservation replaces its old one rather than adding to it.
    ledger.reserve("training", "t1", 5 * MIB, what="training job t1")
    assert ledger.reserved_bytes() == 9 * MIB
    assert ledger.grow("training", "t1", 6 * MIB) and not ledger.grow("training", "t1", 7 * MIB)
    assert ledger.reserved_bytes(exclude=("training", "t1")) == 4 * MIB
    ledger.close()
    assert read_reserved(tmp_path / "l.json")[0] == 0


def test_a_jobs_parts_are_held_and_given_back_one_by_one_or_with_the_job(tmp_path: Path) -> None:
    """Serving's per-request KV caches: parts of the job's holding, each reserved and released alone; the job's
    release (or the program's close) gives them all back; another process sees them as holdings of their own."""
    ledger = MemoryLedger("n0", 10 * MIB, tmp_path / "l.json")
    ledger.reserve("hmp", "s1", 4 * MIB, what="rank 0 of serving job s1")
    ledger.reserve("hmp", "s1", 2 * MIB, part="request 1", what="the KV cache of request 1")
    ledger.reserve("hmp", "s1", 3 * MIB, part="request 2", what="the KV cache of request 2")
    assert ledger.held_by("hmp", "s1") == 4 * MIB and ledger.reserved_bytes() == 9 * MIB
    with pytest.raises(MemoryBudgetError, match=r"the KV cache of request 3 needs 2.0 MiB.*the KV cache of request 2 "
                                                r"holds 3.0 MiB"):
        ledger.reserve("hmp", "s1", 2 * MIB, part="request 3", what="the KV cache of request 3")
    total, holdings = read_reserved(tmp_path / "l.json")
    assert total == 9 * MIB and sorted(h.part for h in holdings) == ["", "request 1", "request 2"]
    ledger.release("hmp", "s1", "request 2")
    ledger.reserve("hmp", "s1", 2 * MIB, part="request 3", what="the KV cache of request 3")  # fits now
    assert ledger.reserved_bytes(exclude=("hmp", "s1")) == 0 and ledger.reserved_bytes() == 8 * MIB
    ledger.release("hmp", "s1")
    assert read_reserved(tmp_path / "l.json")[0] == 0
    ledger.close()


def test_idle_jobs_give_way_through_the_pressure_hook_and_busy_ones_do_not(tmp_path: Path) -> None:
    ledger = MemoryLedger("n0", 10 * MIB, tmp_path / "l.json")
    idle = {"t1": True, "t2": False}  # t2 is in a round
    asked: list[tuple[int, str, str | None]] = []

    def give_way(need: int, why: str, keep: str | None) -> int:
        asked.append((need, why, keep))
        freed = 0
        for job in [j for j, free in idle.items() if free and j != keep]:
            freed += ledger.held_by("training", job)
            ledger.release("training", job)
            del idle[job]
        return freed

    ledger.on_pressure("training", give_way)
    ledger.reserve("training", "t1", 4 * MIB, what="training job t1")
    ledger.reserve("training", "t2", 4 * MIB, what="training job t2")
    ledger.reserve("serving", "s1", 5 * MIB, what="serving job s1")  # t1 gives way
    assert asked == [(3 * MIB, "serving job s1 needs the memory", None)]
    assert ledger.held_by("training", "t1") == 0 and ledger.reserved_bytes() == 9 * MIB
    # t2 is busy and serving has no hook: nothing gives way, and the refusal names both.
    with pytest.raises(MemoryBudgetError, match=r"serving job s1 holds 5.0 MiB; training job t2 holds 4.0 MiB"):
        ledger.reserve("training", "t3", 2 * MIB, what="training job t3")
    assert asked[-1][2] == "t3"  # the job asking is never asked to give way to itself
    # A holding that must grow (a round's activations) makes idle jobs give way too: the idle stages of finished
    # jobs, which stay held until then, must not leave a new job's round short.
    idle["t2"] = True
    ledger.reserve("training", "t3", 1 * MIB, what="training job t3")  # fits beside s1 and t2 exactly
    assert ledger.grow("training", "t3", 3 * MIB)
    assert asked[-1] == (2 * MIB, "training job t3 needs the memory", "t3")
    assert ledger.held_by("training", "t2") == 0 and ledger.reserved_bytes() == 8 * MIB
    assert not ledger.grow("training", "t3", 6 * MIB)  # nothing idle is left, and t3 never gives way to itself
    assert ledger.held_by("training", "t3") == 3 * MIB


def test_processes_of_one_node_share_the_ledger_and_a_dead_holders_reservations_go(tmp_path: Path) -> None:
    path, clock = tmp_path / "l.json", Clock()
    worker = MemoryLedger("n0", 10 * MIB, path, clock=clock, lease_s=30)
    other = MemoryLedger("n0", 10 * MIB, path, clock=clock, lease_s=30)  # as another process of the node
    worker.reserve("training", "t1", 7 * MIB, what="training job t1")
    with pytest.raises(MemoryBudgetError, match="training job t1 holds 7.0 MiB"):
        other.reserve("serving", "s1", 4 * MIB, what="serving job s1")
    # The holder stops renewing (it hangs, or its host is out of reach): its lease runs out and its holding goes.
    clock.now += 31
    other.reserve("serving", "s1", 4 * MIB, what="serving job s1")
    assert [h.job_id for h in other.holdings()] == ["s1"]

    # A holder process of this host that died goes at once, lease or not.
    script = ("import sys; from pathlib import Path; from edgeswarm.runtime.ledger import MemoryLedger, MIB; "
              "MemoryLedger('n0', 10 * MIB, Path(sys.argv[1])).reserve('training', 't9', 5 * MIB, what='t9')")
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=60)
    other.release("serving", "s1")
    assert read_reserved(path) == (0, [])


def test_the_ledger_file_is_per_node_and_hub(tmp_path: Path) -> None:
    a = ledger_path(tmp_path, "n0", "mqtt://127.0.0.1:1883")
    assert a != ledger_path(tmp_path, "n0", "mqtt://127.0.0.1:1884") != ledger_path(tmp_path, "n1", "mqtt://x:1")
    assert a.parent == tmp_path and "n0" in a.name


# --- over the real Mosquitto ---------------------------------------------------------------------------


def test_serving_and_training_on_one_device_see_each_other_and_status_shows_it(broker, make_bus, services,
                                                                                tmp_path: Path) -> None:
    """One device, L0, with a budget too small for a training stage and a serving stage together: the serving
    assignment makes the idle training job give way; a training job that comes after is refused, naming the serving
    job; the node's status (the node-agent's, as `edgeswarm status` shows it) carries what is reserved."""
    from edgeswarm.cli.status import status_table
    from edgeswarm.hpp.driver import JobDriver, JobError
    from edgeswarm.messages.serving import ServeAssign, ServeReady, ServeRelease
    from edgeswarm.models.footprint import stage_footprint
    from edgeswarm.runtime.client import ClusterWatcher
    from test_stage_worker import MLP, _job, _pipeline_plan

    cut = 3
    plan = _pipeline_plan(["L0", "L1"], cut)
    train_static = stage_footprint(MLP, 0, cut).static_bytes("sgd")
    serve = stage_footprint(MLP, 0, cut)
    serve_static = serve.weights_bytes + serve.buffers_bytes
    budget = train_static + serve_static - 1  # either alone fits; not both
    env = {"EDGESWARM_MEMORY_BUDGET_BYTES": str(budget), "EDGESWARM_HEARTBEAT_INTERVAL_S": "0.5",
           "EDGESWARM_HEALTH_DIR": str(tmp_path / "health")}
    worker = services.start("stage-worker", "L0", broker.url, **env)
    services.start("node-agent", "L0", broker.url, **env)
    services.start("stage-worker", "L1", broker.url)
    client = make_bus("coordinator-test", "cli")
    for node in ("L0", "L1"):
        client.peers.wait_for(node, "stage-worker", timeout_s=30)
    watcher = ClusterWatcher(client)

    def reserved() -> int:
        node = watcher.view()[0].node("L0")
        return -1 if node is None else node.reserved_memory_bytes

    JobDriver(client, _job("train1"), plan, loss_terms=64).deploy()
    assert wait_until(lambda: reserved() == train_static, 20), reserved()

    assign = ServeAssign(job_id="serve1", epoch=0, stage=0, model=MLP, start=0, end=cut, devices=["L0"],
                         coordinator="coordinator-test", micro_batch_size=4)
    reply = ask_stage_workers(client, {"L0": assign}, 60)["L0"]
    assert reply is not None and isinstance(reply.body, ServeReady), reply and reply.body
    assert wait_until(lambda: "dropped the stage of job train1" in services.log_of(worker), 10)
    assert "serving job serve1" in services.log_of(worker)
    assert wait_until(lambda: reserved() == serve_static, 20), reserved()
    view, source = watcher.view()
    assert view.node("L0").reserved_memory_bytes == serve_static  # type: ignore[union-attr]
    assert "reserved / used / budget" in str(status_table(view, source, broker.url).columns[6].header)
    assert '"reserved_memory_bytes"' in view.model_dump_json()

    # Serving gives nothing way: a training job that would not fit beside it is refused, naming it.
    with pytest.raises(JobError, match=r"L0 failed \(memory\): stage 0 \(units \[0, \d+\)\) needs [\d.]+ MiB, but "
                                       r".*serving job serve1 \(stage 0, units \[0, \d+\)\) holds"):
        JobDriver(client, _job("train2"), plan, loss_terms=64).deploy()

    client.publish(topics_request("L0"), ServeRelease(job_id="serve1"))
    assert wait_until(lambda: reserved() == 0, 20), reserved()
    time.sleep(0.1)
    JobDriver(client, _job("train3"), plan, loss_terms=64).deploy()  # the room is back
    assert wait_until(lambda: reserved() == train_static, 20), reserved()


def test_a_rounds_activations_make_a_finished_jobs_idle_stage_give_way(broker, make_bus, services,
                                                                       tmp_path: Path) -> None:
    """A training stage stays held, idle, after its job ends, until the room is needed. Here a new job's stage fits
    beside the finished job's, but its round's activations do not: the idle stage gives way and the round runs,
    rather than failing for memory (as a netns cluster's last test did, beside seven earlier tests' idle stages).
    The room is shaped by a holding of this test's own process in the node's ledger, as another service's would."""
    from edgeswarm.hpp.driver import JobDriver
    from edgeswarm.models.footprint import stage_footprint
    from test_stage_worker import MLP, _job, _pipeline_plan

    cut, budget = 3, 256 * MIB
    plan = _pipeline_plan(["L0", "L1"], cut)
    static = stage_footprint(MLP, 0, cut).static_bytes("sgd")
    env = {"EDGESWARM_MEMORY_BUDGET_BYTES": str(budget), "EDGESWARM_HEALTH_DIR": str(tmp_path / "health")}
    worker = services.start("stage-worker", "L0", broker.url, **env)
    services.start("stage-worker", "L1", broker.url)
    client = make_bus("coordinator-test", "cli")
    for node in ("L0", "L1"):
        client.peers.wait_for(node, "stage-worker", timeout_s=30)
    path = ledger_path(tmp_path / "health", "L0", broker.url)

    first = JobDriver(client, _job("done1"), plan, loss_terms=64)
    first.deploy()
    first.run_round(0)
    peak = read_reserved(path)[0]  # the finished job's stage: its static bytes and its round's activations
    assert peak > static, (peak, static)
    filler = MemoryLedger("L0", budget, path)
    try:
        # Leaves room for the new job's static bytes and half its activations beside the idle stage.
        filler.reserve("other", "x", budget - peak - static - (peak - static) // 2, what="another service's job")
        second = JobDriver(client, _job("new2"), plan, loss_terms=64)
        second.deploy()
        report = second.run_round(0)
    finally:
        filler.close()
    assert report.loss == report.loss
    log_text = services.log_of(worker)
    assert "dropped the stage of job done1" in log_text and "training job new2 needs the memory" in log_text, log_text


def topics_request(node: str) -> str:
    from edgeswarm import topics

    return topics.request(node, "stage-worker")
