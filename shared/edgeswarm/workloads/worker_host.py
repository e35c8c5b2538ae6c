"""The generic worker service: it hosts the worker programs of every job kind whose work runs in it.

A worker service only subscribes, routes and answers what no program takes. Its programs are those the job kinds
name for it (``edgeswarm.workloads.worker_programs(service)``: each kind's ``worker_service`` and
``worker_program``), each made once with the service's ``WorkerContext``: ``Program(context)``. Each request on the
service's request topic and each tensor on its data-plane topic goes to the program registered for the message's
schema, and the program routes it to the job it names (``runtime.program``). A job id belongs to one program at a
time: a request of one program for a job another program holds is refused, a tensor dropped.

Programs share the process's ``ComputeGate`` (building a model holds it alone: torch.fx tracing patches
``Module.__call__`` for every thread) and the node's memory ledger (``runtime.ledger``: every program reserves its
jobs' memory there; the service's status carries the bytes reserved on the node), and nothing else: jobs of
different programs run at the same time.

A new worker service is a subclass that sets ``name`` and an entry in the service registry
(``edgeswarm.service_registry``); a job kind then names it as its ``worker_service``. A worker service that no kind
names yet starts and answers probes like any other, with no program.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.errors import ConfigError
from edgeswarm.plugins import load_target
from edgeswarm.runtime.ledger import MemoryLedger, ledger_path, node_ledger
from edgeswarm.runtime.program import ComputeGate, WorkerContext, WorkerProgram
from edgeswarm.runtime.service import Service
from edgeswarm.tracing.spans import SpanRecorder

log = logging.getLogger(__name__)

SPANS_INTERVAL_S = 0.5  # how often the programs' recorded spans are published


class WorkerService(Service):
    """A service that hosts worker programs (see the module docstring). Subclasses set ``name``."""

    computes = True

    def peer_wait_s(self) -> float:
        """The longest wait for one tensor or unit state from a peer that the programs get (``WorkerContext.wait_s``,
        seconds): ``EDGESWARM_PEER_WAIT_S``."""
        return self.settings.peer_wait_s

    def program_targets(self) -> list[str]:
        """The ``"module:Class"`` of every program this service hosts: one per job kind whose work runs here."""
        from edgeswarm.workloads import worker_programs  # the kinds sit above the runtime

        return worker_programs(self.name)

    @property
    def memory_ledger(self) -> MemoryLedger:
        """The node's memory ledger, this process's object of it (one per node: every worker service of the process
        shares it, and the file behind it is shared with the node's other processes)."""
        return node_ledger(self.node, self.device.memory_budget_bytes,
                           ledger_path(self.settings.health_dir, self.node, self.settings.hub_url))

    def reserved_memory_bytes(self) -> int:
        return self.memory_ledger.reserved_bytes()

    def setup(self) -> None:
        self.watch_reserved_memory()
        assert self.compute_name is not None  # resolved when the service was made (computes)
        self.tracer = SpanRecorder(self.node, self.name)
        context = WorkerContext(bus=self.bus, node=self.node, service=self.name, device=self.device,
                                metrics=self.metrics, gate=ComputeGate(), compute_name=self.compute_name,
                                wait_s=self.peer_wait_s(), ledger=self.memory_ledger, tracer=self.tracer)
        self._programs: list[WorkerProgram] = [self._make(target, context) for target in self.program_targets()]
        if not self._programs:
            log.info("%s hosts no worker program yet: no job kind names it as its worker service", self.name)
        request = topics.request(self.node, self.name)
        data = topics.data(self.node, self.name)
        for program in self._programs:
            self.bus.subscribe(request, partial(self._route, program, program.on_request), schemas=program.handles)
            if program.tensors:
                self.bus.subscribe(data, partial(self._route, program, program.on_tensor), schemas=program.tensors,
                                   plane="data")
        self.every(SPANS_INTERVAL_S, self.publish_spans, "spans")

    def publish_spans(self) -> None:
        """Publish what the programs recorded since the last call: one SpanBatch per job (several for a job with
        more spans than a batch holds) on this service's spans topic, QoS 1."""
        tracer: SpanRecorder | None = getattr(self, "tracer", None)
        if tracer is None or not len(tracer):
            return
        batches = tracer.batches()
        self.metrics.gauge("spans_dropped", tracer.spans_dropped)
        topic = topics.spans(self.node, self.name)
        for batch in batches:
            self.bus.publish(topic, batch, qos=1)
        self.metrics.count("span_batches_out", len(batches))

    def _make(self, target: str, context: WorkerContext) -> WorkerProgram:
        """The program ``target`` names, made with ``context``. Raises ConfigError when it cannot be loaded or made,
        so the service stops at start with the program's name rather than running without it."""
        program_type = load_target(target, f"the worker program of {self.name}")
        try:
            return program_type(context)  # type: ignore[no-any-return]
        except Exception as exc:  # noqa: BLE001 - any failure of a program's constructor is reported with its name
            raise ConfigError(f"the worker program {target} of {self.name} cannot be made: "
                              f"{type(exc).__name__}: {exc}") from exc

    def teardown(self) -> None:
        for program in getattr(self, "_programs", []):
            program.close()
        try:
            self.publish_spans()  # the last ones, while the bus is still up
        except Exception as exc:  # noqa: BLE001 - stopping goes on without them
            log.debug("the last spans were not published: %s", exc)

    @property
    def programs(self) -> tuple[WorkerProgram, ...]:
        """The programs this service hosts, in the order of the job kinds (empty before setup)."""
        return tuple(getattr(self, "_programs", ()))

    def _route(self, program: WorkerProgram, handler: Callable[[Inbound], None], msg: Inbound) -> None:
        """Hand ``msg`` to ``program`` unless its job belongs to another program (a request is then refused; a
        tensor dropped)."""
        job_id = program.job_of(msg.body)
        other = next((p for p in self._programs if p is not program and p.holds(job_id)), None)
        if other is not None:
            self.metrics.count("requests_refused.job_kind")
            detail = (f"{self.node} holds job {job_id} as {type(other).__name__}, not {type(program).__name__}: "
                      f"a {type(msg.body).__name__} does not apply to it")
            log.error("%s from %s: %s", type(msg.body).__name__, msg.sender, detail)
            if handler == program.on_request:
                program.refuse(msg, job_id, "bad_request", detail)
            return
        handler(msg)
