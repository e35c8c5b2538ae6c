"""SmartSplit's closed loop: each trained device reports the seconds its own computes took, the coordinator sets them
against what the device's profiled speed predicts for its cut and iterations, and the next rounds' central manager
plans on the measured speed of a device that runs slower than its profiler measured it (here 4x: its stage-worker
computes at four times its profiler's emulated slow-down). Its first rounds plan on the step it timed as it prepared
for the job, later ones on what two rounds measured, each saying so in a ``refit`` event; the job saves it, and the
next job's first round is planned on it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from edgeswarm.messages.jobs import JobEvent
from edgeswarm.planning.splitfed.cost import cost_table, cut_costs, device_compute_s, iterations
from edgeswarm.planning.splitfed.types import SplitDevice, SplitMec, SplitOptions
from edgeswarm.splitfed.profiling import model_cost
from edgeswarm.splitfed.spec import SplitfedProgress
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.workloads.client import JobFollower, JobRequestError, submit_job
from helpers import wait_for_event, wait_for_peers, wait_until

NODES = ("a", "b", "c")
MEC = "edge-0"
SLOW = "b"
SLOWDOWN = 8.0


def test_a_devices_compute_is_what_the_cost_table_prices_for_its_cut() -> None:
    cost = model_cost(ModelSpec(name="lenet5"), 32, optimizer_states=1)
    options = SplitOptions(participants=1, epochs=2)
    device = SplitDevice(node="d", mec="m", speed_flops=2e9, link_bytes_s=1e12, budget_bytes=1 << 40, samples=100)
    fast = SplitDevice(**{**device.model_dump(), "node": "e", "speed_flops": 4e9})
    table = cost_table(cost, [device, fast], [SplitMec(node="m", speed_flops=1e15)], options)
    costs, its = cut_costs(cost, options), iterations(100, 32, 2)
    for cut in range(1, costs.cuts + 1):
        seconds = device_compute_s(costs, cut, its, device.speed_flops)
        # The rest of a cut's fixed time is its transfers and weight sync, the same at any speed.
        assert table.fixed_s[0, cut - 1] - table.fixed_s[1, cut - 1] == pytest.approx(seconds / 2)
        assert device_compute_s(costs, cut, its, fast.speed_flops) == pytest.approx(seconds / 2)


def test_a_device_slower_than_its_profile_is_planned_on_its_measured_speed(broker, make_bus, services,
                                                                          tmp_path: Path) -> None:
    env = {"EDGESWARM_CHECKPOINT_DIR": str(tmp_path / "checkpoints")}
    services.start("planner", "hub", broker.url)
    services.start("coordinator", "hub", broker.url, EDGESWARM_REBALANCE="true",
                   EDGESWARM_PROFILE_DIR=str(tmp_path / "profiles-hub"), **env)
    services.start("checkpoint-store", "hub", broker.url, **env)
    for node in (*NODES, MEC):
        profiles = str(tmp_path / f"profiles-{node}")
        services.start("node-agent", node, broker.url)
        services.start("profiler", node, broker.url, EDGESWARM_COMPUTE_SLOWDOWN=str(SLOWDOWN),
                       EDGESWARM_PROFILE_DIR=profiles)
        if node == MEC:
            services.start("mec-manager", node, broker.url, **env)
        else:
            services.start("stage-worker", node, broker.url, EDGESWARM_PROFILE_DIR=profiles,
                           EDGESWARM_COMPUTE_SLOWDOWN=str(SLOWDOWN * (4 if node == SLOW else 1)))
    bus = make_bus("test", "cli")
    wait_for_peers(bus, NODES, ("node-agent", "profiler", "stage-worker"))
    wait_for_peers(bus, [MEC], ("node-agent", "profiler", "mec-manager"), hub_services=("checkpoint-store",))
    events: list[JobEvent] = []
    name = "sf-refit"
    follower = JobFollower(bus, name, on_event=events.append)
    # A third of the digits: rounds of seconds, each device's compute still many steps long.
    spec = {"kind": "train-splitfed", "name": name, "mode": "fedavg", "rounds": 3, "participants": 3,
            "data": {"kind": "digits", "size": 480, "test_size": 120},
            "partition": {"kind": "iid", "devices": 3, "seed": 1},
            "training": {"epochs": 1, "batch_size": 32, "lr": 0.05}, "wait_s": 30, "seed": 0}
    # The coordinator counts the stage-workers it sees online; on a loaded machine its view may lag this bus's.
    def submitted() -> bool:
        try:
            submit_job(bus, json.dumps(spec), submission=follower.submission)
        except JobRequestError as exc:
            if "stage-workers are online" not in str(exc):
                raise
            return False
        return True

    wait_until(submitted, 60, interval_s=1.0, message="the coordinator to count the three stage-workers online")
    final = follower.wait(300)
    assert final.status == "succeeded", (final.status, final.detail, [(e.kind, e.detail) for e in events])
    history = final.progress_as(SplitfedProgress).history
    assert len(history) == 3
    # Every device that trained said what its computes took, over the iterations it ran.
    trained = [p for p in history[0].participants if p.outcome == "trained"]
    assert {p.node for p in trained} == set(NODES)
    assert all(p.compute_s > 0 and p.iterations > 0 for p in trained), trained
    refits = [e.detail for e in events if e.kind == "refit"]
    # Before round 0: each device's step as it prepared, over its profile. The slow one's is about 4x the others'.
    assert refits and refits[0].startswith("starts from the steps the devices timed as they prepared: "), refits
    first = scales_in(refits[0])
    assert first[SLOW] > 2.0 * max(v for k, v in first.items() if k != SLOW), refits
    # The rounds were planned on it from round 0: the closed loop, measuring compute over that, never moved the
    # slow device by anything like 4x.
    moved = [scales_in(r) for r in refits if r.startswith("round ")]
    assert all(m.get(SLOW, 1.0) < 2.0 for m in moved), refits
    # Stopped, the job saved what it measured; the next job's first round is planned on it.
    saved = scales_in(wait_for_event(events, "refit", "saved the measured speeds").split(" (", 1)[0])
    assert saved[SLOW] > 2.0 * max(v for k, v in saved.items() if k != SLOW), refits
    events.clear()
    nxt = JobFollower(bus, "sf-next", on_event=events.append)
    submit_job(bus, json.dumps({**spec, "name": "sf-next", "rounds": 1}), submission=nxt.submission)
    final = nxt.wait(300)
    assert final.status == "succeeded", (final.status, final.detail, [(e.kind, e.detail) for e in events])
    assert any(e.kind == "refit" and e.detail.startswith("starts from the speeds earlier jobs measured: ")
               and f"{SLOW} " in e.detail for e in events), [(e.kind, e.detail) for e in events]
    # Planned on what the first job measured of the slow device, as that job's first round was on its prepared step:
    # the two agree.
    again = final.progress_as(SplitfedProgress).history[0]
    assert 0.67 < again.predicted_s / history[0].predicted_s < 1.5, (again.predicted_s, history[0].predicted_s)


def scales_in(said: str) -> dict[str, float]:
    """The "node 1.23x" pairs of a refit event's text."""
    return {node: float(x) for node, x in re.findall(r"(\S+) (\d+\.\d+)x", said)}


