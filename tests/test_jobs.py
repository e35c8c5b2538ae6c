"""The coordinator's job lifecycle over the real broker: submissions refused with the field and the reason, a
job that cannot run fails with its reason instead of hanging, cancellations, and the retained job states."""

from __future__ import annotations

import time

import pytest

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.hpp.spec import TrainProgress
from edgeswarm.messages.jobs import JobEvent, JobState, JobSubmit
from edgeswarm.workloads.client import (
    JobFollower,
    JobRequestError,
    cancel_job,
    job_states,
    submit_job,
    submitted_state,
)
from helpers import wait_until

JOB = """
name: {name}
model: {{name: mlp, config: {{hidden: 32, layers: 2}}}}
data: {{kind: teacher, size: 256, test_size: 32}}
global_batch: {batch}
micro_batches: 2
rounds: 3
"""


def test_the_coordinator_refuses_bad_submissions_and_fails_a_job_it_cannot_run(broker, make_bus, services) -> None:
    coordinator = services.start("coordinator", "hub", broker.url)
    services.start("node-agent", "dev-1", broker.url)  # a device, but with no stage-worker
    client = make_bus("job-test", "cli")
    client.peers.wait_for("hub", "coordinator", timeout_s=30)
    client.peers.wait_for("dev-1", "node-agent", timeout_s=30)

    with pytest.raises(JobRequestError, match=r"(?s)refused \(invalid\).*global_batch: Input should be greater than or "
                                              r"equal to 1"):
        submit_job(client, JOB.format(name="bad", batch=0))
    with pytest.raises(JobRequestError, match=r"refused \(invalid\).*not valid YAML"):
        submit_job(client, "name: [unclosed")

    events: list[JobEvent] = []
    follower = JobFollower(client, "lonely", on_event=events.append)
    assert submit_job(client, JOB.format(name="lonely", batch=64), submission=follower.submission).job_id == "lonely"
    # The same submission again (its submitter missed the reply) is answered as it was, and not run twice.
    again = submit_job(client, JOB.format(name="lonely", batch=64), submission=follower.submission)
    assert again.job_id == "lonely" and again.detail.startswith("already accepted"), again
    with pytest.raises(JobRequestError, match=r"refused \(duplicate\): job lonely is (queued|profiling)"):
        submit_job(client, JOB.format(name="lonely", batch=64))
    final = follower.wait(60)
    assert final.status == "failed" and "no stage-worker is online" in final.detail, final
    assert wait_until(lambda: [e.kind for e in events][-1:] == ["failed"], 5)
    assert [e.kind for e in events][0] == "submitted" and [e.kind for e in events].count("submitted") == 1
    assert "resumed" not in [e.kind for e in events]  # submitted as the coordinator started: not taken as its own

    with pytest.raises(JobRequestError, match=r"refused \(finished\): job lonely already failed"):
        cancel_job(client, "lonely")
    with pytest.raises(JobRequestError, match=r"refused \(unknown_job\)"):
        cancel_job(client, "nobody")
    states = {s.job_id: s for s in job_states(client)}
    assert states["lonely"].status == "failed" and states["lonely"].model == "mlp"

    # A restarted coordinator knows the finished jobs from their retained states and runs none of them again.
    first = client.peers.get("hub", "coordinator").instance
    coordinator.terminate()
    coordinator.wait(15)
    services.start("coordinator", "hub", broker.url)

    def restarted() -> bool:
        now = client.peers.get("hub", "coordinator")
        return now is not None and now.instance != first and now.state == "online"

    wait_until(restarted, 30, message="the new coordinator")
    with pytest.raises(JobRequestError, match=r"refused \(finished\): job lonely already failed"):
        cancel_job(client, "lonely")
    assert [e.kind for e in events][-1] == "failed"


