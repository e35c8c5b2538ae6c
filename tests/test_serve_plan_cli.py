"""``edgeswarm plan --kind serve-pipeline`` and ``edgeswarm bench serving --sim`` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgeswarm.planning.serve.types import ServePlan
from test_plan_cli import _saved, edgeswarm


def test_serve_plan_from_saved_profiles_prints_table_and_json(tmp_path: Path) -> None:
    _saved(tmp_path / "profiles")
    out = edgeswarm("plan", "--kind", "serve-pipeline", "--model", "synthetic-cnn", "--profiles",
                    str(tmp_path / "profiles"), "--serve-micro-batch", "4")
    assert out.returncode == 0, out.stderr
    for text in ("serve-pipeline plan", "memory used / budget", "transfer in (s)", "samples/s", "bottleneck",
                 "latency"):
        assert text in out.stdout
    js = edgeswarm("plan", "--kind", "serve-pipeline", "--model", "synthetic-cnn", "--profiles",
                   str(tmp_path / "profiles"), "--serve-micro-batch", "4", "--json", "--exclude", "nano-1")
    assert js.returncode == 0, js.stderr
    plan = ServePlan.model_validate_json(js.stdout)
    plan.validate_stages(30)
    assert plan.micro_batch_size == 4 and "nano-1" not in plan.devices
    assert plan.bottleneck_s == max(max(s.compute_s for s in plan.stages), max(s.transfer_in_s for s in plan.stages))


def test_serve_plan_predicts_latency_and_throughput_at_an_offered_load(tmp_path: Path) -> None:
    """``--offered-load``: below capacity every sample is served and a request waits longer than unloaded; above it
    the plan is saturated. The JSON holds the plan and the prediction."""
    from edgeswarm.planning.serve.load import LoadPrediction, at_offered_load

    _saved(tmp_path / "profiles")
    base = ("plan", "--kind", "serve-pipeline", "--model", "synthetic-cnn", "--profiles", str(tmp_path / "profiles"),
            "--serve-micro-batch", "4")
    plan = ServePlan.model_validate_json(edgeswarm(*base, "--json").stdout)
    half = plan.throughput_per_s / 2
    js = edgeswarm(*base, "--json", "--offered-load", str(half))
    assert js.returncode == 0, js.stderr
    both = json.loads(js.stdout)
    assert ServePlan.model_validate(both["plan"]) == plan
    load = LoadPrediction.model_validate(both["at_offered_load"])
    assert load == at_offered_load(plan, half) and load.latency_s is not None
    assert load.throughput_per_s == half and load.latency_s > plan.latency_s and load.utilisation == pytest.approx(0.5)
    text = edgeswarm(*base, "--offered-load", str(half)).stdout
    assert f"at {half:g} samples/s offered: serves all of it" in text and "50% busy" in text, text
    over = edgeswarm(*base, "--offered-load", str(3 * plan.throughput_per_s)).stdout
    assert "saturated" in over and f"{plan.throughput_per_s:.1f} samples/s" in over, over
    bad = edgeswarm(*base, "--offered-load", "-1")
    assert bad.returncode != 0 and "--offered-load" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_plan_explains_a_bad_option(tmp_path: Path) -> None:
    _saved(tmp_path / "profiles")
    out = edgeswarm("plan", "--kind", "serve-pipeline", "--model", "synthetic-cnn", "--profiles",
                    str(tmp_path / "profiles"), "--serve-micro-batch", "4096")
    assert out.returncode == 1 and "batch size" in out.stderr


def test_bench_serving_quick_writes_json(tmp_path: Path) -> None:
    out = edgeswarm("bench", "serving", "--sim", "--quick", "--trials", "2", "--ratio-trials", "5", "--json",
                    str(tmp_path / "s.json"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "s.json").read_text())
    assert {"grid", "r3", "r4", "r6", "r7"} <= report.keys()
    assert not any(r["normative_over_capacity"] for r in report["r7"])
    assert "R4 at 50 nodes" in out.stdout
