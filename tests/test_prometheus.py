"""Metrics: histograms and their report, the catalogue's naming, the accelerator sampler, the deploy files, and the
hub's Prometheus exposition made of what real services publish through a real broker."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from edgeswarm import topics
from edgeswarm.dashboard.observer import Observer
from edgeswarm.dashboard.prometheus import PrometheusCollector
from edgeswarm.devices.accelerator import AcceleratorSampler, parse_smi, read_jetson
from edgeswarm.messages import ClusterView, JobState, MetricsReport, NodeView, ProfileReport, ServiceView
from edgeswarm.messages.metrics import MAX_BUCKETS, MAX_HISTOGRAMS, Histogram
from edgeswarm.metrics import Metrics
from edgeswarm.observability import catalogue, record
from edgeswarm.observability.catalogue import CATALOGUE, MetricDef, Source
from edgeswarm.observability.record import observe
from helpers import REPO, wait_until

# --- histograms --------------------------------------------------------------------------------------------------


def test_histogram_buckets_are_cumulative_with_the_catalogues_bounds() -> None:
    m = Metrics()
    for value in (0.001, 0.0011, 0.3, 500.0):  # a value equal to a bound counts in that bound's bucket
        observe(m, catalogue.REQUEST_DURATION + "j.1", value)
    h = m.histograms()["serve_request_s.j.1"]
    assert h.bounds == catalogue.LATENCY_BUCKETS
    assert h.counts[0] == 1 and h.counts[h.bounds.index(0.0025)] == 2 and h.counts[h.bounds.index(0.5)] == 3
    assert h.counts[-1] == 3 and h.count == 4 and h.sum == pytest.approx(500.3021)
    observe(m, catalogue.ROUND_DURATION + "train-hpp.j", 2.0)
    assert m.histograms()["train_round_s.train-hpp.j"].bounds == catalogue.ROUND_BUCKETS
    observe(m, "not_catalogued", 1.0)
    assert m.histograms()["not_catalogued"].bounds == catalogue.DEFAULT_BUCKETS
    observe(m, "x", math.nan)
    observe(m, "x", math.inf)
    assert "x" not in m.histograms() and m.counter("histogram_refused") == 2


def test_histograms_beyond_the_cap_replace_the_least_recently_observed() -> None:
    m = Metrics()
    for i in range(MAX_HISTOGRAMS):
        observe(m, f"{catalogue.TTFT}job{i}", 0.1)
    observe(m, f"{catalogue.TTFT}job0", 0.1)  # job0 is now the freshest
    observe(m, f"{catalogue.TTFT}new", 0.1)
    names = set(m.histograms())
    assert len(names) == MAX_HISTOGRAMS and "serve_ttft_s.job0" in names and "serve_ttft_s.job1" not in names
    assert m.counter("histograms_evicted") == 1
    # What Metrics holds always makes a valid report.
    MetricsReport(node="n", service="s", instance="i", uptime_s=1.0, counters={}, gauges={},
                  histograms=m.histograms())


def _report(**histograms: Histogram) -> dict:  # type: ignore[type-arg]
    return {"node": "n", "service": "s", "instance": "i", "uptime_s": 1.0, "counters": {}, "gauges": {},
            "histograms": histograms}


def test_metrics_report_validates_histograms() -> None:
    old = {"node": "n", "service": "s", "instance": "i", "uptime_s": 1.0, "counters": {"a": 1}, "gauges": {}}
    assert MetricsReport.model_validate(old).histograms == {}  # a report from before the field
    good = {"bounds": (0.1, 1.0), "counts": (1, 2), "sum": 1.5, "count": 3}
    MetricsReport.model_validate(_report(h=good))
    bad = [{**good, "bounds": (1.0, 0.1)}, {**good, "bounds": (0.1, 0.1)}, {**good, "counts": (2, 1)},
           {**good, "counts": (-1, 2)}, {**good, "counts": (1, 4)}, {**good, "counts": (1,)},
           {**good, "sum": math.inf}, {**good, "bounds": (0.1, math.nan)}, {**good, "count": -1},
           {**good, "bounds": tuple(range(MAX_BUCKETS + 1)), "counts": (0,) * (MAX_BUCKETS + 1)}]
    for h in bad:
        with pytest.raises(ValidationError):
            MetricsReport.model_validate(_report(h=h))
    with pytest.raises(ValidationError):
        MetricsReport.model_validate(_report(**{f"h{i}": good for i in range(MAX_HISTOGRAMS + 1)}))
    with pytest.raises(ValidationError):
        MetricsReport.model_validate(_report(**{"x" * 200: good}))


# --- the catalogue -----------------------------------------------------------------------------------------------

# Labels whose values the cluster bounds (its nodes, services, jobs, kinds, stages, the reasons a closed list names).
LABELS = frozenset({"node", "service", "job", "kind", "stage", "peer", "reason", "direction"})
# Metadata labels only an ``_info`` family may carry.
INFO_LABELS = frozenset({"device_class", "compute", "version"})
# The naming rules of docs/metrics.md, checked on every family of the catalogue.
_SNAKE = re.compile(r"^edgeswarm_[a-z][a-z0-9_]*[a-z0-9]$")
_UNIT_SUFFIX = {"seconds": "_seconds", "bytes": "_bytes", "ratio": "_ratio", "celsius": "_celsius",
                "watts": "_watts", "bytes_per_second": "_bytes_per_second"}


def naming_problems(metric: MetricDef) -> list[str]:
    """What in ``metric`` breaks the naming rules (empty: none): the prefix, snake case, the unit as the suffix,
    ``_total`` only from the counter type, bounded labels, buckets ascending."""
    problems = []
    name = metric.name
    if not _SNAKE.match(name) or name.count(catalogue.PREFIX) != 1 or "__" in name:
        problems.append("not one edgeswarm_ prefix and snake case")
    if name.endswith(("_total", "_info", "_count", "_sum", "_bucket", "_created")):
        problems.append("ends in a suffix the type adds")
    if metric.unit:
        suffix = _UNIT_SUFFIX.get(metric.unit)
        if suffix is None:
            problems.append(f"unit {metric.unit!r} is not a base unit")
        elif not name.endswith(suffix):
            problems.append(f"unit {metric.unit} but the name does not end in {suffix}")
    elif any(name.endswith(s) for s in _UNIT_SUFFIX.values()):
        problems.append("names a unit its unit field does not")
    if any(t in name for t in ("_milliseconds", "_ms", "_kb", "_mb", "_percent", "_perc")):
        problems.append("not in a base unit")
    allowed = LABELS | (INFO_LABELS if metric.type == "info" else frozenset())
    if not set(metric.labels) <= allowed or len(set(metric.labels)) != len(metric.labels):
        problems.append(f"labels {sorted(set(metric.labels) - allowed)} are not bounded ones (or repeat)")
    if metric.type == "histogram":
        b = metric.buckets
        if not b or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            problems.append("a histogram needs ascending buckets")
    elif metric.buckets:
        problems.append("buckets on a family that is not a histogram")
    for source in metric.sources:
        fixed = tuple(k for k, _ in source.fixed)
        if source.kind in ("counter", "gauge", "histogram", "uptime"):
            carried = catalogue.REPORT_LABELS + source.labels + fixed
            if sorted(carried) != sorted(metric.labels):
                problems.append(f"source {source.name} carries labels {carried}, not {metric.labels}")
            if source.labels and not source.is_prefix:
                problems.append(f"source {source.name} has labels but is not a prefix")
            if source.kind != {"counter": "counter", "gauge": "gauge", "histogram": "histogram",
                               "info": "gauge"}[metric.type] and source.kind != "uptime":
                problems.append(f"a {metric.type} made of {source.kind}s")
    return problems


def test_catalogue_follows_the_naming_rules() -> None:
    for metric in CATALOGUE:
        assert naming_problems(metric) == [], metric.name
    exported = [m.exported for m in CATALOGUE]
    assert len(exported) == len(set(exported))
    for wrong in (MetricDef(name="edgeswarm_latency_ms", type="gauge", help="h", labels=("node",),
                            sources=(Source(kind="cluster", name="x"),)),
                  MetricDef(name="edgeswarm_requests_total", type="counter", help="h", labels=("node", "service"),
                            sources=(Source(kind="counter", name="r"),)),
                  MetricDef(name="edgeswarm_edgeswarm_x_seconds", type="gauge", help="h", unit="seconds",
                            labels=("request_id",), sources=(Source(kind="cluster", name="x"),))):
        assert naming_problems(wrong), wrong.name


def test_prefix_sources_take_the_last_label_with_its_dots() -> None:
    source = Source(kind="counter", name="train_rounds.", labels=("kind", "job"))
    assert source.label_values("train_rounds.train-hpp.my.job") == ("train-hpp", "my.job")
    assert source.label_values("train_rounds.train-hpp") is None
    assert source.label_values("other.x.y") is None


# --- the accelerator sampler -------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_jetson_sysfs_readings(tmp_path: Path) -> None:
    assert read_jetson(tmp_path).model_dump() == {"utilization": None, "temperature_c": None, "power_w": None}
    _write(tmp_path / "class/thermal/thermal_zone0/type", "CPU-therm\n")
    _write(tmp_path / "class/thermal/thermal_zone0/temp", "41000\n")
    _write(tmp_path / "class/thermal/thermal_zone1/type", "GPU-therm\n")
    _write(tmp_path / "class/thermal/thermal_zone1/temp", "47500\n")
    _write(tmp_path / "devices/gpu.0/load", "734\n")  # per mille
    reading = read_jetson(tmp_path)
    assert reading.utilization == pytest.approx(0.734) and reading.temperature_c == pytest.approx(47.5)
    # An Orin names its zone gpu-thermal and its GPU ga10b; junk in a file is no reading.
    orin = tmp_path / "orin"
    _write(orin / "class/thermal/thermal_zone3/type", "gpu-thermal\n")
    _write(orin / "class/thermal/thermal_zone3/temp", "garbage\n")
    _write(orin / "devices/platform/17000000.ga10b/load", "1000\n")
    reading = AcceleratorSampler(sysfs=orin, nvidia=False).sample()
    assert reading.utilization == 1.0 and reading.temperature_c is None


def test_nvidia_smi_output_parsing() -> None:
    out = "37, 61, 123.45\n5, 40, [N/A]\n"
    assert parse_smi(out, 0).model_dump() == {"utilization": 0.37, "temperature_c": 61.0, "power_w": 123.45}
    assert parse_smi(out, 1).model_dump() == {"utilization": 0.05, "temperature_c": 40.0, "power_w": None}
    assert parse_smi(out, 2).utilization is None and parse_smi("garbage", 0).utilization is None


# --- the deploy files --------------------------------------------------------------------------------------------


def _exported_names() -> set[str]:
    names = set()
    for m in CATALOGUE:
        names.add(m.exported)
        if m.type == "histogram":
            names |= {m.name + s for s in ("_bucket", "_sum", "_count")}
    return names


def test_grafana_dashboard_uses_only_catalogued_metrics_and_the_scrape_config_parses() -> None:
    dashboard = json.loads((REPO / "deploy/grafana/edgeswarm.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bedgeswarm_[a-z0-9_]+", e)}
    assert used and used <= _exported_names(), used - _exported_names()
    for needed in ("edgeswarm_train_samples_total", "edgeswarm_request_duration_seconds_bucket",
                   "edgeswarm_time_to_first_token_seconds_bucket", "edgeswarm_recoveries_total",
                   "edgeswarm_rejected_messages_total", "edgeswarm_bus_bytes_total", "edgeswarm_link_rtt_seconds",
                   "edgeswarm_node_memory_used_bytes"):
        assert needed in used, needed
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["authorization"]["credentials_file"]
    assert job["honor_labels"] is True and job["static_configs"][0]["targets"]
    doc = (REPO / "docs/metrics.md").read_text()
    assert all(m.exported in doc for m in CATALOGUE)


# --- the hub's exposition, fed through a real broker -------------------------------------------------------------


def test_exposition_of_what_real_publishers_send(make_bus) -> None:  # type: ignore[no-untyped-def]
    from edgeswarm.hpp.spec import TrainProgress
    from edgeswarm.values.profiles import (
        ComputeProfile,
        DeviceInfo,
        DeviceProfileEntry,
        LinkProfile,
        ModelProfile,
        ModelSpec,
        UnitProfile,
    )

    hub = make_bus("hub", "dashboard", metrics_interval_s=5.0)
    observer = Observer(hub.hub.url)  # the one store the dashboard's page and its /metrics both read
    observer.subscribe(hub)
    collector = PrometheusCollector(observer, stale_after_s=15.0)
    assert text_string_to_metric_families(collector.exposition().decode())  # empty state still exposes

    # A coordinator: its cluster view and a job's state (retained), and its metrics as its service publishes them.
    coord = make_bus("hub", "coordinator")
    now = 1.7e9
    svc = ServiceView(service="node-agent", instance="abc", state="online", version="0", host="h", pid=1,
                      data_url="mqtt://127.0.0.1:1", heartbeat_age_s=0.4, started_at=now)
    view = ClusterView(generated_at=now, heartbeat_timeout_factor=3.0, nodes=(
        NodeView(node="dev-1", state="online", device_class="jetson-nano", memory_budget_bytes=4000,
                 free_memory_bytes=2500, services=(svc,), compute="cpu", reserved_memory_bytes=700),
        NodeView(node="dev-2", state="offline", device_class="rpi4", memory_budget_bytes=8000, free_memory_bytes=8000,
                 services=())))
    coord.publish(topics.CLUSTER_VIEW, view, retain=True)
    coord.publish(topics.job_state("j1"), JobState(
        job_id="j1", kind="train-hpp", status="running", model="mlp", progress=TrainProgress(round=3, loss=0.25),
        submitted_at=now, updated_at=now), retain=True)
    record.round_done(coord.metrics, "train-hpp", "j1", 0.3, 64)
    record.round_done(coord.metrics, "train-hpp", "j1", 0.7, 64)
    record.request_answered(coord.metrics, "s1", 0.02)
    record.request_refused(coord.metrics, "s1", "busy")
    record.first_token(coord.metrics, "s1", 0.05, prompt_tokens=7)
    record.recovered(coord.metrics, "j1", device_lost=True)
    counters, gauges = coord.metrics.snapshot()
    coord.publish(topics.metrics("hub", "coordinator"), MetricsReport(
        node="hub", service="coordinator", instance=coord.sender.instance, uptime_s=12.0, counters=counters,
        gauges={**gauges, "inbox_depth": 2.0, "accelerator_temperature_c": math.nan},
        histograms=coord.metrics.histograms()), qos=0)

    # A profiler's retained report with a measured link; a report on another node's topic is not believed.
    profiler = make_bus("dev-1", "profiler")
    model = ModelProfile(model=ModelSpec(name="mlp"), fingerprint="f" * 8, input_bytes_per_sample=4,
                         units=[UnitProfile(index=0, name="u0", ops="Linear", output_bytes_per_sample=4,
                                            weight_bytes=4, flops_per_sample=1.0)])
    compute = ComputeProfile(model_fingerprint="f" * 8, device_fingerprint="fp", batch_sizes=[1], forward_s=[[1e-4]],
                             backward_s=[[1e-4]], method="measured")
    entry = DeviceProfileEntry(device=DeviceInfo(node="dev-1", fingerprint="fp", memory_budget_bytes=4000),
                               compute=compute)
    profiler.publish(topics.profile_report("dev-1", "f" * 8), ProfileReport(
        request_id="r", node="dev-1", entry=entry, model=model,
        links=[LinkProfile(src="dev-1", dst="dev-2", bandwidth_bps=1.25e6, latency_s=0.004)]), retain=True)
    profiler.publish(topics.metrics("dev-2", "profiler"), MetricsReport(
        node="dev-1", service="profiler", instance="x", uptime_s=1.0, counters={"bytes_out": 5}, gauges={}), qos=0)

    def families() -> dict:  # type: ignore[type-arg]
        return {f.name: f for f in text_string_to_metric_families(collector.exposition().decode())}

    def ready() -> bool:
        f = families()
        return all(f.get(n) and f[n].samples for n in ("edgeswarm_train_rounds", "edgeswarm_node_up",
                                                        "edgeswarm_job_loss", "edgeswarm_link_rtt_seconds"))

    assert wait_until(ready, 10.0)
    f = families()

    def value(name: str, family: str | None = None, **labels: str) -> float:
        found = [s.value for s in f[family or name].samples if s.name == name
                 and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels, f[family or name].samples)
        return found[0]

    coordinator = {"node": "hub", "service": "coordinator"}
    assert value("edgeswarm_train_rounds_total", "edgeswarm_train_rounds", kind="train-hpp", job="j1",
                 **coordinator) == 2
    assert value("edgeswarm_train_samples_total", "edgeswarm_train_samples", job="j1") == 128
    hist = "edgeswarm_train_round_duration_seconds"
    assert value(hist + "_count", hist, job="j1") == 2 and value(hist + "_sum", hist, job="j1") == pytest.approx(1.0)
    assert value(hist + "_bucket", hist, job="j1", le="0.5") == 1 and value(hist + "_bucket", hist, le="+Inf") == 2
    assert value("edgeswarm_requests_total", "edgeswarm_requests", job="s1", reason="answered") == 1
    assert value("edgeswarm_requests_total", "edgeswarm_requests", job="s1", reason="busy") == 1
    assert value("edgeswarm_time_to_first_token_seconds_count", "edgeswarm_time_to_first_token_seconds") == 1
    assert value("edgeswarm_prompt_tokens_total", "edgeswarm_prompt_tokens", job="s1") == 7
    assert value("edgeswarm_recoveries_total", "edgeswarm_recoveries", job="j1", reason="device_lost") == 1
    assert value("edgeswarm_inbox_depth_messages", **coordinator) == 2
    assert value("edgeswarm_service_uptime_seconds", **coordinator) == 12
    # The coordinator's own bus counted what it published: mapped with a direction, never an instance id.
    assert value("edgeswarm_bus_messages_total", "edgeswarm_bus_messages", direction="out", **coordinator) >= 2
    assert all("instance" not in s.labels for fam in f.values() for s in fam.samples)
    assert not f["edgeswarm_accelerator_temperature_celsius"].samples  # NaN left out
    # The report on another node's topic was dropped: no series of dev-1's profiler.
    assert not [s for s in f["edgeswarm_bus_bytes"].samples if s.labels.get("node") == "dev-1"]
    # Cluster view, job state, links.
    assert value("edgeswarm_node_up", node="dev-1") == 1 and value("edgeswarm_node_up", node="dev-2") == 0
    assert value("edgeswarm_node_info", node="dev-1", device_class="jetson-nano") == 1
    assert value("edgeswarm_node_memory_used_bytes", node="dev-1") == 1500
    assert value("edgeswarm_node_memory_reserved_bytes", node="dev-1") == 700
    assert value("edgeswarm_node_heartbeat_age_seconds", node="dev-1") == pytest.approx(0.4)
    assert value("edgeswarm_job_rounds_done", job="j1", kind="train-hpp") == 3
    assert value("edgeswarm_job_loss", job="j1") == 0.25 and value("edgeswarm_job_active", job="j1") == 1
    assert value("edgeswarm_link_rtt_seconds", node="dev-1", peer="dev-2") == pytest.approx(0.004)
    assert value("edgeswarm_link_bandwidth_bytes_per_second", node="dev-1", peer="dev-2") == 1.25e6


def test_a_family_that_fails_to_build_is_left_out_not_the_exposition(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from edgeswarm.dashboard import prometheus

    observer = Observer("mqtt://127.0.0.1:1883")
    collector = PrometheusCollector(observer, stale_after_s=3.0)
    m = Metrics()
    m.count("bytes_out", 9)
    counters, gauges = m.snapshot()
    report = MetricsReport(node="n", service="s", instance="i", uptime_s=1.0, counters=counters, gauges=gauges)
    observer.on_metrics(SimpleNamespace(body=report, topic=topics.metrics("n", "s")))  # type: ignore[arg-type]

    def broken(*args: object) -> None:
        raise RuntimeError("a bug in one family")

    monkeypatch.setattr(prometheus, "_from_view", broken)
    families = {f.name: f for f in text_string_to_metric_families(collector.exposition().decode())}
    assert "edgeswarm_node_up" not in families
    assert [s.value for s in families["edgeswarm_bus_bytes"].samples] == [9.0]
