"""Job specs: valid ones parse from YAML and JSON; invalid ones are refused with the field and the reason."""

from __future__ import annotations

import json

import pytest
import torch

from edgeswarm.errors import ConfigError
from edgeswarm.hpp.spec import make_optimizer, parse_job
from edgeswarm.values.specs import OptimizerSpec
from helpers import parse_job_text

GOOD = {
    "name": "mnv2-envd",
    "model": {"name": "mobilenetv2", "config": {"width": 0.5}},
    "data": {"kind": "teacher", "size": 2048},
    "global_batch": 256,
    "micro_batches": 8,
    "optimizer": {"name": "momentum", "lr": 0.05},
    "rounds": 20,
}


def test_a_job_reads_from_yaml_and_json() -> None:
    a = parse_job_text(
        "name: mnv2-envd\nmodel: {name: mobilenetv2, config: {width: 0.5}}\ndata: {kind: teacher, size: 2048}\n"
        "global_batch: 256\nmicro_batches: 8\noptimizer: {name: momentum, lr: 0.05}\nrounds: 20\n")
    b = parse_job_text(json.dumps(GOOD))
    assert a == b and a.strategy == "hpp" and a.checkpoint_interval == 1 and a.total_rounds(2048) == 20
    epochs = parse_job({**GOOD, "rounds": None, "epochs": 1.5})
    assert epochs.total_rounds(2048) == 12  # 1.5 * 2048 / 256


@pytest.mark.parametrize(("change", "field", "reason"), [
    ({"global_batch": 0}, "global_batch", "greater than or equal to 1"),
    ({"micro_batches": 7}, "whole spec", "does not split into 7"),
    ({"rounds": None}, "whole spec", "exactly one of rounds and epochs"),
    ({"strategy": "zigzag"}, "strategy", "'hpp', 'dp', 'pp' or 'single'"),
    ({"optimizer": {"name": "sgd", "lr": -1}}, "optimizer.lr", "greater than 0"),
    ({"name": "has space"}, "name", "pattern"),
    ({"colour": "blue"}, "colour", "Extra inputs are not permitted"),
])
def test_an_invalid_job_names_the_field_and_the_reason(change: dict, field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_job({**GOOD, **change})
    text = str(info.value)
    assert field in text and reason in text, text


def test_malformed_text() -> None:
    with pytest.raises(ConfigError, match="not valid YAML or JSON"):
        parse_job_text("{not json")


def test_optimizers_match_the_memory_model() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert type(make_optimizer(OptimizerSpec(name="adam"), params)) is torch.optim.Adam
    sgd = make_optimizer(OptimizerSpec(name="sgd"), params)
    assert sgd.param_groups[0]["momentum"] == 0.0
    assert make_optimizer(OptimizerSpec(name="momentum", momentum=0.8), params).param_groups[0]["momentum"] == 0.8