class _SilentCoordinator:
    """A coordinator on the real broker that never answers a submission: it takes each one (publishing the job's
    retained state, as the real one does before it replies) only when ``takes``, and counts what it got."""

    def __init__(self, bus: Bus, *, takes: bool) -> None:
        self.bus, self.takes = bus, takes
        self.got: list[JobSubmit] = []
        bus.subscribe(topics.request("hub", "coordinator"), self._on_submit, schemas=(JobSubmit,))

    def _on_submit(self, msg: Inbound) -> None:
        assert isinstance(msg.body, JobSubmit)
        self.got.append(msg.body)
        if self.takes:
            now = time.time()
            state = JobState(job_id="late", submission=msg.body.submission, spec=msg.body.spec, status="queued",
                             model="mlp", progress=TrainProgress(), submitted_at=now, updated_at=now)
            self.bus.publish(topics.job_state("late"), state, retain=True)


@pytest.mark.parametrize("takes", [True, False])
def test_a_submit_whose_replies_never_come_says_truthfully_whether_it_was_accepted(make_bus, takes: bool) -> None:
    coordinator = _SilentCoordinator(make_bus("hub", "coordinator"), takes=takes)
    client = make_bus("job-test", "cli")
    text = JOB.format(name="late", batch=64)
    if takes:
        accepted = submit_job(client, text, submission="s-1", timeout_s=0.5)
        assert accepted.job_id == "late" and accepted.detail.startswith("accepted, though its reply was lost")
    else:
        with pytest.raises(JobRequestError, match=r"^not accepted: the coordinator on hub answered none of 2 requests"):
            submit_job(client, text, submission="s-1", timeout_s=0.5)
    # Asked again with the same submission (the key that makes it idempotent), then the state looked up.
    assert [m.submission for m in coordinator.got] == ["s-1", "s-1"]


def test_a_submission_that_expired_before_its_handler_ran_is_not_taken(make_bus) -> None:
    from edgeswarm.services.coordinator.jobs import JobManager

    bus = make_bus("hub", "coordinator")
    manager = JobManager(bus, "hub")
    try:
        client = make_bus("job-test", "cli")
        body = JobSubmit(spec=JOB.format(name="stale", batch=64), submission="s-2")
        stale = client.sender.envelope(body, ttl_s=-1.0, reply_to=client.reply_topic, correlation_id="c-2")
        manager._on_submit(Inbound(topics.request("hub", "coordinator"), stale, body, None, False))
        assert submitted_state(client, body.spec, "s-2", settle_s=1.0) is None
        fresh = client.sender.envelope(body, ttl_s=10.0, reply_to=client.reply_topic, correlation_id="c-3")
        manager._on_submit(Inbound(topics.request("hub", "coordinator"), fresh, body, None, False))
        taken = submitted_state(client, body.spec, "s-2", settle_s=5.0)
        assert taken is not None and taken.job_id == "stale"
    finally:
        manager.stop()


def test_the_job_threads_get_one_shutdown_grace_in_all(make_bus, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under load, `up`'s Ctrl-C killed a coordinator that waited 5 s for each job thread in turn; it now waits 5 s in
    # all, which its SIGTERM grace holds. A fake clock: each join that times out moves it by what it waited.
    import edgeswarm.services.coordinator.jobs as jobs_module
    from edgeswarm.services.coordinator.jobs import JobManager

    clock = [1000.0]
    monkeypatch.setattr(jobs_module.time, "monotonic", lambda: clock[0])

    class Stuck:
        def __init__(self) -> None:
            self.waited: list[float] = []

        def join(self, timeout: float | None = None) -> None:
            self.waited.append(timeout or 0.0)
            clock[0] += timeout or 0.0

    manager = JobManager(make_bus("hub", "coordinator"), "hub")
    manager._queue.put(None)  # the real job thread ends first (on the queue's STOP), out of the count
    manager._thread.join(5)
    stuck = [Stuck() for _ in range(3)]
    manager._thread = stuck[0]  # type: ignore[assignment]
    manager._threads = stuck[1:]  # type: ignore[assignment]
    manager.stop(timeout_s=5.0)
    assert sum(w for s in stuck for w in s.waited) == pytest.approx(5.0)
