"""``edgeswarm plan --kind serve-pipeline`` and ``edgeswarm bench serving --sim`` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

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
