"""The planner service over the real broker: plans, comparisons, re-plans, and refusals it survives."""

from __future__ import annotations

from pathlib import Path

from edgeswarm import topics
from edgeswarm.messages.planning import PlanFailed, PlanReply, PlanRequest, ReplanRequest
from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster

GIB = 1024**3
NODE = "hub"


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

    client.peers.wait_for(NODE, "planner", timeout_s=20)
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
