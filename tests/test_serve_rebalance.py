"""Pipelined serving's closed loop on real stage-workers: a stream served on a plan made from profiles that are wrong
about one device (its stage-worker computes 8x slower than its profiler measured) refits that device's speed from
the stages' measured forwards, re-plans itself between two items and goes on: every request is answered once, with
the outputs of the model run in one process. What it measured is saved when it stops, and the next serving job on
the same devices starts from it."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from edgeswarm.bus import Bus
from edgeswarm.messages.jobs import JobEvent
from edgeswarm.models.zoo import build_model, example_input
from edgeswarm.pipeline_serve.client import infer_stream
from edgeswarm.pipeline_serve.spec import ServeProgress
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.profiling.gather import profile_cluster
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.workloads.client import JobFollower, cancel_job, submit_job
from helpers import wait_for_event, wait_for_peers, wait_serving, wait_until

NODES = ("a", "b", "c")
# Every device's profiler and stage-worker: computing, not messaging, is most of an item's time. 30x rather than 10x:
# an emulated device's wall time is its CPU time times the slow-down only while its thread gets a 30th of a core,
# and at 10x a CI machine busy with another test file's cluster made devices look slower than profiled at random.
SLOWDOWN = 30.0
# Units of milliseconds each: the runtime's per-item costs (and a busy host's scheduling) are a small part of them.
# Three equal layers (and a head of 10 outputs) on three devices: the one best plan gives each device a layer. With
# uneven layers (a first layer 3x the others) a plan that leaves a device only the head ties with it; a device
# slower than profiled on the head alone slows nothing down, and the test waited for a re-plan that had no cause.
MODEL = {"name": "mlp", "config": {"in_channels": 1, "image_size": 32, "hidden": 1024, "layers": 3, "seed": 1}}
MICRO_BATCH = 32
A_MOVED = re.compile(r"compute measured against the profile: [^;]*\ba \d+\.\d+x")


def start_cluster(broker, make_bus, services, tmp_path: Path,  # type: ignore[no-untyped-def]
                  profiler: Callable[[str], dict[str, str]], worker: Callable[[str], dict[str, str]]) -> Bus:
    """A planner and a re-balancing coordinator (its profile cache in tmp_path/profiles-hub) on the hub, and a
    node-agent, a profiler (its environment ``profiler(node)``) and a stage-worker (``worker(node)``) on each of
    NODES; a client bus once every one is up.

    The profilers share one cache, filled by profiling MODEL on b before any job: every device's compute profile is
    then that one measurement, and the first plan is the one equal devices get. Measured by each profiler at once,
    a busy machine made one device look twice as slow as the others now and then: the plan left it only the head,
    too small a share for its speed to be measured, and the test waited for a re-plan that had no cause (and the
    link test's probes answered late beside the compute profiling)."""
    services.start("planner", "hub", broker.url)
    services.start("coordinator", "hub", broker.url, EDGESWARM_REBALANCE="true",
                   EDGESWARM_PROFILE_DIR=str(tmp_path / "profiles-hub"))
    for node in NODES:
        services.start("node-agent", node, broker.url)
        services.start("profiler", node, broker.url, EDGESWARM_PROFILE_DIR=str(tmp_path / "profiles-devices"),
                       **profiler(node))
        services.start("stage-worker", node, broker.url, EDGESWARM_PROFILE_DIR=str(tmp_path / f"profiles-{node}"),
                       **worker(node))
    bus = make_bus("test", "cli")
    wait_for_peers(bus, NODES, ("node-agent", "profiler", "stage-worker"))
    profile_cluster(bus, ModelSpec.model_validate(MODEL), [MICRO_BATCH], nodes=[NODES[1]], links=False,
                    timeout_s=120)
    return bus


def test_a_stage_device_slower_than_its_profile_is_refitted_and_the_stream_moves_off_it(
        broker, make_bus, services, tmp_path: Path) -> None:
    saved = tmp_path / "profiles-hub"
    # a's profiler measures it as fast as the others; its stage-worker runs 8x slower: well beyond what a busy CI
    # machine makes the others look (up to 4x seen at 30x emulation)
    bus = start_cluster(broker, make_bus, services, tmp_path,
                        lambda node: {"EDGESWARM_COMPUTE_SLOWDOWN": str(SLOWDOWN)},
                        lambda node: {"EDGESWARM_COMPUTE_SLOWDOWN": str(SLOWDOWN * (8 if node == "a" else 1))})
    events: list[JobEvent] = []
    plans: dict[int, ServePlan] = {}  # every plan the job published, by epoch
    name = "rebalance"

    def seen(state: Any) -> None:
        if isinstance(state.plan, ServePlan):
            plans[state.plan.epoch] = state.plan

    follower = JobFollower(bus, name, on_state=seen, on_event=events.append)
    spec = {"kind": "serve-pipeline", "name": name, "model": MODEL, "micro_batch_size": MICRO_BATCH, "window": 4}
    submit_job(bus, json.dumps(spec), submission=follower.submission)

    def of(kind: str) -> list[str]:
        return [e.detail for e in list(events) if e.kind == kind]

    def on_a() -> int | None:
        """The first re-plan that measured a slower than profiled (its index among the re-plans)."""
        return next((k for k, d in enumerate(of("rebalanced")) if A_MOVED.search(d)), None)

    try:
        first = wait_serving(follower, 120).plan
        assert isinstance(first, ServePlan) and "a" in first.devices, first
        model = ModelSpec.model_validate(MODEL)
        inputs = [example_input(model, MICRO_BATCH, seed=k) for k in range(16)]
        deadline, answers = time.monotonic() + 120, []
        # On a busy machine b and c may measure slower than profiled too and move the stream first (while a holds
        # less than the fit's sliver, its speed is not measured): the loop goes on until a re-plan measured a.
        while on_a() is None and time.monotonic() < deadline:  # bounded: about 120 s of items at most
            answers.append(infer_stream(bus, name, inputs, window=4, timeout_s=60))
        k = on_a()
        assert k is not None, _why(tmp_path, events, first, follower)
        moved = of("rebalanced")
        assert "more)" in moved[k], moved
        # The re-plan that measured a gives a less of the forward than the plan it replaced, as the profile prices
        # it (each re-plan is the next epoch).
        before, after = first.epoch + k, first.epoch + k + 1
        wait_until(lambda: after in plans, 10, message="the new plan in the job's state")
        unit_s = _unit_seconds(model)
        assert _share(plans[after], "a", unit_s) < _share(plans[before], "a", unit_s), (
            moved, plans[before].stages, plans[after].stages)
        # The stream goes on on the new plan; every request was answered, right, once.
        answers.append(infer_stream(bus, name, inputs, window=4, timeout_s=60))
        assert_answered(answers, inputs, model)
        sent = sum(len(report.results) for report in answers)
        wait_until(lambda: follower.state.progress_as(ServeProgress).answered == sent, 10,
                   message="every request counted once")
    finally:
        cancel_job(bus, name)
        follower.wait(60)
    # Stopped, it saved each stage device's measured speed (a's measured 8x its profile, where a computed), kept
    # apart from training's; the next job plans from it.
    wait_for_event(events, "refit", "saved the measured speeds for the next job: ")
    files = {p.name: json.loads(p.read_text())["profile"] for p in saved.glob("refits/*/*.json")}
    assert "a.serve.json" in files and files["a.serve.json"]["work"] == "serve", files
    assert files["a.serve.json"]["scale"] > 1.5, files
    events.clear()
    nxt = JobFollower(bus, "next", on_event=events.append)
    submit_job(bus, json.dumps({**spec, "name": "next"}), submission=nxt.submission)
    try:
        wait_until(lambda: nxt.state is not None and nxt.state.status in ("running", "failed"), 120,
                   message="the next job serving")
        assert any(d.startswith("starts from the speeds earlier jobs measured: a ") for d in of("refit")), \
            [(e.kind, e.detail) for e in events]
    finally:
        cancel_job(bus, "next")
        nxt.wait(60)


def _why(tmp_path: Path, events: list[JobEvent], first: ServePlan, follower: JobFollower) -> str:
    """What a failing assertion says (a string: pytest cuts any other message to a line): the job's events, its first
    plan's stages, its progress and the end of the coordinator's log."""
    logs = sorted(tmp_path.glob("hub.coordinator.*.log"))
    tail = logs[0].read_text(errors="replace").splitlines()[-40:] if logs else []
    return "\n".join([*(f"{e.kind}: {e.detail}" for e in events), f"first plan: {first.stages}",
                      f"progress: {follower.state.progress if follower.state else None}", *tail])


def _unit_seconds(model: ModelSpec) -> list[float]:
    """Each unit's forward of a micro-batch on this host: what the units cost, relative to each other."""
    from edgeswarm.profiling.compute import profile_model

    _, compute = profile_model(model, [MICRO_BATCH], repeats=3, warmup=1)
    return [row[0] for row in compute.forward_s]


def _share(plan: ServePlan, device: str, unit_s: list[float]) -> float:
    """The fraction of the model's forward ``device`` computes in ``plan``."""
    return sum(sum(unit_s[s.start:s.end]) for s in plan.stages if s.device == device) / sum(unit_s)


def test_links_slower_than_their_profile_are_refitted_and_the_stream_moves_off_them(
        broker, make_bus, services, tmp_path: Path) -> None:
    """The profilers' links carry what their probes measure; the stage-workers' links to and from a carry a
    twentieth of it. A pipeline that crosses a link of a's is fitted from how its items' tensors arrive and moves off
    a's links."""
    model = ModelSpec.model_validate(MODEL)
    slowdown = 100.0  # a layer's forward then tens of milliseconds: the runtime's per-item costs are a small part
    layer_s = slowdown * max(_unit_seconds(model))
    cut = MICRO_BATCH * model_profile_cut_bytes(model)
    # As profiled, a cut tensor's bytes cross in 0.3 of a layer's forward (the message's fixed costs, on a busy
    # machine tens of milliseconds, come on top: the profile prices them too): the best plan gives each device a
    # layer. At a twentieth of the rate, a link of a's takes six layers' time, and b and c alone (two layers on one)
    # serve about three times faster. tests/test_serve_refit.py has a link off by 5x, in miniature.
    fast = cut / (0.3 * layer_s)

    def links(node: str, slow: bool) -> dict[str, str]:
        rates = {peer: fast / 20 if slow and "a" in (node, peer) else fast for peer in NODES if peer != node}
        # Two chunks a cut tensor: the second's arrival times the link, and a loaded machine's per-message costs
        # (tens of milliseconds each, in the profile too) stay small beside the bytes' time.
        return {"EDGESWARM_COMPUTE_SLOWDOWN": str(slowdown), "EDGESWARM_CHUNK_BYTES": str(cut // 2),
                "EDGESWARM_LINKS": json.dumps({p: {"bandwidth_bps": r, "latency_s": 0.0} for p, r in rates.items()})}

    bus = start_cluster(broker, make_bus, services, tmp_path, lambda node: links(node, False),
                        lambda node: links(node, True))
    events: list[JobEvent] = []
    name = "slow-links"
    follower = JobFollower(bus, name, on_event=events.append)
    submit_job(bus, json.dumps({"kind": "serve-pipeline", "name": name, "model": MODEL,
                                "micro_batch_size": MICRO_BATCH, "window": 4}), submission=follower.submission)

    def plan() -> ServePlan:
        state = follower.state.plan
        assert isinstance(state, ServePlan)
        return state

    def slow_crossed(p: ServePlan) -> bool:
        return any("a" in pair for pair in zip(p.devices, p.devices[1:], strict=False))

    try:
        wait_serving(follower, 120)
        first = plan()
        if not slow_crossed(first):
            # Seen about once in three runs: the profilers' link probes answered late (the peers were busy profiling
            # their compute), the links were priced several times their rate, and the plan kept off a's links.
            pytest.skip(f"the first plan crosses no link of a's, nothing to learn: {first.devices}")
        inputs = [example_input(model, MICRO_BATCH, seed=k) for k in range(8)]
        deadline, answers = time.monotonic() + 120, []
        while slow_crossed(plan()) and time.monotonic() < deadline:  # bounded: at most two moves, 120 s of items
            answers.append(infer_stream(bus, name, inputs, window=4, timeout_s=60))
        moved = [e.detail for e in list(events) if e.kind == "rebalanced"]
        # Off a's links: on b and c, or (as fast) on a alone.
        assert not slow_crossed(plan()), ([(e.kind, e.detail) for e in events], first.stages, plan().stages)
        assert 1 <= len(moved) <= 2, moved
        assert all("links measured against the profile: a<->" in m for m in moved), moved
        assert_answered(answers, inputs, model)
    finally:
        cancel_job(bus, name)
        follower.wait(60)
    kept = [e.detail for e in list(events) if e.kind == "refit"]
    assert kept and "a<->" in kept[-1], kept  # the slow links saved for the next job


def model_profile_cut_bytes(model: ModelSpec) -> int:
    """Bytes per sample of the tensor a cut between two of the model's layers carries (the hidden width's)."""
    return 4 * int(model.config["hidden"])


def assert_answered(answers: list[Any], inputs: list[torch.Tensor], model: ModelSpec) -> None:
    """Every request of ``answers`` (infer_stream's reports over ``inputs``) has the outputs of the model run in one
    process."""
    net = build_model(model).eval()
    with torch.no_grad():
        for report in answers:
            for r in report.results:
                assert r.outputs is not None, f"request {r.index}: {r.reason}: {r.error}"
                torch.testing.assert_close(r.outputs, net(inputs[r.index]), rtol=1e-5, atol=1e-5)
