"""A client's side of jobs of every kind: submit one to the coordinator, cancel it, list jobs, follow one.

(The bus has no unsubscribe: these are for short-lived clients such as the CLI.)"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import BusError, ConfigError, EdgeswarmError, NotAuthorizedError
from edgeswarm.messages.jobs import (
    FINISHED,
    JobAccepted,
    JobCancel,
    JobEvent,
    JobRejected,
    JobState,
    JobSubmit,
)
from edgeswarm.wire import Message
from edgeswarm.wire.schema import new_id
from edgeswarm.workloads import installed_workload, parse_spec_text, typed_state

COORDINATOR_NODE = "hub"


class JobRequestError(EdgeswarmError):
    """The coordinator refused the request, or did not answer; the message says why."""


class _NoAnswer(JobRequestError):
    """No reply came: the request may or may not have been handled."""


def _ask(bus: Bus, message: Message, timeout_s: float, coordinator: str) -> JobAccepted:
    try:
        reply = bus.request(topics.request(coordinator, "coordinator"), message, timeout_s=timeout_s).body
    except NotAuthorizedError as exc:
        raise JobRequestError(f"{exc} (only the hub and client members may submit or cancel jobs)") from None
    except BusError as exc:
        raise _NoAnswer(f"the coordinator on {coordinator} did not answer: {exc}; is the cluster up "
                        "(edgeswarm status)?") from None
    if isinstance(reply, JobRejected):
        raise JobRequestError(f"refused ({reply.reason}): {reply.detail}")
    assert isinstance(reply, JobAccepted)
    return reply


SUBMIT_ATTEMPTS = 2
STATE_SETTLE_S = 2.0  # how long a submitter whose requests went unanswered waits for the job's retained state


def submit_job(bus: Bus, spec_text: str, *, submission: str = "", timeout_s: float = 10.0,
               coordinator: str = COORDINATOR_NODE, attempts: int = SUBMIT_ATTEMPTS) -> JobAccepted:
    """Submit the job spec ``spec_text`` (YAML or JSON) to the coordinator, tagged ``submission`` (see
    JobFollower; a fresh id when empty). Raises JobRequestError naming the invalid fields or a duplicate name.

    A submission is idempotent, its id the key: when no reply comes within ``timeout_s`` seconds the same
    submission is sent again (``attempts`` in all; the coordinator answers one it already took as it did, and never
    runs it twice). When none is answered, the job's retained state says whether the coordinator took it: then the
    answer is JobAccepted all the same; otherwise JobRequestError says it was not accepted, which holds because the
    coordinator drops a submission that reaches it after its expiry (the request's timeout)."""
    submission = submission or new_id()
    message = JobSubmit(spec=spec_text, submission=submission)
    unanswered: _NoAnswer | None = None
    for _ in range(max(1, attempts)):
        try:
            return _ask(bus, message, timeout_s, coordinator)
        except _NoAnswer as exc:
            unanswered = exc
    state = submitted_state(bus, spec_text, submission, coordinator=coordinator)
    if state is not None:
        return JobAccepted(job_id=state.job_id,
                           detail=f"accepted, though its reply was lost: the job is {state.status}")
    raise JobRequestError(f"not accepted: the coordinator on {coordinator} answered none of {max(1, attempts)} "
                          f"requests of {timeout_s:g} s, and no job of this submission exists (a request that arrives "
                          "later expires unhandled, so nothing will start). Is the cluster up (`edgeswarm status`)? "
                          "Then submit it again") from unanswered


def submitted_state(bus: Bus, spec_text: str, submission: str, *, coordinator: str = COORDINATOR_NODE,
                    settle_s: float = STATE_SETTLE_S) -> JobState | None:
    """The state of the job that ``spec_text`` names, if the coordinator on ``coordinator`` took it as submission
    ``submission``; None when no such state arrives within ``settle_s`` seconds (or the text names no job)."""
    try:
        job_id = str(parse_spec_text(spec_text).name)  # type: ignore[attr-defined]
    except EdgeswarmError:
        return None  # the coordinator refuses what does not parse: it took nothing
    found: list[JobState] = []
    seen = threading.Event()

    def on_state(msg: Inbound) -> None:
        assert isinstance(msg.body, JobState)
        body, env = typed_state(msg.body), msg.envelope
        # Only the coordinator writes job states (the ACL enforces it in a deployment; this holds without one).
        if (env.sender_node, env.sender_service) == (coordinator, "coordinator") and body.job_id == job_id and \
                body.submission == submission:
            found.append(body)
            seen.set()

    bus.subscribe(topics.job_state(job_id), on_state, schemas=(JobState,))
    seen.wait(settle_s)
    return found[0] if found else None


def cancel_job(bus: Bus, job_id: str, *, timeout_s: float = 10.0, coordinator: str = COORDINATOR_NODE) -> JobAccepted:
    """Ask the coordinator to cancel ``job_id``. Raises JobRequestError for an unknown or finished job."""
    return _ask(bus, JobCancel(job_id=job_id), timeout_s, coordinator)


def job_states(bus: Bus, *, settle_s: float = 1.0) -> list[JobState]:
    """Every job's retained state, sorted by submission time: what arrives within ``settle_s`` seconds."""
    states: dict[str, JobState] = {}
    lock = threading.Lock()

    def on_state(msg: Inbound) -> None:
        assert isinstance(msg.body, JobState)
        if topics.job_of(msg.topic) != msg.body.job_id:
            return  # a state filed under another job's topic speaks for nobody
        state = typed_state(msg.body)
        with lock:
            states[state.job_id] = state

    bus.subscribe(topics.ALL_JOB_STATES, on_state, schemas=(JobState,))
    time.sleep(settle_s)
    with lock:
        return sorted(states.values(), key=lambda s: s.submitted_at)


class JobFollower:
    """Collects the states and events of one submission of a job: make it before submitting the job with
    ``submission=follower.submission``, so no round is missed, and states of an earlier job of the same name
    (its retained state) are ignored. ``on_state`` and ``on_event`` run on the bus's threads."""

    def __init__(self, bus: Bus, job_id: str, *, on_state: Callable[[JobState], None] | None = None,
                 on_event: Callable[[JobEvent], None] | None = None) -> None:
        self.bus = bus
        self.job_id = job_id
        self.submission = new_id()
        self.rounds: dict[int, JobState] = {}  # the state after each round, by rounds done
        self.state: JobState | None = None
        self._on_state = on_state
        self._on_event = on_event
        self._done = threading.Event()
        bus.subscribe(topics.job_state(job_id), self._state, schemas=(JobState,))
        bus.subscribe(topics.job_events(job_id), self._event, schemas=(JobEvent,))

    def _state(self, msg: Inbound) -> None:
        assert isinstance(msg.body, JobState)
        state = typed_state(msg.body)
        if state.submission != self.submission or state.job_id != self.job_id:
            return  # an earlier job of the same name
        self.state = state
        work = installed_workload(state.kind)
        summary = work.summary(state) if work is not None else None
        if summary is not None and summary.round and summary.round_measured:
            self.rounds.setdefault(summary.round, state)
        if self._on_state is not None:
            self._on_state(state)
        if state.status in FINISHED:
            self._done.set()

    def _event(self, msg: Inbound) -> None:
        # Events come on their own topic, handled on another thread than the states: they name their submission
        # rather than follow its state.
        assert isinstance(msg.body, JobEvent)
        if self._on_event is not None and msg.body.submission == self.submission:
            self._on_event(msg.body)

    def wait(self, timeout_s: float) -> JobState:
        """The job's final state. Raises JobRequestError if it has not finished within ``timeout_s`` seconds."""
        if not self._done.wait(timeout_s):
            where = self.state.status if self.state else "no state seen"
            raise JobRequestError(f"job {self.job_id} did not finish within {timeout_s:.0f} s ({where})")
        assert self.state is not None
        return self.state


def write_run_json(path: Path, final: JobState, follower: JobFollower) -> None:
    """Write a followed job's record to ``path``: ``state`` (its final state) and ``rounds`` (its kind's progress
    after each round, in order; the per-strategy predictions left out, the final state has them). Raises
    ConfigError when the file cannot be written."""
    rounds = [s.progress.model_dump(mode="json", exclude={"predictions"}) for _, s in sorted(follower.rounds.items())]
    try:
        path.write_text(json.dumps({"state": final.model_dump(mode="json"), "rounds": rounds}, indent=2))
    except OSError as exc:
        raise ConfigError(f"cannot write --json {path}: {exc}") from None
