"""What every registered job kind must do, checked the same way for each (built in or from a plug-in), on one real
local cluster over Mosquitto: refuse a bad spec with every problem listed, report its state in its own types, be
listed and cancelled, survive a coordinator restart, drop data-plane messages from strangers, and refuse another
program's requests for its job.

The kinds are whatever ``edgeswarm.workloads.KINDS`` holds where the test runs: tests/test_plugins.py runs this
module again in an environment with the toy plug-in installed, for the toy kind. Each kind's ``example`` spec is
what runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import ConfigError
from edgeswarm.local.forkserver import ForkServer
from edgeswarm.messages.jobs import JobEvent, JobState
from edgeswarm.messages.metrics import MetricsReport
from edgeswarm.plugins import load_target
from edgeswarm.runtime.client import client_bus
from edgeswarm.runtime.senders import REFUSED_SENDER
from edgeswarm.settings import Settings
from edgeswarm.wire import Message
from edgeswarm.workloads import KINDS, parse_spec_text, worker_programs, workload
from edgeswarm.workloads.client import JobFollower, JobRequestError, cancel_job, submit_job
from helpers import FAST_ENV, native_cluster, wait_until

pytestmark = pytest.mark.slow

ONLY = os.environ.get("EDGESWARM_CONTRACT_KINDS")  # the plug-in test narrows the run to its own kind
KIND_NAMES = [k for k in sorted(KINDS) if ONLY is None or k in ONLY.split(",")]
DEVICES = 2


@dataclass
class Captured:
    """A message seen on the wire while the kinds' jobs ran: where it went, what it was, and its tensor."""

    node: str
    service: str
    body: Message
    sender: str
    tensor: object = None


@dataclass
class Contract:
    local: object
    bus: Bus
    root: Path
    env: dict[str, str]
    coordinator: subprocess.Popen[bytes] | None = None  # a coordinator this module started (after a restart)
    requests: list[Captured] = field(default_factory=list)
    tensors: list[Captured] = field(default_factory=list)
    counters: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)  # (node, service) -> newest
    lock: threading.Lock = field(default_factory=threading.Lock)

    def counter(self, node: str, service: str, name: str) -> float | None:
        """The newest value of counter ``name`` that ``service`` on ``node`` published (None before any report)."""
        with self.lock:
            report = self.counters.get((node, service))
        return None if report is None else float(report.get(name, 0))


def _worker_schemas() -> tuple[tuple[type[Message], ...], tuple[type[Message], ...]]:
    """Every installed kind's worker-program request schemas and data-plane schemas (the coordinator's included)."""
    handles: list[type[Message]] = []
    tensors: list[type[Message]] = []
    for kind in KINDS:
        work = workload(kind)
        tensors += work.data_schemas
        for target in worker_programs(work.worker_service):
            program = load_target(target, "a worker program")
            handles += program.handles
            tensors += program.tensors
    return tuple(dict.fromkeys(handles)), tuple(dict.fromkeys(tensors))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, forks: ForkServer) -> Iterator[Contract]:
    root = tmp_path_factory.mktemp("contract")
    env = {**FAST_ENV, "EDGESWARM_CHECKPOINT_DIR": str(root / "checkpoints"),
           "EDGESWARM_PROFILE_DIR": str(root / "profiles")}
    with native_cluster(DEVICES, root / "cluster", env, "contract-test", skip_services=(), edges=1,
                        forks=forks) as (local, bus):
        contract = Contract(local, bus, root, env)
        handles, tensors = _worker_schemas()

        def sniff(into: list[Captured]):  # type: ignore[no-untyped-def]
            def on(msg: Inbound) -> None:
                parts = msg.topic.split("/")  # edgeswarm/node/{node}/{service}/{request|data}/{sender}
                key = (getattr(msg.body, "job_id", None), type(msg.body))
                with contract.lock:  # a few of each schema of each job: bounded however long the jobs run
                    if sum(1 for c in into if (getattr(c.body, "job_id", None), type(c.body)) == key) < 3:
                        into.append(Captured(parts[2], parts[3], msg.body, parts[5], msg.tensor))
            return on

        def on_metrics(msg: Inbound) -> None:
            body = msg.body
            assert isinstance(body, MetricsReport)
            with contract.lock:
                contract.counters[(body.node, body.service)] = dict(body.counters)

        # The sniffer samples a few messages of each kind at QoS 0: at QoS 1 its inbox, full of every tensor of the
        # cluster, would hold its connection back. The metrics have a connection of their own, at QoS 1: behind
        # that flood, at QoS 0, the broker may drop a service's reports (in CI a refusal went unseen for 30 s).
        metrics = client_bus(Settings(hub_url=local.hub_url), role="metrics-onlooker", connect_timeout_s=30)
        metrics.subscribe("edgeswarm/node/+/+/metrics", on_metrics, schemas=(MetricsReport,), qos=1)
        bus.subscribe("edgeswarm/node/+/+/request/+", sniff(contract.requests), schemas=handles, qos=0)
        if tensors:
            bus.subscribe("edgeswarm/node/+/+/data/+", sniff(contract.tensors), schemas=tensors, plane="data", qos=0)
        try:
            yield contract
        finally:
            metrics.stop()
            if contract.coordinator is not None:
                contract.coordinator.terminate()
                try:
                    contract.coordinator.wait(15)
                except subprocess.TimeoutExpired:
                    contract.coordinator.kill()
                    contract.coordinator.wait(5)


