"""The toy's coordinator program: plan over the online toy-workers, deploy, step, and take over after a restart."""

from __future__ import annotations

from edgeswarm import topics
from edgeswarm.errors import BusError, JobCancelled, JobError
from edgeswarm.messages.planning import PlanFailed
from edgeswarm.runtime.client import ClusterWatcher, nodes_running
from edgeswarm.wire import Message
from edgeswarm.workloads.base import JobContext
from edgeswarm_toy.messages import ToyAssign, ToyPlanReply, ToyPlanRequest, ToyRelease, ToyStep, ToyStepDone
from edgeswarm_toy.spec import WORKER, ToyPlan, ToyProgress, ToySpec


def _ask(ctx: JobContext, node: str, service: str, message: Message) -> Message:
    try:
        return ctx.bus.request(topics.request(node, service), message, timeout_s=min(ctx.timeout_s, 30.0)).body
    except BusError as exc:
        raise JobError(f"toy job: {service} on {node} did not answer: {exc}") from None


def run_toy(ctx: JobContext, spec: ToySpec) -> tuple[str, str]:
    """Double 1..steps on the planned devices; returns the final event."""
    done = ToyProgress(total=spec.steps)
    previous = ctx.previous
    if previous is not None and isinstance(previous.progress, ToyProgress):
        done = previous.progress
        ctx.update("recovering", event=("resumed", f"a restarted coordinator takes the job over at step "
                                                   f"{done.steps_done}"))
    watcher = ClusterWatcher(ctx.bus)
    view, _ = watcher.wait(settle_s=1.0)
    nodes = nodes_running(view, WORKER)
    if not nodes:
        raise JobError(f"toy job {spec.name}: no {WORKER} is online")
    ctx.update("planning", event=("profiling", f"planning over {', '.join(nodes)}"))
    reply = _ask(ctx, ctx.node, "planner", ToyPlanRequest(job_id=spec.name, nodes=nodes))
    if isinstance(reply, PlanFailed):
        raise JobError(f"toy job {spec.name}: no plan ({reply.reason}): {reply.detail}")
    assert isinstance(reply, ToyPlanReply)
    plan: ToyPlan = reply.plan
    ctx.update("deploying", plan=plan, total=spec.steps,
               event=("planned", f"{len(plan.devices)} devices: {', '.join(plan.devices)}"))
    try:
        for node in plan.devices:
            _ask(ctx, node, WORKER, ToyAssign(job_id=spec.name, epoch=plan.epoch))
        ctx.update("running", event=("deployed", f"every {WORKER} holds the job"))
        for step in range(done.steps_done, spec.steps):
            if ctx.cancel.is_set():
                raise JobCancelled(f"toy job {spec.name} cancelled")
            node = plan.devices[step % len(plan.devices)]
            answer = _ask(ctx, node, WORKER, ToyStep(job_id=spec.name, step=step, value=step + 1))
            if not isinstance(answer, ToyStepDone) or answer.doubled != 2 * (step + 1):
                raise JobError(f"toy job {spec.name}: {node} answered step {step} with {type(answer).__name__}")
            doubled = ctx.state().progress_as(ToyProgress).doubled_sum + answer.doubled
            ctx.update("running", steps_done=step + 1, doubled_sum=doubled,
                       event=("round", f"step {step + 1} on {node}"))
            if ctx.cancel.wait(spec.step_s):
                raise JobCancelled(f"toy job {spec.name} cancelled")
    finally:
        if not ctx.stopping.is_set():
            for node in plan.devices:
                ctx.bus.publish(topics.request(node, WORKER), ToyRelease(job_id=spec.name))
    total = ctx.state().progress_as(ToyProgress).doubled_sum
    return "succeeded", f"{spec.steps} steps, doubled sum {total}"
