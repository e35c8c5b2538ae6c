"""The coordinator side written once (issue 20.2): the request fan-out, the planner client with its busy retry
(which serving's coordinator now has too) and the skeleton's loop (either shape's, its recoveries counted), over the
real broker where messages cross it."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import SimpleNamespace

import pytest

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.coordination.fanout import fan_out
from edgeswarm.coordination.planner_client import request_plan
from edgeswarm.coordination.program import CoordinatorProgram, Disrupted, RoundProgram
from edgeswarm.errors import JobCancelled, JobError, RequestRejectedError, RequestTimeoutError
from edgeswarm.messages import RequestRejected
from edgeswarm.messages.planning import PlanFailed, ServePlanReply, ServePlanRequest
from edgeswarm.messages.training import StageHeld, StageInventory
from edgeswarm.metrics import Metrics
from edgeswarm.observability.catalogue import RECOVERIES
from edgeswarm.planning.serve.plan import plan_serving
from edgeswarm.planning.serve.types import ServeOptions, ServePlan
from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster
from edgeswarm.runtime.detection import Detection
from edgeswarm.values.profiles import ClusterProfile
from edgeswarm.wire import Message

WORKER = "stage-worker"
GIB = 1024**3


class _Worker:
    """Answers StageInventory requests on ``node``'s worker topic with ``answer(request)`` (by default a StageHeld
    naming the request's job; None: stays silent), keeping what it was asked."""

    def __init__(self, bus: Bus, node: str, answer=None) -> None:  # type: ignore[no-untyped-def]
        self.bus = bus
        self.node = node
        self.asked: list[str] = []
        self._answer = answer or (lambda request: StageHeld(job_id=request.job_id, node=node))
        bus.subscribe(topics.request(node, WORKER), self._on_request, schemas=(StageInventory,))

    def _on_request(self, msg: Inbound) -> None:
        assert isinstance(msg.body, StageInventory)
        self.asked.append(msg.body.job_id)
        reply = self._answer(msg.body)
        if reply is not None:
            self.bus.reply(msg, reply)


def test_fan_out_collects_every_reply_and_every_failure(make_bus) -> None:
    workers = {n: _Worker(make_bus(n, WORKER), n) for n in ("a", "b")}
    _Worker(make_bus("silent", WORKER), "silent", answer=lambda request: None)
    _Worker(make_bus("full", WORKER), "full",
            answer=lambda request: RequestRejected(reason="busy", detail="inbox full"))
    coordinator = make_bus("hub", "coordinator")
    messages = {n: StageInventory(job_id=f"n-{n}") for n in ("a", "b", "silent", "full")}

    fan = fan_out(coordinator, messages, WORKER, timeout_s=1.0)

    assert set(fan.replies) == {"a", "b"} and not fan.interrupted and set(fan.failures) == {"silent", "full"}
    assert all(isinstance(r, StageHeld) and r.job_id == f"n-{n}" and r.node == n for n, r in fan.replies.items())
    assert isinstance(fan.failures["silent"], RequestTimeoutError) and "within 1 s" in str(fan.failures["silent"])
    assert isinstance(fan.failures["full"], RequestRejectedError) and fan.failures["full"].reason == "busy"
    assert workers["a"].asked == ["n-a"]


def test_fan_out_maps_keys_to_nodes_and_stops_when_watch_says(make_bus) -> None:
    worker = _Worker(make_bus("a", WORKER), "a")
    _Worker(make_bus("silent", WORKER), "silent", answer=lambda request: None)
    coordinator = make_bus("hub", "coordinator")
    seen: list[int] = []

    def watch(replies: Mapping[str, Message]) -> float | None:
        seen.append(len(replies))
        return 0.0 if len(replies) == 2 else None  # both of a's answers are in: stop waiting for silent

    fan = fan_out(coordinator, {"first": StageInventory(job_id="j1"), "second": StageInventory(job_id="j2"),
                               "silent": StageInventory(job_id="j3")},
                  WORKER, timeout_s=30.0, targets={"first": "a", "second": "a"}, watch=watch)

    assert {k: r.job_id for k, r in fan.replies.items()} == {"first": "j1", "second": "j2"}  # type: ignore[attr-defined]
    assert list(fan.failures) == ["silent"] and "stopped waiting" in str(fan.failures["silent"])
    assert sorted(worker.asked) == ["j1", "j2"] and seen[-1] == 2