def example(kind: str, name: str) -> str:
    text = workload(kind).example
    assert text, f"job kind {kind} gives no example spec (Workload.example)"
    return text.replace("{name}", name)


def start(cluster: Contract, kind: str, name: str, *, until: tuple[str, ...] = ("running",),
          statuses: list[str] | None = None) -> JobFollower:
    """Submit the kind's example as job ``name`` and wait until its status is one of ``until`` (every status seen
    goes to ``statuses``)."""
    follower = JobFollower(cluster.bus, name, on_state=None if statuses is None else
                           (lambda state: statuses.append(state.status)))
    spec = yaml.safe_load(example(kind, name))
    if "rounds" in spec:
        # Every test here ends its job itself (cancel) and needs it running until then: a kind's example runs "in
        # seconds", and in CI a closed loop made the HPP example's 400 rounds end before the stranger's tensor came.
        spec["rounds"] = 1_000_000
    submit_job(cluster.bus, json.dumps(spec), submission=follower.submission)
    wait_until(lambda: follower.state is not None and follower.state.status in (*until, "failed", "succeeded"), 180,
               message=f"{kind} job {name} {until}")
    state = follower.state
    assert state is not None and state.status in until, (state.status, state.detail) if state else None
    return follower


def going_on(state: JobState | None) -> bool:
    """Whether the job still runs: running, or between two rounds planning the next (a kind that re-plans every
    round, as splitfed does, passes through ``planning`` each time)."""
    return state is not None and state.status in ("running", "planning")


