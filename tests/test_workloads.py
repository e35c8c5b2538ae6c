"""Job kinds: the registry parses each kind's spec, refuses what cannot run with every problem, and a job state
is the common fields plus its kind's progress."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from edgeswarm.errors import ConfigError, InvalidMessageError
from edgeswarm.hmp.spec import HmpSpec
from edgeswarm.hpp.spec import JobSpec, TrainProgress
from edgeswarm.messages.cluster import NodeView
from edgeswarm.messages.jobs import JobState, OpaqueValue
from edgeswarm.models.zoo import build_model
from edgeswarm.pipeline_serve.spec import ServeProgress, ServeSpec
from edgeswarm.splitfed.spec import SplitfedSpec
from edgeswarm.splitfed.workload import SplitfedWorkload
from edgeswarm.workloads import KINDS, installed_workload, parse_spec_text, typed_state, workload
from edgeswarm.workloads.base import Workload
from edgeswarm.workloads.commands import Bench, CommandTools

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_every_example_parses_as_its_kind() -> None:
    kinds = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        spec = parse_spec_text(path.read_text(), source=str(path))
        kinds[path.name] = type(spec)
    assert kinds == {"lenet5-env-d.yaml": JobSpec, "mobilenetv2-env-d.yaml": JobSpec,
                     "serve-mobilenetv2.yaml": ServeSpec, "serve-hmp-gpt2.yaml": HmpSpec,
                     "serve-hmp-minilm.yaml": HmpSpec, "splitfed-digits.yaml": SplitfedSpec}


def test_a_spec_without_kind_is_training_and_an_unknown_kind_names_the_kinds() -> None:
    spec = parse_spec_text("name: t\nmodel: {name: mlp}\ndata: {kind: teacher}\nrounds: 1\n")
    assert isinstance(spec, JobSpec) and spec.kind == "train"
    with pytest.raises(ConfigError, match="unknown job kind 'fl'; the kinds are: serve-hmp, serve-pipeline, train"):
        parse_spec_text("kind: fl\nname: g\n")
    with pytest.raises(ConfigError, match="micro_batch_size"):
        parse_spec_text("kind: serve-pipeline\nname: s\nmodel: {name: mlp}\nmicro_batch_size: 0\n")


def test_each_kind_checks_its_model_and_its_fit() -> None:
    node = NodeView(node="pi-1", state="online", device_class="rpi4", memory_budget_bytes=1 << 20,
                    free_memory_bytes=1 << 20, services=())
    serve = parse_spec_text("kind: serve-pipeline\nname: s\nmodel: {name: mlp, config: {hidden: 1024}}\n")
    problems = workload("serve-pipeline").problems(serve, [node])
    assert len(problems) == 1 and "fits nowhere" in problems[0] and "1.0 MiB" in problems[0]
    assert workload("serve-pipeline").problems(serve, []) == []  # no devices known yet: nothing to compare
    unknown = parse_spec_text("kind: serve-pipeline\nname: s\nmodel: {name: resnet9000}\n")
    assert "unknown model 'resnet9000'" in workload("serve-pipeline").problems(unknown, [])[0]
    train = parse_spec_text("name: t\nmodel: {name: mlp, config: {hidden: 128}}\ndata: {kind: teacher}\n"
                            "rounds: 1\noptimizer: {name: adam}\n")
    # Adam keeps two states per weight beside the weight and its gradient: 4x the weights, not 1x.
    weights = sum(p.numel() * 4 for p in build_model(train.model).parameters())
    tight = node.model_copy(update={"memory_budget_bytes": 2 * weights})
    assert workload("serve-pipeline").problems(serve.model_copy(update={"model": train.model}), [tight]) == []
    assert "fits nowhere" in workload("train").problems(train, [tight])[0]


def test_a_job_state_is_common_fields_and_its_kinds_progress() -> None:
    state = JobState(job_id="s", kind="serve-pipeline", status="running", model="mlp",
                     progress=ServeProgress(answered=3), submitted_at=0.0, updated_at=0.0)
    assert state.progress_as(ServeProgress).answered == 3
    with pytest.raises(TypeError, match="not one with TrainProgress"):
        _ = state.progress_as(TrainProgress)
    wire = JobState.model_validate_json(state.model_dump_json())  # as any subscriber decodes it
    assert isinstance(wire.progress, OpaqueValue)  # the message layer knows no kind's types
    assert typed_state(wire).progress_as(ServeProgress).answered == 3
    train = typed_state(JobState.model_validate_json(JobState(job_id="t", status="queued", model="mlp",
                                                              submitted_at=0.0, updated_at=0.0).model_dump_json()))
    assert isinstance(train.progress, TrainProgress) and train.kind == "train"
    broken = JobState(job_id="b", kind="serve-pipeline", status="running", model="mlp", submitted_at=0.0,
                      updated_at=0.0, progress={"answered": "many"})
    with pytest.raises(InvalidMessageError, match="serve-pipeline job b does not fit its kind:\n  answered"):
        typed_state(broken)
    assert set(KINDS) == {"train-hpp", "serve-pipeline", "serve-hmp", "train-splitfed"}
    assert workload("train") is workload("train-hpp")  # the old name of HPP training stays an alias


class HalfWritten(Workload):
    """A plug-in's kind that forgot ``describe``, ``summary`` and ``run``: it cannot be constructed."""

    kind = "half-written"
    spec_type = JobSpec
    progress_type = TrainProgress


