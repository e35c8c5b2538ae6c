"""Every metric the hub exports to Prometheus: its name, type, help, unit, labels, and where its values come from.

Names follow Prometheus' naming practice: one ``edgeswarm_`` prefix, base units (``_seconds``, ``_bytes``, ratios
0-1, degrees Celsius), ``_total`` on counters, ``_info`` on metadata. Labels are bounded by the cluster (node,
service, job, kind, stage, peer, reason, direction): never a request, tensor or instance id. Serving metrics mean
what vLLM's do (time to first token, inter-token latency, request duration, queue time, generation tokens).

A service counts under plain internal names in its ``edgeswarm.metrics.Metrics`` (``bytes_out``,
``rejected.checksum``) and publishes them in its MetricsReport; a ``Source`` maps one such name, or every name
under a prefix (``rejected.`` with the rest as the ``reason`` label), to a family here. The functions in
``edgeswarm.observability.record`` write the internal names of what a program measures, so the two never drift.
This module is pure data: the bus imports it (through ``Metrics``), so it imports nothing of edgeswarm.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PREFIX = "edgeswarm_"
MetricType = Literal["counter", "gauge", "histogram", "info"]
# Where a value comes from: a MetricsReport's counters, gauges, histograms or uptime; the coordinator's retained
# cluster view (one series per node); the retained job states (one per job); the profiles' measured links.
SourceKind = Literal["counter", "gauge", "histogram", "uptime", "cluster", "job", "link"]

REPORT_LABELS = ("node", "service")  # every family made of MetricsReports carries these

# Bucket upper bounds (seconds; +Inf is implicit). Latencies of one request span a LAN round trip to a long
# generation; a training round spans a toy model on a laptop to a large one on a Pi.
LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                      30.0, 60.0, 120.0)
TOKEN_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5,
                                    5.0, 10.0)
ROUND_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                                    1800.0)
DEFAULT_BUCKETS = LATENCY_BUCKETS

# Internal names (prefixes end in "."; the values of the source's ``labels`` follow, joined by ".").
REQUEST_DURATION = "serve_request_s."  # + job
REQUEST_QUEUE = "serve_queue_s."  # + job
REQUESTS = "serve_requests."  # + reason.job
TTFT = "serve_ttft_s."  # + job
ITL = "serve_itl_s."  # + job
GENERATION_TOKENS = "serve_generation_tokens."  # + job
PROMPT_TOKENS = "serve_prompt_tokens."  # + job
ROUND_DURATION = "train_round_s."  # + kind.job
ROUNDS = "train_rounds."  # + kind.job
SAMPLES = "train_samples."  # + kind.job
RECOVERIES = "recoveries."  # + reason.job
REPLAYED = "replayed."  # + job
ACCELERATOR_UTILIZATION = "accelerator_utilization"
ACCELERATOR_TEMPERATURE = "accelerator_temperature_c"
ACCELERATOR_POWER = "accelerator_power_w"


class Source(BaseModel):
    """One internal value of a family. ``name`` is an internal counter, gauge or histogram name, or a prefix (ending
    in ".") whose rest fills ``labels`` in order, split on "." (the last label takes the rest, dots and all, so only
    it may be a job or node name); ``fixed`` labels have the same value on every series of this source. For the
    cluster, job and link sources ``name`` is the field read (for the docs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: SourceKind
    name: str = Field(min_length=1, max_length=128)
    labels: tuple[str, ...] = ()
    fixed: tuple[tuple[str, str], ...] = ()

    @property
    def is_prefix(self) -> bool:
        return self.name.endswith(".")

    def label_values(self, internal: str) -> tuple[str, ...] | None:
        """The values of ``labels`` an internal name carries, or None when ``internal`` is not of this source (or
        an empty value would result)."""
        if not self.is_prefix:
            return () if internal == self.name else None
        if not internal.startswith(self.name):
            return None
        rest = internal[len(self.name):]
        parts = rest.split(".", len(self.labels) - 1) if self.labels else [rest]
        if len(parts) != len(self.labels) or not all(parts):
            return None
        return tuple(parts)


class MetricDef(BaseModel):
    """One exported family: Prometheus ``name`` (for a counter without its ``_total``: prometheus_client adds it
    back, see ``exported``), ``type``, ``help``, ``unit`` (a base unit or ""), every label it carries, its sources,
    and for a histogram its bucket upper bounds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    type: MetricType
    help: str = Field(min_length=1)
    unit: str = ""
    labels: tuple[str, ...]
    sources: tuple[Source, ...]
    buckets: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The name as scraped: counters end in ``_total``, info families in ``_info``."""
        return self.name + {"counter": "_total", "info": "_info"}.get(self.type, "")


def _report(name: str, type_: MetricType, help_: str, sources: tuple[Source, ...], *, unit: str = "",
            extra: tuple[str, ...] = (), buckets: tuple[float, ...] = ()) -> MetricDef:
    return MetricDef(name=name, type=type_, help=help_, unit=unit, labels=REPORT_LABELS + extra, sources=sources,
                     buckets=buckets)


def _one(kind: SourceKind, name: str, *labels: str) -> tuple[Source, ...]:
    return (Source(kind=kind, name=name, labels=labels),)


def _both(kind: SourceKind, incoming: str, outgoing: str) -> tuple[Source, ...]:
    return (Source(kind=kind, name=incoming, fixed=(("direction", "in"),)),
            Source(kind=kind, name=outgoing, fixed=(("direction", "out"),)))


CATALOGUE: tuple[MetricDef, ...] = (
    # --- every service: its bus (counted once, by the bus) -----------------------------------------------
    _report("edgeswarm_service_uptime_seconds", "gauge", "Seconds since the service instance started.",
            _one("uptime", "uptime_s"), unit="seconds"),
    _report("edgeswarm_bus_messages", "counter", "Messages the service's bus published (out) or received (in).",
            _both("counter", "messages_in", "messages_out"), extra=("direction",)),
    _report("edgeswarm_bus_bytes", "counter", "Bytes of frames the service's bus published (out) or received "
            "(in), tensors included.", _both("counter", "bytes_in", "bytes_out"), unit="bytes", extra=("direction",)),
    _report("edgeswarm_bus_tensors", "counter", "Tensors the service's bus sent (out) or received whole (in).",
            _both("counter", "tensors_in", "tensors_out"), extra=("direction",)),
    _report("edgeswarm_rejected_messages", "counter", "Messages the service's bus refused, by reason (checksum, "
            "schema, size, expired sender, ...).", _one("counter", "rejected.", "reason"), extra=("reason",)),
    _report("edgeswarm_handler_errors", "counter", "Handler calls that raised (the message was dropped).",
            _one("counter", "handler_errors")),
    _report("edgeswarm_inbox_dropped_messages", "counter", "QoS 0 messages dropped because the service's inbox was "
            "full (QoS 1 ones wait instead).", _one("counter", "inbox_dropped")),
    _report("edgeswarm_inbox_waits", "counter", "Times a full inbox held a broker connection's network thread for "
            "room for a QoS 1 message (backpressure through TCP).", _one("counter", "inbox_held")),
    _report("edgeswarm_inbox_redelivered_messages", "counter", "QoS 1 messages handed back to the broker after the "
            "inbox stayed full for the whole hold: the connection resumed its session and the broker sent them "
            "again.", _one("counter", "inbox_redelivered")),
    _report("edgeswarm_inbox_depth_messages", "gauge", "Messages waiting in the service's inbox.",
            _one("gauge", "inbox_depth")),
    _report("edgeswarm_reassembly_bytes", "gauge", "Bytes of chunked tensors the bus holds while they arrive.",
            _one("gauge", "reassembly_bytes"), unit="bytes"),
    # --- serving (the coordinator's programs) ------------------------------------------------------------
    _report("edgeswarm_request_duration_seconds", "histogram", "Seconds from a request's arrival at the "
            "coordinator to its answer (vLLM's e2e request latency).", _one("histogram", REQUEST_DURATION, "job"),
            unit="seconds", extra=("job",), buckets=LATENCY_BUCKETS),
    _report("edgeswarm_request_queue_time_seconds", "histogram", "Seconds a request waited in the job's queue "
            "before it was dispatched (vLLM's request queue time).", _one("histogram", REQUEST_QUEUE, "job"),
            unit="seconds", extra=("job",), buckets=LATENCY_BUCKETS),
    _report("edgeswarm_requests", "counter", "Requests a serving job finished, by outcome: reason \"answered\", or "
            "the InferError reason it was refused with (busy, failed, not_serving, bad_shape, ...).",
            _one("counter", REQUESTS, "reason", "job"), extra=("reason", "job")),
    _report("edgeswarm_requests_refused", "counter", "Every request a coordinator refused, by reason, jobs it does "
            "not run included (no job label: a caller names the job).", _one("counter", "infer_refused.", "reason"),
            extra=("reason",)),
    _report("edgeswarm_time_to_first_token_seconds", "histogram", "Seconds from a generation request's arrival to "
            "its first token (the prefill pass).", _one("histogram", TTFT, "job"), unit="seconds", extra=("job",),
            buckets=LATENCY_BUCKETS),
    _report("edgeswarm_inter_token_latency_seconds", "histogram", "Seconds between two generated tokens of a "
            "request (one decode pass; vLLM's inter-token latency, the time per output token).",
            _one("histogram", ITL, "job"), unit="seconds", extra=("job",), buckets=TOKEN_BUCKETS),
    _report("edgeswarm_generation_tokens", "counter", "Tokens generated for answered requests.",
            _one("counter", GENERATION_TOKENS, "job"), extra=("job",)),
    _report("edgeswarm_prompt_tokens", "counter", "Prompt tokens of answered generation requests.",
            _one("counter", PROMPT_TOKENS, "job"), extra=("job",)),
    # --- training ----------------------------------------------------------------------------------------
    _report("edgeswarm_train_round_duration_seconds", "histogram", "Seconds one training round took, from its "
            "start to the last device's answer.", _one("histogram", ROUND_DURATION, "kind", "job"), unit="seconds",
            extra=("kind", "job"), buckets=ROUND_BUCKETS),
    _report("edgeswarm_train_rounds", "counter", "Training rounds finished (a round replayed after a recovery "
            "counts again).", _one("counter", ROUNDS, "kind", "job"), extra=("kind", "job")),
    _report("edgeswarm_train_samples", "counter", "Training samples the finished rounds took (rate() of it is "
            "samples per second).", _one("counter", SAMPLES, "kind", "job"), extra=("kind", "job")),
    # --- recoveries --------------------------------------------------------------------------------------
    _report("edgeswarm_recoveries", "counter", "Times a job was re-planned and deployed again after a "
            "disruption: reason device_lost (the failure detector confirmed a device gone) or disrupted (no "
            "device lost: a stall, a lost broker connection).", _one("counter", RECOVERIES, "reason", "job"),
            extra=("reason", "job")),
    _report("edgeswarm_replayed", "counter", "Work sent again after a recovery: a serving job's items in "
            "flight, a generation's requests whose cache was rebuilt, a training job's rounds.",
            _one("counter", REPLAYED, "job"), extra=("job",)),
    # --- accelerators (the node agent samples them where the device reports them) ------------------------
    _report("edgeswarm_accelerator_utilization_ratio", "gauge", "Busy fraction (0-1) of the node's accelerator "
            "over its last sample period.", _one("gauge", ACCELERATOR_UTILIZATION), unit="ratio"),
    _report("edgeswarm_accelerator_temperature_celsius", "gauge", "Temperature of the node's accelerator (or its "
            "SoC's GPU thermal zone).", _one("gauge", ACCELERATOR_TEMPERATURE), unit="celsius"),
    _report("edgeswarm_accelerator_power_watts", "gauge", "Power the node's accelerator draws.",
            _one("gauge", ACCELERATOR_POWER), unit="watts"),
    # --- the cluster view (the coordinator's, retained) --------------------------------------------------
    MetricDef(name="edgeswarm_node_up", type="gauge", help="1 while the node's best service is online, else 0.",
              labels=("node",), sources=_one("cluster", "NodeView.state")),
    MetricDef(name="edgeswarm_node", type="info", help="A node's device class and compute device.",
              labels=("node", "device_class", "compute"),
              sources=_one("cluster", "NodeView.device_class, NodeView.compute")),
    MetricDef(name="edgeswarm_node_memory_budget_bytes", type="gauge", help="The node's memory budget.",
              unit="bytes", labels=("node",), sources=_one("cluster", "NodeView.memory_budget_bytes")),
    MetricDef(name="edgeswarm_node_memory_used_bytes", type="gauge", help="Memory the node's busiest service "
              "process uses (the budget less what is free).", unit="bytes", labels=("node",),
              sources=_one("cluster", "NodeView.memory_budget_bytes - NodeView.free_memory_bytes")),
    MetricDef(name="edgeswarm_node_memory_reserved_bytes", type="gauge", help="Memory the node's ledger holds for "
              "the jobs of every program on the node.", unit="bytes", labels=("node",),
              sources=_one("cluster", "NodeView.reserved_memory_bytes")),
    MetricDef(name="edgeswarm_node_heartbeat_age_seconds", type="gauge", help="Seconds since the freshest "
              "heartbeat of the node's services.", unit="seconds", labels=("node",),
              sources=_one("cluster", "min(ServiceView.heartbeat_age_s)")),
    # --- jobs (their retained states) --------------------------------------------------------------------
    MetricDef(name="edgeswarm_job_active", type="gauge", help="1 while the job is not finished (queued to "
              "recovering), 0 once it succeeded, failed or was cancelled.", labels=("job", "kind"),
              sources=_one("job", "JobState.status")),
    MetricDef(name="edgeswarm_job_rounds_done", type="gauge", help="Rounds the job has done (kinds that run in "
              "rounds).", labels=("job", "kind"), sources=_one("job", "Workload.summary(state).round")),
    MetricDef(name="edgeswarm_job_loss", type="gauge", help="The job's latest training loss.",
              labels=("job", "kind"), sources=_one("job", "JobState.progress.loss")),
    # --- links (the profilers' retained reports) ---------------------------------------------------------
    MetricDef(name="edgeswarm_link_rtt_seconds", type="gauge", help="Measured round-trip latency from node to peer "
              "over the data plane.", unit="seconds", labels=("node", "peer"),
              sources=_one("link", "LinkProfile.latency_s")),
    MetricDef(name="edgeswarm_link_bandwidth_bytes_per_second", type="gauge", help="Measured bulk bandwidth from "
              "node to peer over the data plane.", unit="bytes_per_second", labels=("node", "peer"),
              sources=_one("link", "LinkProfile.bandwidth_bps")),
)


def buckets_for(internal: str) -> tuple[float, ...]:
    """Bucket bounds of the histogram whose source ``internal`` is (DEFAULT_BUCKETS for a name the catalogue does
    not list)."""
    for metric in CATALOGUE:
        if metric.type == "histogram":
            for source in metric.sources:
                if source.label_values(internal) is not None:
                    return metric.buckets
    return DEFAULT_BUCKETS
