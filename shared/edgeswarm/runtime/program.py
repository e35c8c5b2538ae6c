"""What a worker service runs: programs, one per workload, each holding its jobs by job id.

A worker service (the stage-worker; any ``workloads.worker_host.WorkerService``) is a thin adapter: it subscribes its
request and data-plane topics, and hands each message to the ``WorkerProgram`` registered for the message's schema.
A program holds any number of jobs at once, keyed by job id (a device may serve one model while it trains
another); the messages of one job never touch another's state. Training is one program (``StageAssign`` and its
rounds); pipelined serving, tensor-parallel inference and split learning are others. The job kinds name each
program and the service that hosts it (``Workload.worker_service``, ``Workload.worker_program``); the service makes
each once: ``Program(context)``.

Programs of one process share its ``ComputeGate``: torch.fx tracing, which building a stage does, patches
``Module.__call__`` for every thread while it traces, so a forward pass elsewhere meanwhile (another job's round, a
serving request) fails with NameError ("module is not installed as a submodule"). Computing holds the gate shared
(many at once), building holds it alone. Programs of every process on a node share its memory ledger
(``runtime.ledger``): each reserves its jobs' memory there, and idle training jobs give way to new reservations.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from edgeswarm.bus import Bus, Inbound
    from edgeswarm.devices.emulation import DeviceProfile
    from edgeswarm.messages.training import StageFailureReason
    from edgeswarm.metrics import Metrics
    from edgeswarm.runtime.ledger import MemoryLedger
    from edgeswarm.wire import Message

from edgeswarm.tracing.spans import SpanRecorder


class ComputeGate:
    """Many computes at once, or one build alone. A build that waits goes before computes that come after it, so a
    steady stream of rounds cannot starve an assignment; computes hold the gate only for one forward, backward or
    step, never while they wait for a peer, so a build waits at most for the computes under way."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._computing = 0
        self._building = False
        self._builders_waiting = 0

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Hold the gate shared while running modules."""
        with self._changed:
            while self._building or self._builders_waiting:
                self._changed.wait()
            self._computing += 1
        try:
            yield
        finally:
            with self._changed:
                self._computing -= 1
                self._changed.notify_all()

    @contextmanager
    def building(self) -> Iterator[None]:
        """Hold the gate alone while building (tracing) a model."""
        with self._changed:
            self._builders_waiting += 1
            try:
                while self._building or self._computing:
                    self._changed.wait()
            finally:
                self._builders_waiting -= 1
            self._building = True
        try:
            yield
        finally:
            with self._changed:
                self._building = False
                self._changed.notify_all()


@dataclass(frozen=True)
class WorkerContext:
    """What a program gets from the service it runs in: the bus, who it is (``node``, ``service``), the device it
    computes as, the service's metrics, the process's compute gate, and ``compute_name``, the name of the torch
    device its weights, activations, gradients and optimizer state live on (EDGESWARM_COMPUTE resolved:
    ``edgeswarm.devices.compute``), as a torch device in ``compute``. Tensors leave it only at the wire.
    ``wait_s`` is the longest a program waits for one tensor or unit state from a peer before it gives up (seconds).
    ``ledger`` is the node's memory ledger (``runtime.ledger``), shared by every program and service on the node: a
    program reserves a job's memory there before allocating it and releases it with the job. ``tracer`` records
    the spans of what the programs do (``tracing.spans``); the service publishes them (``workloads.worker_host``)."""

    bus: Bus
    node: str
    service: str
    device: DeviceProfile
    metrics: Metrics
    gate: ComputeGate
    compute_name: str = "cpu"
    wait_s: float = 120.0
    ledger: MemoryLedger = field(kw_only=True)
    tracer: SpanRecorder = field(default_factory=SpanRecorder, kw_only=True)

    @property
    def compute(self) -> torch.device:
        """The torch device the programs compute on (torch is imported on first use: a worker starts without it)."""
        import torch

        return torch.device(self.compute_name)


class WorkerProgram(Protocol):
    """One workload a worker runs, for any number of jobs at once.

    ``handles``: the request schemas it answers (on the service's request topic); ``tensors``: the data-plane
    schemas it takes (on the service's data topic). ``on_request`` and ``on_tensor`` run on the bus's handler
    threads: they must not block (slow work goes to a thread of its own) and must not raise (a bad message is
    logged, counted and answered). ``job_of`` is the job id a body of its schemas belongs to; ``holds`` whether it
    holds that job now; ``refuse`` answers a request with the program's own failure message.
    """

    handles: tuple[type[Message], ...]
    tensors: tuple[type[Message], ...]

    def job_of(self, body: Message) -> str: ...

    def holds(self, job_id: str) -> bool: ...

    def on_request(self, msg: Inbound) -> None: ...

    def on_tensor(self, msg: Inbound) -> None: ...

    def refuse(self, msg: Inbound, job_id: str, reason: str, detail: str) -> None: ...

    def close(self) -> None: ...


class ClosableJob(Protocol):
    """A job a program holds: it can be closed (its threads told to stop, its exchange closed)."""

    def close(self) -> None: ...


J = TypeVar("J", bound=ClosableJob)


class JobTable(Generic[J]):
    """The part of a worker program every kind writes the same way: its jobs by id behind a lock, ``job_of`` (a
    body's ``job_id``), ``holds``, ``close`` (every job closed and its memory given back to the node's ledger under
    ``ledger_name``) and ``refuse`` (counted as ``{refusal_counter}.{reason}``, logged at a bounded rate, answered
    with StageFailed)."""

    ledger_name: ClassVar[str] = ""
    refusal_counter: ClassVar[str] = "requests_refused"

    def __init__(self, ctx: WorkerContext) -> None:
        from edgeswarm.logs import RateLimitedLog

        self.ctx = ctx
        self._lock = threading.Lock()
        self._jobs: dict[str, J] = {}
        self._refusals = RateLimitedLog(logging.getLogger(type(self).__module__))

    def job_of(self, body: Message) -> str:
        return str(getattr(body, "job_id", ""))

    def holds(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._jobs

    def close(self) -> None:
        with self._lock:
            jobs, self._jobs = dict(self._jobs), {}
        for job_id, job in jobs.items():
            job.close()
            self.ctx.ledger.release(self.ledger_name, job_id)

    def refuse(self, msg: Inbound, job_id: str, reason: str, detail: str) -> None:
        from edgeswarm.messages.training import StageFailed

        self.ctx.metrics.count(f"{self.refusal_counter}.{reason}")
        self._refusals.warning(f"refuse.{reason}", "job %s: %s: %s", job_id, reason, detail)
        self.ctx.bus.reply(msg, StageFailed(job_id=job_id, reason=reason, detail=detail[:4096]))  # type: ignore[arg-type]


def build_failure(exc: Exception, what: str, logger: logging.Logger) -> tuple[StageFailureReason, str]:
    """The reason and detail a worker program answers (StageFailed) when ``what`` (building a job's stage or shard,
    in words) failed with ``exc``: ``memory`` for a MemoryBudgetError, ``timeout`` for an ExchangeTimeout (a peer's
    state that never came), ``bad_request`` for any other EdgeswarmError, each with its message; ``error`` for
    anything else, a bug, logged with its traceback on ``logger``."""
    from edgeswarm.errors import EdgeswarmError, MemoryBudgetError
    from edgeswarm.runtime.exchange import ExchangeTimeout

    if isinstance(exc, MemoryBudgetError):
        return "memory", str(exc)
    if isinstance(exc, ExchangeTimeout):
        return "timeout", str(exc)
    if isinstance(exc, EdgeswarmError):
        return "bad_request", str(exc)
    logger.exception("%s failed", what)
    return "error", f"{what} failed: {type(exc).__name__}: {exc}"