def test_a_plugin_kind_that_cannot_be_made_is_named_with_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    import edgeswarm.workloads as registry
    from edgeswarm.cli.train import _progress_cells

    monkeypatch.setattr(registry, "kinds", lambda: {**registry.BUILTIN, "half-written": "test_workloads:HalfWritten"})
    with pytest.raises(ConfigError, match=r"job kind 'half-written' comes from 'test_workloads:HalfWritten' \(entry "
                                          r"point half-written of group edgeswarm.workloads\), which cannot be "
                                          r"constructed: TypeError: Can't instantiate abstract class HalfWritten"):
        workload("half-written")
    # Everything that lists jobs goes on: the kind is "not installed here", the others are as they were.
    assert installed_workload("half-written") is None and installed_workload("train-hpp") is not None
    state = JobState(job_id="h", kind="half-written", status="running", model="m", submitted_at=1.0, updated_at=2.0,
                     progress={"anything": 1})
    assert _progress_cells(state) == ("(job kind half-written is not installed here)", "-")


class NotABench:
    """Named as a benchmark by a plug-in by mistake."""


class TakenName(Bench):
    name = "splitfed"  # the built-in split learning kind's
    help = "a plug-in's benchmark under a name already taken"

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        return 0


class OwnBench(TakenName):
    name = "clash-own"


class ClashingBenches(SplitfedWorkload):
    kind = "bench-clash"
    benches = ("test_workloads:NotABench", "test_workloads:TakenName", "test_workloads:OwnBench",
               "test_workloads:NoSuchBench")


def test_a_kinds_benchmarks_that_cannot_be_offered_are_each_named_and_the_rest_are(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import edgeswarm.workloads as registry
    from edgeswarm.workloads import kind_commands

    clash = {"bench-clash": "test_workloads:ClashingBenches"}
    monkeypatch.setattr(registry, "kinds", lambda: {**registry.BUILTIN, **clash})
    benches, problems = kind_commands("benches", taken={"transport"})
    names = [b.name for b in benches]
    assert {"training", "serving", "hmp", "splitfed", "clash-own"} <= set(names) and names.count("splitfed") == 1
    text = "\n".join(problems)
    assert "'test_workloads:NotABench', is not a Bench subclass" in text
    assert "names a benchmark 'splitfed', a name already taken" in text
    assert "'test_workloads:NoSuchBench', which cannot be loaded" in text
    commands, problems = kind_commands("commands")
    assert [c.name for c in commands] == ["export"] and not problems