def test_fan_out_of_nothing_returns_at_once(make_bus) -> None:
    fan = fan_out(make_bus("hub", "coordinator"), {}, WORKER, timeout_s=30.0)
    assert not fan.interrupted and not fan.replies and not fan.failures


class _FakePlanner:
    """Answers plan requests on the hub's planner topic with the given answers in turn (the last one repeats)."""

    def __init__(self, bus: Bus, answers: list[Message], schemas: tuple[type[Message], ...]) -> None:
        self.asked = 0
        self._bus = bus
        self._answers = answers
        bus.subscribe(topics.request("hub", "planner"), self._on_request, schemas=schemas)

    def _on_request(self, msg: Inbound) -> None:
        self.asked += 1
        self._bus.reply(msg, self._answers[min(self.asked, len(self._answers)) - 1])


def _cluster() -> ClusterProfile:
    devs = [SyntheticDevice("a", 1.0, 4 * GIB), SyntheticDevice("b", 2.0, 4 * GIB)]
    return synthetic_cluster(12, devs, bandwidth_bps=12.5e6)


def _serve_plan(epoch: int) -> ServePlan:
    return plan_serving(_cluster(), ServeOptions(micro_batch_size=8)).model_copy(update={"epoch": epoch})


BUSY = PlanFailed(reason="busy", detail="2 plan requests are already waiting on hub; try again later")


def test_the_planner_client_asks_again_while_busy_and_says_what_to_do(make_bus) -> None:
    request = ServePlanRequest(cluster=_cluster(), options=ServeOptions(micro_batch_size=8), epoch=2)
    planned = ServePlanReply(plan=_serve_plan(2), planning_s=0.0)
    planner = _FakePlanner(make_bus("hub", "planner"), [BUSY, BUSY, planned], (ServePlanRequest,))
    client = make_bus("hub", "coordinator")
    reply = request_plan(client, request, what="job s", timeout_s=20.0, busy_pause_s=0.05)
    assert isinstance(reply, ServePlanReply) and reply.plan.epoch == 2 and planner.asked == 3

    planner._answers = [BUSY, PlanFailed(reason="too_large", detail="about 9,000,000 cells")]
    planner.asked = 0
    with pytest.raises(JobError, match=r"job s: planning it is too much work .* 9,000,000 cells\. Use fewer"):
        request_plan(client, request, what="job s", timeout_s=20.0, busy_pause_s=0.05,
                     too_large_advice="Use fewer devices")
    planner._answers, planner.asked = [PlanFailed(reason="infeasible", detail="nothing fits")], 0
    with pytest.raises(JobError, match=r"job s: no serving plan \(infeasible\): nothing fits"):
        request_plan(client, request, what="job s", timeout_s=20.0, plan_noun="serving plan")
    planner._answers, planner.asked = [BUSY], 0
    with pytest.raises(JobError, match="stayed busy for 1 s"):
        request_plan(client, request, what="job s", timeout_s=1.0, busy_pause_s=0.2)
    assert planner.asked >= 2


def test_the_planner_client_names_a_planner_that_does_not_answer(make_bus) -> None:
    request = ServePlanRequest(cluster=_cluster(), options=ServeOptions(micro_batch_size=8))
    with pytest.raises(JobError, match="job s: the planner on elsewhere did not answer"):
        request_plan(make_bus("hub", "coordinator"), request, what="job s", planner_node="elsewhere", timeout_s=1.0)


def test_serving_asks_the_planner_again_while_it_is_busy(make_bus) -> None:
    """Serving's coordinator plans through the common client: a busy planner is asked again (it was not)."""
    from edgeswarm.pipeline_serve.coordinator import PipelineRunner
    from edgeswarm.pipeline_serve.spec import ServeSpec
    from edgeswarm.workloads.base import JobContext

    planner = _FakePlanner(make_bus("hub", "planner"), [BUSY, ServePlanReply(plan=_serve_plan(1), planning_s=0.0)],
                           (ServePlanRequest,))
    bus = make_bus("hub", "coordinator")
    updates: list[tuple] = []  # type: ignore[type-arg]
    ctx = JobContext(bus=bus, node="hub", store_node=None, timeout_s=20.0, cancel=threading.Event(),
                     stopping=threading.Event(), update=lambda *a, **k: updates.append(a),  # type: ignore[arg-type,return-value]
                     state=lambda: None)  # type: ignore[arg-type,return-value]
    spec = ServeSpec.model_validate({"kind": "serve-pipeline", "name": "s", "micro_batch_size": 8,
                                     "model": {"name": "mlp", "config": {"image_size": 4, "hidden": 32, "layers": 2}}})
    runner = PipelineRunner(ctx, spec, busy_pause_s=0.05)
    plan = runner.request_plan(_cluster(), 1)
    assert plan.epoch == 1 and planner.asked == 2 and updates == []  # a re-plan publishes no "planning" status


