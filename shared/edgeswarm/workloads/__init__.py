"""Workloads as plug-ins: each job kind is registered once, with the object that knows everything about it.

A workload (``base.Workload``) names its job kind and carries its spec, plan and progress types, its planner
(``planner``: the planner service's functions for its requests), the service and worker program that host its work on
the devices, its coordinator program (``run``, through a ``base.JobContext``: the coordinator's common part, i.e.
the queue, cancel, take-over after a restart, the retained state and the events) and a one-line summary of a job's
state for the CLI and the dashboard. The coordinator, the planner service, the worker services, job-state
validation and the CLI read it from here; nothing else names a kind.

Adding a workload is one entry: a line in ``BUILTIN`` for edgeswarm's own, or an entry point in the group
``edgeswarm.workloads`` (``edgeswarm.plugins``) from another installed package.
"""

from __future__ import annotations

from collections.abc import Collection
from functools import lru_cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from edgeswarm.errors import ConfigError, InvalidMessageError
from edgeswarm.messages.jobs import DEFAULT_KIND, JobState
from edgeswarm.plugins import WORKLOAD_GROUP, discovered, load_target

if TYPE_CHECKING:
    from edgeswarm.workloads.base import Workload
    from edgeswarm.workloads.commands import Command
    from edgeswarm.workloads.peers import PeerSection


class _Named(Protocol):
    name: str


E = TypeVar("E", bound=_Named)

# Job kind -> "module:class" of its workload, imported only when a job of that kind is parsed or run. Kinds are
# named for their algorithm.
BUILTIN: dict[str, str] = {
    "train-hpp": "edgeswarm.hpp.workload:TrainWorkload",
    "serve-pipeline": "edgeswarm.pipeline_serve.workload:ServePipelineWorkload",
    "serve-hmp": "edgeswarm.hmp.workload:HmpWorkload",
    "train-splitfed": "edgeswarm.splitfed.workload:SplitfedWorkload",
}
# Older names that specs and states may still carry -> the kind they mean. A spec without ``kind`` is ``train``.
ALIASES: dict[str, str] = {"train": "train-hpp"}
_loaded: dict[str, Workload] = {}


@lru_cache(maxsize=1)
def kinds() -> dict[str, str]:
    """Every job kind: the built-in ones, then those of installed plug-ins (a plug-in may not take a built-in
    kind's name: it is left out, and using it names the clash)."""
    out = dict(BUILTIN)
    for name, target in discovered(WORKLOAD_GROUP).items():
        out.setdefault(name, target)
    return out


def __getattr__(name: str) -> Any:
    # KINDS (kind -> "module:class", built in plus plug-ins) is read when asked for, not at import: the plug-ins'
    # entry points are found then, as the service registry's SERVICES is.
    if name == "KINDS":
        return MappingProxyType(kinds())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def canonical(kind: str) -> str:
    """The kind an alias stands for (``train`` -> ``train-hpp``); any other name as it is."""
    return ALIASES.get(kind, kind)


def workload(kind: str) -> Workload:
    """The workload of job kind ``kind`` (or of the kind an alias stands for). Raises ConfigError naming the kinds
    that exist, or the plug-in that cannot be loaded."""
    kind = canonical(kind)
    if kind not in _loaded:
        registry = kinds()
        if kind not in registry:
            raise ConfigError(f"unknown job kind {kind!r}; the kinds are: {', '.join(sorted([*registry, *ALIASES]))}")
        builtin = BUILTIN.get(kind)
        plugin = discovered(WORKLOAD_GROUP).get(kind)
        if builtin is not None and plugin is not None and plugin != builtin:
            raise ConfigError(f"an installed plug-in registers job kind {kind!r} ({plugin}), which is edgeswarm's "
                              "own: rename the plug-in's kind")
        cls = load_target(registry[kind], f"job kind {kind!r}")
        try:
            made = cls()
        except Exception as exc:  # noqa: BLE001 - a plug-in's class that cannot be made is the plug-in's fault
            raise ConfigError(f"job kind {kind!r} comes from {registry[kind]!r} (entry point {kind} of group "
                              f"{WORKLOAD_GROUP}), which cannot be constructed: {type(exc).__name__}: {exc}") from None
        if getattr(made, "kind", None) != kind:
            raise ConfigError(f"job kind {kind!r} is registered as {registry[kind]}, whose kind is "
                              f"{getattr(made, 'kind', None)!r}")
        _loaded[kind] = made
    return _loaded[kind]


def installed_workload(kind: str) -> Workload | None:
    """The workload of ``kind`` if it is installed here and loads; None otherwise (a client without a plug-in
    still lists that plug-in's jobs)."""
    try:
        return workload(kind)
    except ConfigError:
        return None