def test_a_rounds_fixed_costs_are_priced_from_what_was_measured_before_it() -> None:
    """A device's setup: its own later rounds', else what it timed when it prepared, else (not prepared, not trained
    yet) the job's first rounds'; the round's own: the rounds measured, else three request round trips as the
    profilers measured them."""
    from edgeswarm.splitfed.coordinator import CONTROL_REQUESTS, fixed_price, setup_prices
    from edgeswarm.values.profiles import LinkProfile

    own = {"trained": [0.02, 0.03, 0.5], "once": []}  # "once": trained in one round only, its first (left out)
    prepared = {"trained": 0.2, "once": 0.012, "new": 0.015, "silent": None}
    prices = setup_prices(["trained", "once", "new", "silent", "stranger"], own, prepared, [0.04, 0.06])
    assert prices == {"trained": 0.03, "once": 0.012, "new": 0.015, "silent": 0.05, "stranger": 0.05}
    assert setup_prices(["silent"], {}, prepared, []) == {}

    links = [LinkProfile(src=f"d{i}", dst="mec", bandwidth_bps=1e6, request_s=r) for i, r in
             enumerate((0.004, 0.006, 0.5, 0.0))]  # one timed on a busy host, one never timed
    assert fixed_price([], links) == pytest.approx(CONTROL_REQUESTS * 0.006)
    assert fixed_price([0.02, 0.016, 0.9], links) == pytest.approx(0.02)
    assert fixed_price([], []) == 0.0


def test_a_devices_first_rounds_plan_on_the_step_it_timed_as_it_prepared() -> None:
    """The step a device timed as it prepared (the whole model's local iteration: forward, backward, loss and the
    optimizer's step) over what its profiled speed prices the same iteration at: the scale its first rounds plan on.
    A device with no speed or no step has none; a step far off its profile is clipped to the closed loop's bounds."""
    from edgeswarm.splitfed.coordinator import step_scales
    from edgeswarm.values.profiles import MAX_SCALE

    speeds = {"a": 2e9, "b": 1e9, "c": 1e9}
    scales = step_scales({"a": 0.015, "b": 0.02, "c": 500.0, "mute": 0.01, "none": 0.0}, speeds, 2e7)
    assert scales == pytest.approx({"a": 1.5, "b": 1.0, "c": MAX_SCALE})