def scripted_step(what: str) -> None:
    """One step as a script says: "ok" does nothing, "lost" is a disruption with device b confirmed lost, "stall"
    one with no device lost, "fail" another error."""
    if what == "lost":
        raise Disrupted("b is gone", {"b": Detection("b", "probe", 0.0, 1.0, "b is gone")})
    if what == "stall":
        raise Disrupted("the round stalled")
    if what == "fail":
        raise JobError("a step failed")


class _Steps(CoordinatorProgram[ServePlan]):
    """A program whose steps follow a script: "ok", "lost" (a disruption) or "fail" (another error)."""

    def __init__(self, script: list[str], cancel: threading.Event | None = None) -> None:
        super().__init__(None, name="j", worker_service=WORKER, cancel=cancel)  # type: ignore[arg-type]
        self.script = script
        self.lost: list[dict[str, Detection]] = []

    def profile(self, nodes: list[str]) -> ClusterProfile:
        raise AssertionError("not called")

    def plan_request(self, cluster: ClusterProfile, epoch: int) -> Message:
        raise AssertionError("not called")

    def plan_from(self, reply: Message) -> ServePlan:
        raise AssertionError("not called")

    def done(self) -> bool:
        return not self.script

    def step(self) -> None:
        scripted_step(self.script.pop(0))

    def on_lost(self, disruption: Disrupted) -> ServePlan:
        self.lost.append(disruption.failures)
        return _serve_plan(len(self.lost))


def test_the_loop_replans_on_every_disruption_and_stops_on_anything_else() -> None:
    program = _Steps(["ok", "lost", "ok", "lost"])
    program.loop()
    assert [list(f) for f in program.lost] == [["b"], ["b"]] and program.plan is not None and program.plan.epoch == 2
    with pytest.raises(JobError, match="a step failed"):
        _Steps(["ok", "fail", "ok"]).loop()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(JobCancelled, match="job j was cancelled"):
        _Steps(["ok"], cancel).loop()


class _Rounds(RoundProgram):
    """Rounds that follow a script: "ok", "stall" (a disruption, no device lost) or "lost" (a device lost); the
    program gets over a disruption when ``gets_over``."""

    def __init__(self, script: list[str], gets_over: bool = True) -> None:
        super().__init__(SimpleNamespace(metrics=Metrics()), name="r", worker_service=WORKER)  # type: ignore[arg-type]
        self.script = script
        self.gets_over = gets_over
        self.lost: list[str] = []

    def on_start(self) -> None:
        raise AssertionError("not called")

    def done(self) -> bool:
        return not self.script

    def step(self) -> None:
        scripted_step(self.script.pop(0))

    def on_lost(self, disruption: Disrupted) -> None:
        if not self.gets_over:
            super().on_lost(disruption)
        self.lost.append(str(disruption))


def test_a_round_program_gets_over_disruptions_and_counts_them_as_recoveries() -> None:
    program = _Rounds(["ok", "stall", "lost", "ok", "lost"])
    program.loop()
    metrics = program.bus.metrics
    assert program.lost == ["the round stalled", "b is gone", "b is gone"]
    assert metrics.counter(f"{RECOVERIES}disrupted.r") == 1 and metrics.counter(f"{RECOVERIES}device_lost.r") == 2
    gives_up = _Rounds(["ok", "lost", "ok"], gets_over=False)
    with pytest.raises(Disrupted, match="b is gone"):
        gives_up.loop()
    assert gives_up.script == ["ok"] and gives_up.bus.metrics.total(RECOVERIES) == 0


def test_the_skeleton_sits_below_every_workload() -> None:
    """Every workload runs on the skeleton, so it imports none of them (not even late) and names no service."""
    import ast
    from pathlib import Path

    import edgeswarm.coordination
    from edgeswarm.workloads import BUILTIN

    workloads = {target.split(":")[0].split(".")[1] for target in BUILTIN.values()}
    for path in Path(edgeswarm.coordination.__file__).parent.rglob("*.py"):
        imported = {n.module.split(".")[1] for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("edgeswarm.")}
        assert not imported & workloads, path.name
        assert '"stage-worker"' not in path.read_text(), path.name
