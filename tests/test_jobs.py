"""The coordinator's job lifecycle over the real broker: submissions refused with the field and the reason, a
job that cannot run fails with its reason instead of hanging, cancellations, and the retained job states."""

from __future__ import annotations

import pytest

from edgeswarm.messages.jobs import JobEvent
from edgeswarm.workloads.client import JobFollower, JobRequestError, cancel_job, job_states, submit_job
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
    with pytest.raises(JobRequestError, match=r"refused \(duplicate\): job lonely is (queued|profiling)"):
        submit_job(client, JOB.format(name="lonely", batch=64))
    final = follower.wait(60)
    assert final.status == "failed" and "no stage-worker is online" in final.detail, final
    assert wait_until(lambda: [e.kind for e in events][-1:] == ["failed"], 5)
    assert [e.kind for e in events][0] == "submitted"
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
