"""The planner service over the real broker: plans, comparisons, re-plans, and refusals it survives; planning
off the receiving thread, refusals of requests over the time budget and of a full queue (issue 13.3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.hpp.coordinator import request_plan
from edgeswarm.hpp.driver import JobError
from edgeswarm.hpp.spec import parse_job
from edgeswarm.messages import Probe, ProbeReply
from edgeswarm.messages.planning import PlanFailed, PlanReply, PlanRequest, ReplanRequest
from edgeswarm.planning.budget import work_cap
from edgeswarm.planning.hpp.budget import estimate_plan
from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster
from edgeswarm.services.planner.service import MAX_QUEUED
from edgeswarm.wire import Message

GIB = 1024**3
NODE = "hub"
# How long a planner process may take to come online: it imports torch and scikit-learn, and the host may be busy
# (20 s was once not enough beside another worker's cluster).
STARTUP_S = 60.0


def _cluster(budget: int = 4 * GIB):
    devs = [SyntheticDevice("a", 1.0, budget), SyntheticDevice("b", 2.0, budget), SyntheticDevice("c", 5.0, budget)]
    return synthetic_cluster(12, devs, bandwidth_bps=12.5e6)


def test_planner_answers_plans_replans_and_failures(broker, make_bus, services, tmp_path: Path) -> None:
    proc = services.start("planner", NODE, broker.url)
    client = make_bus("tester", "cli")
    topic = topics.request(NODE, "planner")
    cluster = _cluster()

    def ask(message, timeout_s: float = 20.0):
        return client.request(topic, message, timeout_s=timeout_s).body

    client.peers.wait_for(NODE, "planner", timeout_s=STARTUP_S)
    reply = ask(PlanRequest(cluster=cluster, global_batch=256, micro_batches=8, epoch=3))
    assert isinstance(reply, PlanReply)
    plan = reply.plan
    assert plan.epoch == 3 and plan.options.micro_batches == 8 and sorted(plan.devices) == ["a", "b", "c"]

    both = ask(PlanRequest(cluster=cluster, global_batch=256, compare=True))
    assert isinstance(both, PlanReply) and both.comparison is not None
    assert {b.strategy for b in both.comparison.baselines} == {"single", "dp", "pp"}
    assert all(b.speedup is None or b.speedup > 0 for b in both.comparison.baselines)

    light = ask(ReplanRequest(plan=plan, cluster=cluster, failed=plan.stages[-1].devices[0]))
    assert isinstance(light, PlanReply) and light.plan.epoch == 4
    assert plan.stages[-1].devices[0] not in light.plan.devices
    heavy = ask(ReplanRequest(plan=plan, cluster=cluster, failed="b", heavy=True))
    assert isinstance(heavy, PlanReply) and "b" not in heavy.plan.devices and heavy.plan.epoch == 4

    tiny = ask(PlanRequest(cluster=_cluster(budget=10_000), global_batch=64))
    assert isinstance(tiny, PlanFailed) and tiny.reason == "infeasible" and "MiB" in tiny.detail
    missing = ask(PlanRequest(cluster=cluster, global_batch=4096, micro_batches=1))
    assert isinstance(missing, PlanFailed) and missing.reason == "bad_profile" and "batch size" in missing.detail
    unknown = ask(ReplanRequest(plan=plan, cluster=cluster, failed="zz"))
    assert isinstance(unknown, PlanFailed) and "not in the plan" in unknown.detail

    again = ask(PlanRequest(cluster=cluster, global_batch=256, micro_batches=8))
    assert isinstance(again, PlanReply) and again.plan.round_latency_s == plan.round_latency_s
    assert proc.poll() is None


def _devices(count: int) -> list[SyntheticDevice]:
    return [SyntheticDevice(f"d{i}", 1.0 + i % 4, 4 * GIB) for i in range(count)]


def _send(client: Bus, message: Message, ttl_s: float = 60.0):  # type: ignore[no-untyped-def]
    """Publish a request without waiting; the returned Expectation receives its reply."""
    expectation = client.expect()
    client.publish(topics.request(NODE, "planner"), message, ttl_s=ttl_s, correlation_id=expectation.correlation_id,
                   reply_to=client.reply_topic)
    return expectation


def _probe(client: Bus) -> ProbeReply:
    reply = client.request(topics.request(NODE, "planner"), Probe(), timeout_s=5.0).body
    assert isinstance(reply, ProbeReply)
    return reply


def test_a_request_over_the_budget_is_refused_before_planning(broker, make_bus, services) -> None:
    """Issue 13.3's request (200 units, 12 devices, no micro-batch count, with the baselines: about 45 s of
    planning) is answered too_large from its estimate alone; the planner goes on answering probes and plans."""
    proc = services.start("planner", NODE, broker.url)
    client = make_bus("tester", "cli")
    client.peers.wait_for(NODE, "planner", timeout_s=STARTUP_S)
    big = synthetic_cluster(200, _devices(12), bandwidth_bps=12.5e6)
    assert estimate_plan(big, 256, compare=True).cells > work_cap(30.0)  # the default budget

    # Well under the time the plan itself would take: an answer this soon cannot be a finished plan.
    reply = client.request(topics.request(NODE, "planner"), PlanRequest(cluster=big, global_batch=256, compare=True),
                           timeout_s=15.0).body
    assert isinstance(reply, PlanFailed) and reply.reason == "too_large"
    assert "cells" in reply.detail and "budget of 30 s" in reply.detail and "fix micro_batches" in reply.detail
    assert _probe(client).healthy
    small = client.request(topics.request(NODE, "planner"), PlanRequest(cluster=_cluster(), global_batch=256,
                                                                        micro_batches=8), timeout_s=20.0).body
    assert isinstance(small, PlanReply)
    assert proc.poll() is None


def test_probes_are_answered_while_a_plan_runs_and_a_full_queue_is_busy(broker, make_bus, services) -> None:
    """With a budget large enough to plan 120 units on 12 devices (seconds of work): a probe is answered while
    that plan runs; of the requests sent meanwhile, MAX_QUEUED wait (one of them expires while it waits and is
    dropped) and the next is refused busy; the plan and every waiting request that is still wanted arrive."""
    proc = services.start("planner", NODE, broker.url, EDGESWARM_PLAN_TIME_BUDGET_S="600")
    client = make_bus("tester", "cli")
    client.peers.wait_for(NODE, "planner", timeout_s=STARTUP_S)
    big = PlanRequest(cluster=synthetic_cluster(120, _devices(12), bandwidth_bps=12.5e6), global_batch=256,
                      micro_batches=8)
    assert estimate_plan(big.cluster, 256, micro_batches=8).cells > 5_000_000  # a second or more on any machine
    small = PlanRequest(cluster=_cluster(), global_batch=256, micro_batches=8)

    running = _send(client, big)
    probe = _probe(client)  # by its answer the worker has long taken the big request off the queue
    assert probe.healthy and not running.arrived
    expiring = _send(client, small, ttl_s=0.3)  # waits in the queue and expires there
    waiting = [_send(client, small) for _ in range(MAX_QUEUED - 1)]
    refused = client.request(topics.request(NODE, "planner"), small, timeout_s=5.0).body
    assert isinstance(refused, PlanFailed) and refused.reason == "busy" and "try again" in refused.detail
    assert not running.arrived and not any(w.arrived for w in waiting)

    done = running.wait(120.0)
    assert done is not None and isinstance(done.body, PlanReply) and done.body.plan.units == 120
    for expectation in waiting:
        reply = expectation.wait(20.0)
        assert reply is not None and isinstance(reply.body, PlanReply)
    assert expiring.wait(0.5) is None  # it was ahead of the others: no answer came before theirs, none after
    assert _probe(client).healthy
    assert proc.poll() is None


class _FakePlanner:
    """Answers plan requests on the planner's topic with the given answers in turn (the last one repeats)."""

    def __init__(self, bus: Bus, answers: list[Message]) -> None:
        self.asked = 0
        self._bus = bus
        self._answers = answers
        bus.subscribe(topics.request(NODE, "planner"), self._on_request, schemas=(PlanRequest,))

    def _on_request(self, msg: Inbound) -> None:
        self.asked += 1  # before answering: the asker may check the count as soon as the answer is in
        self._bus.reply(msg, self._answers[min(self.asked, len(self._answers)) - 1])


