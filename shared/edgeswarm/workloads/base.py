"""What every workload gives the coordinator, and what the coordinator gives a running job."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.bus import Bus, Inbound
from edgeswarm.messages.cluster import NodeView
from edgeswarm.messages.jobs import JobEventKind, JobState
from edgeswarm.messages.tracing import SpanRecord
from edgeswarm.service_registry import STAGE_WORKER
from edgeswarm.values.schedule import ScheduleBar
from edgeswarm.wire import Message
from edgeswarm.workloads.views import PlanView, Series, default_plan_view

DataHandler = Callable[[Inbound], None]


@dataclass
class JobContext:
    """A running job's view of the coordinator. ``update(status, event=(kind, detail), plan=..., detail=...,
    **progress_fields)`` publishes the job's retained state (and the event); ``cancel`` is set when the job is
    cancelled or the coordinator stops (``stopping`` tells the two apart: a stopping coordinator leaves the job
    unfinished for the next one). ``previous`` is the retained state of a job an earlier coordinator left
    unfinished, to take over. A job that takes messages on the coordinator's data topic registers its handler
    with ``on_data``; it is removed when the job ends."""

    bus: Bus
    node: str
    store_node: str | None
    timeout_s: float
    cancel: threading.Event
    stopping: threading.Event
    update: Callable[..., JobState]
    state: Callable[[], JobState]
    previous: JobState | None = None
    data_handler: DataHandler | None = field(default=None)

    def on_data(self, handler: DataHandler) -> None:
        """Route this job's messages on the coordinator's data topic to ``handler`` (on the bus's threads)."""
        self.data_handler = handler


class JobSummary(BaseModel):
    """A job's state in a line, for the CLI's job table and the dashboard: ``progress`` (how far it is), ``figures``
    (its latest measured figures, "-" when none) and, for kinds that run in rounds, ``round`` (rounds done) with
    ``round_measured`` set once that round's figures are in the state."""

    model_config = ConfigDict(frozen=True)

    progress: str = Field(max_length=256)
    figures: str = Field(default="-", max_length=512)
    round: int = Field(default=0, ge=0)
    round_measured: bool = False


def figures_line(*figures: str) -> str:
    """The non-empty ``figures`` joined for a summary's ``figures``, or "-" when there are none."""
    return "  ".join(f for f in figures if f) or "-"


class Workload(ABC):
    """One job kind and everything about it. Its spec, plan and progress types (``plan_type`` None: its jobs carry
    no plan in their state); ``planner``, the "module:attr" of its ``planning.entry.PlannerEntry`` (the planner
    service's functions for its requests; empty: it plans nothing there); ``worker_service`` and ``worker_program``,
    what hosts its work on the devices; ``run``, its coordinator program; ``summary``, its state in a line.
    ``command`` is the CLI command that submits it (``train`` follows rounds to the end, ``serve`` deploys and
    returns, and ``infer`` then asks it). ``exclusive`` jobs run one at a time, in submission order; the others start
    at once. ``data_schemas`` are the messages its jobs take on the coordinator's data topic (routed by their
    ``job_id``)."""

    kind: ClassVar[str]
    spec_type: ClassVar[type[BaseModel]]
    progress_type: ClassVar[type[BaseModel]]
    plan_type: ClassVar[type[BaseModel] | None] = None
    planner: ClassVar[str] = ""
    # "module:function(args, cluster, tools) -> exit code": its plan shown by `edgeswarm plan` (``tools``: a
    # ``workloads.commands.CommandTools``).
    plan_cli: ClassVar[str] = ""
    # "module:function(parser)": the options its plan_cli reads, added to `edgeswarm plan`'s (empty: none of its own).
    plan_arguments: ClassVar[str] = ""
    # "module:function(args, spec, text, tools) -> exit code": how `edgeswarm train` runs a job of this kind (empty:
    # submitted and, with --wait, followed to its end the common way), and "module:function(parser)", its options.
    train_cli: ClassVar[str] = ""
    train_arguments: ClassVar[str] = ""
    # "module:function(args, bus, state, tools) -> exit code": how `edgeswarm infer` asks a running job of a serving
    # kind (``tools``: a ``workloads.commands.CommandTools``; empty: the kind takes no requests from the command line).
    infer_cli: ClassVar[str] = ""
    # "module:function(parser)": the options its infer_cli reads beyond those every serving kind's does, added to
    # `edgeswarm infer`'s (empty: none of its own).
    infer_arguments: ClassVar[str] = ""
    # "module:function(bus) -> gateway.backend.TextModels": the language models this kind's running jobs serve, as
    # the gateway service asks them (empty: it serves none); imported only by the gateway.
    text_models: ClassVar[str] = ""
    # Its own verbs, each ``edgeswarm NAME`` ("module:Class" of a ``workloads.commands.Command``), and its benchmarks,
    # each ``edgeswarm bench NAME`` (of a ``workloads.commands.Bench``); imported only by the command line.
    commands: ClassVar[tuple[str, ...]] = ()
    benches: ClassVar[tuple[str, ...]] = ()
    # Its sections of ``edgeswarm bench peers`` ("module:Class" of a ``workloads.peers.PeerSection``): the kind beside
    # a tool its users would pick instead; imported only by the command line.
    peers: ClassVar[tuple[str, ...]] = ()
    # False: ``plan_cli`` reads its own profiles and gets cluster None (no zoo model is profiled first).
    plan_profiles_zoo: ClassVar[bool] = True
    command: ClassVar[Literal["train", "serve"]] = "train"
    exclusive: ClassVar[bool] = True
    # A small spec of this kind that runs on any cluster in seconds, with ``{name}`` for the job's name: the
    # contract test every kind must pass runs it, and the docs show it.
    example: ClassVar[str] = ""
    data_schemas: ClassVar[tuple[type[Message], ...]] = ()
    # The service that hosts this kind's work on the devices (a name in the service registry) and the worker program
    # it runs there ("module:Class", a ``runtime.program.WorkerProgram`` made from a ``WorkerContext``; imported only
    # by that service).
    worker_service: ClassVar[str] = STAGE_WORKER
    worker_program: ClassVar[str] = ""
    # The programs a kind runs on services other than its worker service, by service name ("module:Class" each): a
    # kind whose work has two halves on two kinds of node (split learning's device half and its edge server's).
    other_programs: ClassVar[dict[str, str]] = {}
    # What one unit of ``planned_schedule`` is, and how its spans are grouped: by round, or by item (a serving
    # pipeline's micro-batch, the spans' ``micro_batch``).
    schedule_unit: ClassVar[Literal["round", "item"]] = "round"

    def programs(self) -> dict[str, str]:
        """Every program of this kind by the service that hosts it: ``worker_program`` on ``worker_service`` and the
        ``other_programs``."""
        return {**({self.worker_service: self.worker_program} if self.worker_program else {}), **self.other_programs}

    def problems(self, spec: Any, members: list[NodeView]) -> list[str]:
        """What stops ``spec`` from running on a cluster whose online ``worker_service`` instances are on ``members``
        (beyond its schema, which parsing checked): every problem, each an actionable sentence. Empty: it may
        run."""
        return []

    def model_name(self, spec: Any) -> str:
        """The model a job of ``spec`` computes with, for its state (by default the spec's ``model.name``)."""
        return str(spec.model.name)

    def initial_progress(self, spec: Any) -> BaseModel:
        """The progress part of a job that has not started (by default the progress type's defaults)."""
        return self.progress_type()

    @abstractmethod
    def summary(self, state: JobState) -> JobSummary:
        """The job's state in a line (see JobSummary). ``state.progress`` is this kind's ``progress_type``."""

    def stage_devices(self, plan: BaseModel) -> list[list[str]]:
        """The devices of each stage (or shard) of ``plan`` (this kind's ``plan_type``), for listings."""
        return []

    def planned_schedule(self, state: JobState) -> list[ScheduleBar]:
        """One round of ``state``'s plan as planned bars (``source`` "planned", times in seconds from the round's
        start, lanes named as its workers name their spans' lanes), drawn beside the measured round. Empty by
        default: the kind plans no schedule."""
        return []

    def explained_spans(self, state: JobState, spans: list[SpanRecord]) -> tuple[list[SpanRecord], list[int]]:
        """What ``edgeswarm explain`` lines up with ``planned_schedule``: ``spans`` (the job's, as its workers
        recorded them) named as the plan names its operations, and the units measured to the end (round or item
        numbers). By default the spans as they are and, by round, every round all of the plan's devices finished
        but the first (it builds and warms up); by item, every item."""
        if self.schedule_unit == "item":
            return spans, sorted({s.micro_batch for s in spans if s.micro_batch is not None})
        from edgeswarm.tracing.schedule import complete_rounds

        nodes = [n for group in self.stage_devices(state.plan) for n in group] if state.plan is not None else []
        rounds = complete_rounds(spans, nodes)
        return spans, rounds[1:] if len(rounds) > 1 else rounds

    def unit_seconds(self, state: JobState) -> tuple[float | None, float | None]:
        """The job's own predicted and measured seconds per ``schedule_unit`` (a round; a serving item), None where
        it has none yet: ``edgeswarm explain`` sets them beside the planned schedule and the spans."""
        return None, None

    def plan_view(self, state: JobState) -> PlanView | None:
        """The plan of ``state`` as the dashboard draws it (None: no plan yet). By default a chain of
        ``stage_devices``, so a kind without its own drawing is still drawn."""
        if state.plan is None:
            return None
        try:
            stages = self.stage_devices(state.plan)
        except (AssertionError, AttributeError, TypeError):
            return None  # a plan of a kind not installed here (OpaqueValue): nothing to draw from
        return default_plan_view(stages, int(getattr(state.plan, "epoch", 0) or 0))

    def series(self, state: JobState) -> list[Series]:
        """The figures ``state`` carries now, for the dashboard's charts. A kind whose progress holds only its latest
        round gives that round's point: the dashboard keeps every point it has seen, by ``x``. None by default."""
        return []

    @abstractmethod
    def describe(self, spec: Any) -> str:
        """One line for the ``submitted`` event."""

    @abstractmethod
    def run(self, ctx: JobContext, spec: Any) -> tuple[JobEventKind, str] | None:
        """Run the job to its end (a serving job: until it is cancelled). Returns the final event, or None. Raises
        JobCancelled when ``ctx.cancel`` is set, any other exception to fail the job with its message."""

    def refuse_data(self, bus: Bus, msg: Inbound, state: JobState | None) -> None:
        """Answer a message on the data topic for a job that is not running: ``state`` is its state, None for a
        job the coordinator does not know. No answer by default."""
        return None
