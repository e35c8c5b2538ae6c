"""Workloads as plug-ins: each job kind is registered here, once, with the object that runs it.

A workload (``base.Workload``) names its job kind and spec type, checks a spec at submission, gives the job's
initial progress, and runs the job through a ``base.JobContext`` (the coordinator's common part: the queue,
cancel, take-over after a restart, the retained state and the events). Its planner lives in
``edgeswarm.planning.<workload>``, its coordinator program and worker program with the workload's own package.
Adding a workload is one line in ``KINDS``.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from edgeswarm.errors import ConfigError

if TYPE_CHECKING:
    from edgeswarm.workloads.base import Workload

# Job kind -> "module:class" of its workload, imported only when a job of that kind is parsed or run.
KINDS: dict[str, str] = {
    "train": "edgeswarm.training.workload:TrainWorkload",
    "serve-pipeline": "edgeswarm.serving.workload:ServePipelineWorkload",
}
DEFAULT_KIND = "train"
_loaded: dict[str, Workload] = {}


def workload(kind: str) -> Workload:
    """The workload of job kind ``kind``. Raises ConfigError naming the kinds that exist."""
    if kind not in _loaded:
        try:
            module, cls = KINDS[kind].split(":")
        except KeyError:
            raise ConfigError(f"unknown job kind {kind!r}; the kinds are: {', '.join(sorted(KINDS))}") from None
        _loaded[kind] = getattr(import_module(module), cls)()
    return _loaded[kind]


def worker_programs(service: str) -> list[str]:
    """The worker programs ("module:Class") that the worker service ``service`` hosts: one per kind whose work runs
    there, in registry order, each once."""
    out: list[str] = []
    for kind in KINDS:
        work = workload(kind)
        if work.worker_service == service and work.worker_program and work.worker_program not in out:
            out.append(work.worker_program)
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
        raise ConfigError(f"{source} is invalid:\n  kind: must be one of {', '.join(sorted(KINDS))}")
    spec_type = workload(kind).spec_type
    try:
        return spec_type.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source} is invalid:\n{field_errors(exc)}") from None


def parse_spec_text(text: str, *, source: str = "the job spec") -> BaseModel:
    """The spec of any kind from the text of a YAML or JSON spec. Raises ConfigError (see ``parse_spec``)."""
    return parse_spec(spec_data(text, source=source), source=source)