JOB = {"name": "j", "model": {"name": "mlp"}, "data": {"kind": "teacher", "size": 256}, "global_batch": 64,
       "rounds": 1}


def test_a_job_says_what_to_change_when_its_plan_is_too_large(make_bus) -> None:
    """lifecycle.request_plan asks again while the planner is busy, and turns too_large into a JobError that
    names the job, the planner's estimate and the job field to change."""
    planner = _FakePlanner(make_bus(NODE, "planner"), [
        PlanFailed(reason="busy", detail="1 plan requests are already waiting on hub; try again later"),
        PlanFailed(reason="too_large", detail="planning ... is about 147,735,499 cells of work, over this "
                                              "planner's budget of 30 s (100,000,000 cells)")])
    client = make_bus("coordinator-node", "coordinator")
    with pytest.raises(JobError, match=r"job j: planning it is too much work .* 147,735,499 cells .* micro_batches"):
        request_plan(client, parse_job(JOB), _cluster(), timeout_s=20.0, busy_pause_s=0.05)
    assert planner.asked == 2


def test_a_job_gives_up_on_a_planner_that_stays_busy(make_bus) -> None:
    planner = _FakePlanner(make_bus(NODE, "planner"), [PlanFailed(reason="busy", detail="queue full; try again")])
    client = make_bus("coordinator-node", "coordinator")
    with pytest.raises(JobError, match="stayed busy"):
        request_plan(client, parse_job(JOB), _cluster(), timeout_s=1.0, busy_pause_s=0.2)
    assert planner.asked >= 2