def cancel(cluster: Contract, follower: JobFollower) -> JobState:
    cancel_job(cluster.bus, follower.job_id)
    final = follower.wait(60)
    assert final.status == "cancelled", (final.status, final.detail)
    return final


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_bad_spec_is_refused_with_every_problem_listed(cluster: Contract, kind: str) -> None:
    data = yaml.safe_load(example(kind, "x"))
    data.update({"name": "Not A Name!", "no_such_field": 1})
    with pytest.raises(ConfigError) as parsed:
        parse_spec_text(json.dumps(data))
    with pytest.raises(JobRequestError) as refused:
        submit_job(cluster.bus, json.dumps(data))
    for text in (str(parsed.value), str(refused.value)):
        assert "name" in text and "no_such_field" in text, text


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_job_reports_its_state_in_its_types_is_listed_and_cancelled(cluster: Contract, kind: str) -> None:
    work = workload(kind)
    name = f"{kind}-state"
    follower = start(cluster, kind, name)
    state = follower.state
    assert state is not None and state.kind == kind and state.model == work.model_name(
        parse_spec_text(example(kind, name)))
    assert isinstance(state.progress, work.progress_type)
    if work.plan_type is not None:
        assert isinstance(state.plan, work.plan_type)
        assert work.stage_devices(state.plan), "a running job's plan names its devices"
    assert work.summary(state).progress
    listed = subprocess.run([sys.executable, "-m", "edgeswarm", "jobs", "--json", "--hub", cluster.local.hub_url],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    mine = [j for j in json.loads(listed.stdout) if j["job_id"] == name]
    # A round-based kind (split learning) passes through planning before every round of a running job.
    assert mine and mine[0]["kind"] == kind and mine[0]["status"] in ("running", "planning"), listed.stdout
    table = subprocess.run([sys.executable, "-m", "edgeswarm", "jobs", "--hub", cluster.local.hub_url],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and name in table.stdout, table.stderr
    cancel(cluster, follower)


def _restart_coordinator(cluster: Contract) -> None:
    """SIGKILL the running coordinator and start a new one on the hub."""
    if cluster.coordinator is not None:
        cluster.coordinator.send_signal(signal.SIGKILL)
        cluster.coordinator.wait(10)
    else:
        child = next(c for c in cluster.local.children if c.service == "coordinator")  # type: ignore[attr-defined]
        child.process.send_signal(signal.SIGKILL)
        child.process.wait(10)
    env = {**os.environ, **cluster.env, "EDGESWARM_NODE_ID": "hub", "EDGESWARM_HUB_URL": cluster.local.hub_url}
    log = open(cluster.root / f"coordinator.{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
    cluster.coordinator = subprocess.Popen([sys.executable, "-m", "edgeswarm", "service", "coordinator"], env=env,
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_restarted_coordinator_takes_the_job_over(cluster: Contract, kind: str) -> None:
    name = f"{kind}-handover"
    events: list[JobEvent] = []
    statuses: list[str] = []
    follower = start(cluster, kind, name, statuses=statuses)
    cluster.bus.subscribe(topics.job_events(name), lambda msg: events.append(msg.body), schemas=(JobEvent,))
    seen_before = len(statuses)
    _restart_coordinator(cluster)
    wait_until(lambda: any(e.kind == "resumed" for e in events), 120, message=f"{kind} job {name} taken over")
    # Taken over: the new coordinator publishes the job as recovering (or queued), then running again.

    def running_again() -> bool:
        after = statuses[seen_before:]
        taken = next((i for i, s in enumerate(after) if s != "running"), None)
        return taken is not None and "running" in after[taken + 1:]

    wait_until(running_again, 180, message=f"{kind} job {name} running again after the take-over ({statuses})")
    cancel(cluster, follower)


def _traffic(cluster: Contract, kind: str, name: str) -> None:
    """Make the job move tensors: a training kind's rounds do by themselves; a serving kind is asked to infer (with
    `edgeswarm infer`, which knows every serving kind's client)."""
    work = workload(kind)
    if work.command != "serve":
        return
    if work.infer_cli:
        done = subprocess.run([sys.executable, "-m", "edgeswarm", "infer", name, "--count", "2", "--hub",
                               cluster.local.hub_url], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return
    from edgeswarm.models.zoo import example_input
    from edgeswarm.pipeline_serve.client import infer_stream

    spec = parse_spec_text(example(kind, name))
    infer_stream(cluster.bus, name, [example_input(spec.model, 1, seed=i) for i in range(4)],  # type: ignore[attr-defined]
                 window=2, timeout_s=30)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_data_plane_messages_from_a_stranger_are_dropped(cluster: Contract, kind: str) -> None:
    """A tensor the job really sent, sent again by a node its plan does not know: counted and dropped."""
    work = workload(kind)
    schemas = set(work.data_schemas) | {s for t in worker_programs(work.worker_service)
                                        for s in load_target(t, "a worker program").tensors}
    name = f"{kind}-strangers"
    follower = start(cluster, kind, name)
    _traffic(cluster, kind, name)

    assert follower.state is not None
    plan = follower.state.plan
    members = {"hub"} | {d for stage in (work.stage_devices(plan) if plan is not None else []) for d in stage}

    def genuine() -> list[Captured]:
        """One message of each data-plane schema that the job's own nodes (its plan's and the coordinator's) sent
        each other; what a caller sends (an inference request) is open to every client, so not a stranger's."""
        with cluster.lock:
            seen = [c for c in cluster.tensors if getattr(c.body, "job_id", None) == name and type(c.body) in schemas
                    and c.sender in members]
        return list({type(c.body): c for c in seen}.values())

    if not schemas:
        cancel(cluster, follower)
        return  # a kind whose jobs move no tensors has none to refuse
    wait_until(genuine, 60, message=f"a data-plane message of {kind} job {name}")
    samples = genuine()
    targets = {(c.node, c.service) for c in samples}
    wait_until(lambda: all(cluster.counter(*t, REFUSED_SENDER) is not None for t in targets), 15,
               message="metrics of the receivers")
    before = {t: cluster.counter(*t, REFUSED_SENDER) or 0.0 for t in targets}
    stranger = client_bus(Settings(hub_url=cluster.local.hub_url), role="stranger")
    try:
        for c in samples:
            stranger.send_tensor(c.node, c.service, c.body, c.tensor.to_torch())  # type: ignore[attr-defined]
    finally:
        stranger.stop()
    sent = {t: sum(1 for c in samples if (c.node, c.service) == t) for t in targets}
    try:
        wait_until(lambda: all((cluster.counter(*t, REFUSED_SENDER) or 0.0) >= before[t] + sent[t] for t in targets),
                   30, message=f"{', '.join(f'{s} on {n}' for n, s in targets)} refusing a stranger's "
                               f"{', '.join(sorted(type(c.body).__name__ for c in samples))}")
    except pytest.fail.Exception as exc:
        # What the receivers counted instead, and where the job was: a refusal counted under another name (the job
        # gone from a receiver, say) tells a different story from messages that never arrived.
        with cluster.lock:
            counted = {f"{n}/{s}": {k: v for k, v in (cluster.counters.get((n, s)) or {}).items()
                                    if any(w in k for w in ("drop", "refus", "reject", "duplicate", "inbox"))}
                       for n, s in targets}
        state = follower.state
        pytest.fail(f"{exc}; job {name}: {state.status if state else None} ({state.detail if state else ''}); "
                    f"the receivers counted {counted}")
    assert going_on(follower.state), follower.state
    cancel(cluster, follower)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_another_programs_request_for_the_job_is_refused(cluster: Contract, kind: str) -> None:
    """A request of another kind's worker program, naming this kind's running job, sent to a device that holds it:
    refused with the reason, and the job goes on."""
    work = workload(kind)
    mine = {s for t in worker_programs(work.worker_service) for s in load_target(t, "a worker program").handles
            if t == work.worker_program}
    with cluster.lock:
        others = [c for c in cluster.requests if c.service == work.worker_service and type(c.body) not in mine
                  and hasattr(c.body, "job_id")]
    if not others:
        pytest.skip(f"no other program's requests were seen on {work.worker_service} (run with the other kinds)")
    name = f"{kind}-programs"
    follower = start(cluster, kind, name)
    assert follower.state is not None and follower.state.plan is not None
    device = work.stage_devices(follower.state.plan)[0][0]
    foreign = others[0].body.model_copy(update={"job_id": name})
    reply = cluster.bus.request(topics.request(device, work.worker_service), foreign, timeout_s=30).body
    assert getattr(reply, "reason", None) == "bad_request", reply
    assert f"holds job {name}" in getattr(reply, "detail", ""), reply
    assert going_on(follower.state), follower.state
    cancel(cluster, follower)