def typed_state(state: JobState) -> JobState:
    """``state`` with its plan and progress parsed as its kind's own types (``plan_type``, ``progress_type``); as it
    is for a kind not installed here, whose parts stay opaque. Every state read off the wire goes through this once.
    Raises InvalidMessageError when they do not fit the kind's types: a broken or hostile writer's state, refused
    as any message that does not validate."""
    work = installed_workload(state.kind)
    if work is None:
        return state
    update: dict[str, BaseModel] = {}
    try:
        if state.plan is not None and work.plan_type is not None and not isinstance(state.plan, work.plan_type):
            update["plan"] = work.plan_type.model_validate(state.plan.model_dump())
        if not isinstance(state.progress, work.progress_type):
            update["progress"] = work.progress_type.model_validate(state.progress.model_dump())
    except ValidationError as exc:
        raise InvalidMessageError(f"the state of {state.kind} job {state.job_id} does not fit its kind:\n"
                                  f"{field_errors(exc)}") from None
    return state.model_copy(update=update) if update else state


def kind_commands(which: Literal["commands", "benches"], taken: Collection[str] = ()
                  ) -> tuple[list[Command], list[str]]:
    """Every installed kind's ``commands`` (its verbs) or ``benches`` (its benchmarks), in registry order, and one
    line for each that cannot be offered: a kind or class that does not load, or a name in ``taken`` or already
    another's."""
    from edgeswarm.workloads.commands import Bench, Command

    base = Bench if which == "benches" else Command
    what = "a benchmark" if which == "benches" else "a command"
    return _kind_entries(which, base, what, taken)


def kind_peers(taken: Collection[str] = ()) -> tuple[list[PeerSection], list[str]]:
    """Every installed kind's sections of ``edgeswarm bench peers`` (``Workload.peers``), in registry order, and one
    line for each that cannot be offered (as ``kind_commands``)."""
    from edgeswarm.workloads.peers import PeerSection

    return _kind_entries("peers", PeerSection, "a peer section", taken)


def _kind_entries(which: str, base: type[E], what_kind: str, taken: Collection[str]) -> tuple[list[E], list[str]]:
    found: list[E] = []
    problems: list[str] = []
    names = set(taken)
    for kind in kinds():
        try:
            targets = getattr(workload(kind), which)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        what = f"{what_kind} of job kind {kind!r}"
        for target in targets:
            try:
                cls = load_target(target, what)
                if not (isinstance(cls, type) and issubclass(cls, base)):
                    raise ConfigError(f"{what}, {target!r}, is not a {base.__name__} subclass")
                entry = cls()
            except ConfigError as exc:
                problems.append(str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - a plug-in's class that cannot be made is the plug-in's
                problems.append(f"{what}, {target!r}, cannot be made: {type(exc).__name__}: {exc}")
                continue
            if entry.name in names:
                problems.append(f"job kind {kind!r} names {what_kind} {entry.name!r}, a name already taken")
                continue
            names.add(entry.name)
            found.append(entry)
    return found, problems


def worker_programs(service: str) -> list[str]:
    """The worker programs ("module:Class") that the worker service ``service`` hosts: one per kind whose work runs
    there, in registry order, each once. A plug-in kind that does not load is left out (its jobs fail on their
    own)."""
    out: list[str] = []
    for kind in kinds():
        work = installed_workload(kind)
        program = work.programs().get(service) if work is not None else None
        if program and program not in out:
            out.append(program)
    return out


def field_errors(exc: ValidationError) -> str:
    """Every invalid field of a spec and why, one indented line each."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(the whole spec)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def spec_data(text: str, *, source: str) -> Any:
    """The parsed YAML or JSON of a job spec. Raises ConfigError for bad syntax."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML or JSON: {exc}") from None
    except RecursionError:  # PyYAML composes nested collections recursively: "[[[[..." a few thousand deep
        raise ConfigError(f"{source} nests its collections too deeply to be a job spec") from None


def parse_spec(data: Any, *, source: str = "the job spec") -> BaseModel:
    """The spec of any kind from parsed YAML/JSON: its ``kind`` (default ``train``) picks the workload. Raises
    ConfigError listing every invalid field and why."""
    kind = data.get("kind", DEFAULT_KIND) if isinstance(data, dict) else DEFAULT_KIND
    if not isinstance(kind, str):
        raise ConfigError(f"{source} is invalid:\n  kind: must be one of {', '.join(sorted(kinds()))}")
    spec_type = workload(kind).spec_type
    try:
        return spec_type.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source} is invalid:\n{field_errors(exc)}") from None


def parse_spec_text(text: str, *, source: str = "the job spec") -> BaseModel:
    """The spec of any kind from the text of a YAML or JSON spec. Raises ConfigError (see ``parse_spec``)."""
    return parse_spec(spec_data(text, source=source), source=source)
