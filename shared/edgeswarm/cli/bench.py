"""``edgeswarm bench ...``: the commands' argument checks and tables (the measurements live in edgeswarm.bench)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from edgeswarm.bench.transport import KB, MB, TransportReport, run_transport_bench
from edgeswarm.bus import Bus
from edgeswarm.cli.common import cli_settings, hub_url
from edgeswarm.cli.console import console, err_console
from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry
from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.runtime.client import ClusterWatcher, client_bus, online_device_ids

if TYPE_CHECKING:
    from edgeswarm.bench.collectives import CollectiveRow, CollectivesReport
    from edgeswarm.bench.hmp import HmpBenchConfig, HmpReport

QUICK_PLAN = {KB: 500, 64 * KB: 100, MB: 20, 16 * MB: 2}


def run_bench_transport(args: argparse.Namespace) -> int:
    hub = hub_url(args.hub)
    cluster = None
    if hub is None:
        # No cluster given: bring up a private broker with one native node-agent as the receiver.
        spec = ClusterSpec(name="bench", devices=(DeviceEntry(id="bench-sink", device_class="native"),))
        cluster = LocalCluster(spec, port=0, dashboard_port=None)
        cluster.start()
        hub = cluster.hub_url
        err_console.print(f"no --hub given: started {cluster.broker.kind if cluster.broker else '?'} at {hub}")
    try:
        bus = client_bus(cli_settings(hub), role="bench")
        try:
            node = args.node or _first_device(bus)
            report = run_transport_bench(bus, node, plan=QUICK_PLAN if args.quick else None,
                                         rtt_samples=200 if args.quick else 1000,
                                         progress=lambda m: err_console.print(f"[dim]{m}[/dim]"))
        finally:
            bus.stop()
    finally:
        if cluster is not None:
            cluster.stop()
    if args.out:
        Path(args.out).write_text(report.model_dump_json(indent=2))
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        console.print(report_table(report))
        for line in report_lines(report):
            console.print(line)
    return 0


def _first_device(bus: Bus) -> str:
    view, _ = ClusterWatcher(bus).wait(settle_s=1.0, devices=1, timeout_s=30)
    devices = online_device_ids(view)
    if not devices:
        raise EdgeswarmError("no online node-agent to measure against; start a cluster or pass --node")
    return devices[0]


def report_table(report: TransportReport) -> Table:
    """The throughput rows as a table."""
    table = Table(title=f"transport: {report.broker_url} (MQTT {report.broker_protocol}) -> {report.target}, "
                        f"chunks of {report.chunk_bytes // KB} KiB, QoS 1")
    for col in ("payload", "count", "MQTT MB/s", "raw TCP MB/s", "MQTT/TCP"):
        table.add_column(col, justify="right")
    for row in report.rows:
        size = f"{row.size_bytes // MB} MB" if row.size_bytes >= MB else f"{row.size_bytes // KB} KB"
        table.add_row(size, str(row.count), f"{row.mqtt_mb_s:.1f}", f"{row.tcp_mb_s:.1f}", f"{row.ratio:.2f}")
    return table


def report_lines(report: TransportReport) -> list[str]:
    """The round-trip and codec figures, one line each."""
    c = report.codec
    return [
        f"QoS 1 round trip, 1 KB request and reply: median {report.rtt_1kb_qos1_median_ms:.2f} ms, "
        f"p90 {report.rtt_1kb_qos1_p90_ms:.2f} ms ({report.rtt_samples} samples)",
        f"codec on a {c.tensor_bytes // MB} MiB float32 tensor: encode {c.encode_gb_s:.2f} GB/s, decode "
        f"{c.decode_gb_s:.2f} GB/s ({'zero-copy' if c.decode_zero_copy else 'COPIES'}, CRC-32 checked), "
        f"reassembly from {c.chunk_bytes // KB} KiB chunks {c.reassemble_gb_s:.2f} GB/s",
    ]


def run_bench_compute(args: argparse.Namespace) -> int:
    """``edgeswarm bench compute``: one stage timed on the CPU and, where torch sees one, on the CUDA device."""
    import torch

    from edgeswarm.bench.compute import stage_speed, summary
    from edgeswarm.values.profiles import ModelSpec

    if args.batch < 1 or args.repeats < 1:
        raise ConfigError("--batch and --repeats must be at least 1")
    accelerator = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    speed = stage_speed(ModelSpec(name=args.model), args.start, args.end, args.batch, accelerator,
                        repeats=args.repeats)
    if args.json:
        console.print_json(speed.model_dump_json())
        return 0
    console.print(summary(speed), highlight=False)
    if accelerator is None:
        console.print("no CUDA device here: the CPU figure only", highlight=False)
    return 0


def run_bench_planner(args: argparse.Namespace) -> int:
    """``edgeswarm bench planner``: planning time, then (unless --time-only) the Table 4 speed-ups."""
    from edgeswarm.bench.planner import planning_time, table4

    report: dict[str, object] = {}
    rows = planning_time()
    t = Table(title="planning time (Alg. 2, B=128, M=16, synthetic Env C-like profile, 6 devices)")
    for col in ("units L", "devices", "candidates", "seconds", "paper (Jetson NX)", "paper / ours"):
        t.add_column(col, justify="right")
    for r in rows:
        paper = f"{r.paper_seconds:.0f} s" if r.paper_seconds else "-"
        ratio = f"{r.paper_seconds / r.seconds:.0f}x" if r.paper_seconds else "-"
        t.add_row(str(r.units), str(r.devices), f"{r.candidates:,}", f"{r.seconds:.2f}", paper, ratio)
    console.print(t)
    report["planning_time"] = [r.model_dump() for r in rows]
    if not args.time_only:
        models = args.models.split(",") if args.models else None
        cells = table4(Path(args.profiles), profile_dir=Path(args.profile_dir), models=models,
                       envs=tuple(args.envs.split(",")), log=lambda m: err_console.print(m, highlight=False))
        t = Table(title="predicted HPP speed-up over single device / DP / PP (ours | paper's Table 4)")
        for col in ("model", "env", "Mbps", "groups", "M", "vs single", "vs DP", "vs PP", "paper", "direction"):
            t.add_column(col)
        for c in cells:
            fmt = [f"{v:.2f}x" if v is not None else "OOM" for v in (c.vs_single, c.vs_dp, c.vs_pp)]
            paper = " / ".join(f"{v}x" for v in c.paper) if c.paper else "-"
            match = {True: "matches", False: "differs", None: "-"}[c.direction_matches()]
            t.add_row(c.model, c.env.upper(), str(c.mbps), str(c.groups), str(c.micro_batches), *fmt, paper, match)
        console.print(t)
        report["table4"] = [c.model_dump() for c in cells]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def run_bench_training(args: argparse.Namespace) -> int:
    """``edgeswarm bench training``: every strategy trained on each environment; measured against predicted."""
    from edgeswarm.bench.training import DEFAULT_MODEL, run_training_bench
    from edgeswarm.cli.profile import parse_config
    from edgeswarm.values.profiles import ModelSpec

    config = parse_config(args.config)
    model = DEFAULT_MODEL if args.model == DEFAULT_MODEL.name and not config else ModelSpec(name=args.model,
                                                                                             config=config)
    rows = run_training_bench(args.envs.split(","), model=model, global_batch=args.global_batch,
                              micro_batches=args.micro_batches or None, rounds=args.rounds,
                              strategies=tuple(args.strategies.split(",")), profile_dir=Path(args.profile_dir),
                              netns=args.netns, log=lambda m: err_console.print(m, highlight=False))
    t = Table(title=f"{model.name}, global batch {args.global_batch}: measured on emulated devices"
                    + (" in network namespaces (kernel-shaped links)" if args.netns else "")
                    + " against the planner's prediction")
    for col in ("env", "strategy", "stages", "M x B", "predicted (s)", "measured (s)", "measured / predicted",
                "samples/s", "HPP speed-up", "compute / profile", "replayed (s)", "measured / replayed",
                "overhead per micro-batch"):
        t.add_column(col, justify="left" if col in ("env", "strategy") else "right")
    hpp = {r.env: r.measured_sps for r in rows if r.strategy == "hpp" and r.measured_sps}
    for r in rows:
        if r.error is not None:
            t.add_row(r.env.upper(), r.strategy, "-", "-", "-", "failed", "-", "-", "-", "-", "-", "-", r.error[:40])
            continue
        assert r.measured_round_s and r.measured_sps and r.replayed_round_s and r.ratio
        speedup = hpp.get(r.env)
        t.add_row(r.env.upper(), r.strategy, str(r.stages), f"{r.micro_batches} x {r.micro_batch_size}",
                  f"{r.predicted_round_s:.3f}", f"{r.measured_round_s:.3f}", f"{r.ratio:.2f}x",
                  f"{r.measured_sps:.1f}", f"{speedup / r.measured_sps:.2f}x" if speedup else "-",
                  f"{r.compute_ratio:.2f}x", f"{r.replayed_round_s:.3f}",
                  f"{r.measured_round_s / r.replayed_round_s:.2f}x",
                  f"{1000 * (r.overhead_per_micro_batch_s or 0):.2f} ms")
    console.print(t)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps([r.model_dump() for r in rows], indent=2))
    return 0


def run_bench_recovery(args: argparse.Namespace) -> int:
    """``edgeswarm bench recovery``: each device dropped in turn, light against heavy recovery."""
    from edgeswarm.bench.recovery import DEFAULT_MODEL, run_recovery_bench
    from edgeswarm.cli.profile import parse_config
    from edgeswarm.values.profiles import ModelSpec

    model = ModelSpec(name=args.model, config=parse_config(args.config) or dict(DEFAULT_MODEL.config))
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    victims = [v.strip() for v in args.victims.split(",") if v.strip()] or None
    rows = run_recovery_bench(args.env, victims=victims, modes=modes, model=model, rounds=args.rounds,
                              kill_round=args.kill_round, profile_dir=Path(args.profile_dir),
                              log=lambda m: err_console.print(m, highlight=False))
    t = Table(title=f"{model.name} on Env {args.env.upper()}: a device dropped during round {args.kill_round}")
    for col in ("dropped", "mode", "stages after", "detection", "recovery", "heavy / light", "moved",
                "round before", "round after", "after / heavy after"):
        t.add_column(col, justify="left" if col in ("dropped", "mode", "stages after") else "right")
    heavy = {r.victim: r for r in rows if r.mode == "heavy" and r.error is None}
    for r in rows:
        if r.error is not None:
            t.add_row(r.victim, r.mode, "failed", "-", "-", "-", "-", "-", "-", r.error[:40])
            continue
        h = heavy.get(r.victim)
        speedup = f"{h.recovery_s / r.recovery_s:.1f}x" if h and r.recovery_s and h.recovery_s else "-"
        after = (f"{h.after_round_s / r.after_round_s:.0%}" if h and h.after_round_s and r.after_round_s else "-")
        t.add_row(r.victim, r.mode, " | ".join(",".join(s) for s in r.stages_after), f"{r.detection_s or 0:.2f} s",
                  f"{r.recovery_s or 0:.2f} s", speedup, f"{(r.moved_bytes or 0) / 1e6:.1f} MB",
                  f"{r.before_round_s or 0:.3f} s", f"{r.after_round_s or 0:.3f} s", after)
    console.print(t)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps([r.model_dump() for r in rows], indent=2))
    return 0 if all(r.error is None for r in rows) else 1


def run_bench_serving(args: argparse.Namespace) -> int:
    """``edgeswarm bench serving``: measured on emulated environments, or (``--sim``) the partition-placement
    grid against the paper's reference numbers."""
    from edgeswarm.bench.serving_sim import NODES, serving_report

    if not args.sim:
        return _run_bench_serving_measured(args)
    trials = min(args.trials, 5) if args.quick else args.trials
    ratio_trials = min(args.ratio_trials, 50) if args.quick else args.ratio_trials
    nodes = (5, 50) if args.quick else NODES
    report = serving_report(trials, ratio_trials, nodes=nodes, seed=args.seed, kpath=args.kpath,
                            progress=lambda m: err_console.print(f"[dim]{m}[/dim]", highlight=False))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    table = Table(title=f"mean bottleneck beta (s), reference mode, C = 20, {trials} trials; ours / paper (spec 6.3)")
    for col in ("model", "cap MB", "nodes", "parts", "k-path", "paper", "greedy", "paper", "random", "paper"):
        table.add_column(col, justify="left" if col == "model" else "right")

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    for row in report["grid"]:
        ref = row["reference"]
        status = row["partition"]["status"]
        parts = str(row["partition"]["parts"]) if status in ("ok", "single_partition") else status
        table.add_row(row["model"], str(row["cap_mb"]), str(row["nodes"]), parts, f(row["kpath"]["mean"]),
                      f(ref["kpath"]), f(row["greedy"]["mean"]), f(ref["greedy"]), f(row["random"]["mean"]),
                      f(ref["random"]))
    console.print(table)
    r3 = report["r3"]
    console.print(f"R3: {sum(r['within_20pct'] for r in r3)}/{len(r3)} configs within 20% of the paper's k-path")
    r4 = report["r4"]
    if r4["per_config"]:
        worst = min(r["random_over_kpath"] for r in r4["per_config"])
        gap = max(abs(r["kpath_vs_greedy"]) for r in r4["per_config"])
        console.print(f"R4 at {r4['nodes']} nodes: random/k-path >= {worst:.1f}x per config, matched means "
                      f"{r4['random_over_kpath_matched']:.1f}x (paper 7.9x); k-path vs greedy matched "
                      f"{r4['kpath_vs_greedy_matched']:+.1%} (paper -3.6%), worst config {gap:.1%}; published-style "
                      f"random {r4['published_style']['random_vs_kpath']:+.0%} (paper +983%), greedy "
                      f"{r4['published_style']['greedy_vs_kpath']:+.0%} (paper +33%)")
    r6 = report["r6"]
    console.print("R6 LB ratio (50 nodes, 64 MB): " + ", ".join(
        f"{m} {f(v)} (paper {r6['reference'].get(m, '-')})" for m, v in r6["per_model"].items())
        + f"; mean {f(r6['mean'])}")
    flagged = [r for r in report["r7"] if r["flag"]]
    over = [r for r in report["r7"] if r["normative_over_capacity"]]
    console.print(f"R7: normative over capacity in {len(over)} configs (must be 0); reference over capacity in "
                  f"{sum(r['reference_over_capacity'] for r in report['r7'])}; {len(flagged)} configs differ by "
                  f"more than 25%: " + ", ".join(f"{r['model']} {r['cap_mb']} MB {r['nodes']} nodes "
                                                 f"{r['difference']:+.0%}" for r in flagged))
    return 0


def _run_bench_serving_measured(args: argparse.Namespace) -> int:
    import tempfile

    from edgeswarm.bench.serving import run_serving_bench
    from edgeswarm.values.profiles import ModelSpec

    envs = ["d"] if args.quick else [e.strip() for e in args.envs.split(",") if e.strip()]
    unknown = [e for e in envs if e not in ("a", "b", "c", "d")]
    if unknown or not envs:
        raise ConfigError(f"--envs: Asteroid's environments are a, b, c and d, not {', '.join(unknown) or 'none'}")
    if args.micro_batch < 1 or args.requests < 1:
        raise ConfigError("--micro-batch and --requests must be at least 1")
    model = ModelSpec(name=args.model, config={"image_size": 32, "num_classes": 10})
    with tempfile.TemporaryDirectory(prefix="edgeswarm-bench-serving-") as tmp:
        rows = run_serving_bench(envs, model=model, micro_batch=args.micro_batch,
                                 requests=50 if args.quick else args.requests,
                                 profile_dir=Path(args.profile_dir or tmp), netns=args.netns,
                                 log=lambda m: err_console.print(f"[dim]{m}[/dim]", highlight=False))
    if args.json:
        Path(args.json).write_text(json.dumps([r.model_dump() | {"ratio": r.ratio} for r in rows], indent=2))
    table = Table(title=f"{model.name} served on Asteroid environments at 100 Mbps, micro-batch {args.micro_batch}: "
                        "measured on the stage-workers" + (" in network namespaces" if args.netns else ""))
    for col in ("env", "variant", "stages", "devices", "predicted samples/s", "measured samples/s",
                "measured / predicted", "over single device", "p50 ms", "p99 ms"):
        table.add_column(col, justify="left" if col in ("env", "variant", "devices") else "right")
    single = {r.env: r.measured_per_s for r in rows if r.variant == "single" and r.measured_per_s}
    for r in rows:
        if r.error:
            table.add_row(r.env, r.variant, "-", escape(r.error[:60]), *["-"] * 6)
            continue
        base = single.get(r.env)
        table.add_row(r.env, r.variant, str(r.stages), ",".join(r.devices), f"{r.predicted_per_s:.1f}",
                      f"{r.measured_per_s:.1f}", f"{r.ratio:.2f}x" if r.ratio else "-",
                      f"{r.measured_per_s / base:.2f}x" if base and r.measured_per_s else "-",
                      f"{(r.p50_s or 0) * 1000:.0f}", f"{(r.p99_s or 0) * 1000:.0f}")
    console.print(table)
    return 0 if all(r.error is None for r in rows) else 1


_UNITS = {"B": 1, "KB": 1024, "KIB": 1024, "MB": 1024 * 1024, "MIB": 1024 * 1024}


def parse_size(text: str) -> int:
    """Bytes from ``64KB``, ``1MB``, ``512B`` or a plain number (KB = 1024 bytes). Raises ConfigError."""
    raw = text.strip().upper()
    digits = raw.rstrip("KMIB")
    unit = raw[len(digits):] or "B"
    if not digits.isdigit() or unit not in _UNITS:
        raise ConfigError(f"--sizes: {text!r} is not a size (write 1KB, 64KB, 1MB, 16MB or a number of bytes)")
    return int(digits) * _UNITS[unit]


def run_bench_spans(args: argparse.Namespace) -> int:
    """``edgeswarm bench spans``: the cost of recording one span (``edgeswarm.bench.spans``)."""
    from edgeswarm.bench.spans import measure_span_cost

    if args.spans < 1 or args.repeats < 1:
        raise ConfigError("--spans and --repeats must be at least 1")
    cost = measure_span_cost(args.spans, args.repeats)
    console.print(f"recording a span, CPU time per span, best of {args.repeats} x {cost.spans} spans on this machine:")
    console.print(f"  empty nullcontext block (baseline) {cost.baseline_ns:8.0f} ns")
    base = cost.baseline_ns
    console.print(f"  with lane.span(...)                {cost.span_ns:8.0f} ns  ({cost.span_ns / base:.1f}x "
                  f"the baseline, +{cost.overhead_ns:.0f} ns)")
    console.print(f"  lane.add(t0, t1) with its clocks   {cost.add_ns:8.0f} ns  ({cost.add_ns / base:.1f}x)")
    console.print(f"  batches(): to a published record   {cost.batch_ns:8.0f} ns  (on the publishing thread)")
    return 0


def run_bench_collectives(args: argparse.Namespace) -> int:
    """``edgeswarm bench collectives``: ring and direct collectives through the bus against the link and bare paho,
    a decode step's AllReduce, the 1 KB two-instance rate and a bulk tensor (``edgeswarm.bench.collectives``), and
    the bus's goals as measured."""
    from edgeswarm.bench.collectives import MAX_PEERS, MAX_SIZE, OPS, run_collectives_bench

    if args.quick:
        args.peers, args.sizes = "2,4", "1KB,1MB"
        args.repeats = args.repeats or 5
        args.rate_messages = min(args.rate_messages, 5000)
        args.decode_repeats = min(args.decode_repeats, 50)
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if not ops or unknown:
        raise ConfigError(f"--ops: each is one of {', '.join(OPS)}, not {unknown or 'none'}")
    try:
        peers = tuple(int(p) for p in args.peers.split(",") if p.strip())
    except ValueError:
        raise ConfigError(f"--peers: {args.peers!r} is not a comma-separated list of numbers") from None
    bad_peers = [p for p in peers if not 2 <= p <= MAX_PEERS]
    if not peers or bad_peers:
        raise ConfigError(f"--peers: each count is 2 to {MAX_PEERS}, not {bad_peers or 'none'}")
    sizes = tuple(parse_size(s) for s in args.sizes.split(",") if s.strip())
    bad_sizes = [s for s in sizes if not 4 <= s <= MAX_SIZE or s % 4]
    if not sizes or bad_sizes:
        raise ConfigError(f"--sizes: each is a whole number of float32 elements (a multiple of 4 bytes) up to "
                          f"{MAX_SIZE // MB} MB, not {bad_sizes or 'none'}")
    if args.repeats < 0 or args.rate_messages < 1 or args.decode_repeats < 0:
        raise ConfigError("--repeats and --decode-repeats must be 0 or more and --rate-messages at least 1")
    bulk = 0 if args.bulk.strip() == "0" else parse_size(args.bulk)
    if bulk and (not 4 <= bulk <= MAX_SIZE or bulk % 4):
        raise ConfigError(f"--bulk: a whole number of float32 elements up to {MAX_SIZE // MB} MB, or 0, not "
                          f"{args.bulk}")
    report = run_collectives_bench(peers=peers, sizes=sizes, ops=ops, repeats=args.repeats or None,  # type: ignore[arg-type]
                                   rate_messages=args.rate_messages, decode_repeats=args.decode_repeats,
                                   bulk_bytes=bulk, processes=args.processes,
                                   progress=lambda m: err_console.print(f"[dim]{m}[/dim]", highlight=False))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(report.model_dump_json(indent=2))
    for line in collectives_lines(report):
        console.print(line, highlight=False)
    for how, rows, decode in (("all ranks in one process", report.rows, report.decode),
                              ("a process per rank", report.process_rows, report.process_decode)):
        if rows:
            console.print(collectives_table(rows, how))
        for row in decode:
            console.print(f"decode AllReduce ({how}), {row.peers} ranks x {row.hidden} {row.dtype} ({row.repeats} "
                          f"times): bus median {row.bus_median_s * 1e3:.2f} ms, p99 {row.bus_p99_s * 1e3:.2f} ms; "
                          f"bare paho median {row.paho_median_s * 1e3:.2f} ms, p99 {row.paho_p99_s * 1e3:.2f} ms; "
                          f"bus/paho {row.over_paho:.2f}", highlight=False)
    goals = Table(title="the bus's goals (issue 31), as measured in this run")
    for col in ("goal", "target", "measured", "met"):
        goals.add_column(col)
    for goal in report.goals:
        goals.add_row(goal.name, goal.target, goal.measured, "yes" if goal.met else "no")
    console.print(goals)
    return 0


def collectives_lines(report: CollectivesReport) -> list[str]:
    """The link, the rate and the bulk transfer, one line each."""
    from edgeswarm.bench.collectives import human_size

    r = report.rate
    return [f"{report.broker}, loopback bulk rate {report.loopback_mb_s:.0f} MB/s, chunks of "
            f"{report.chunk_bytes // KB} KiB, QoS 1",
            f"{r.payload_bytes // KB} KB one way between two instances: bus {r.bus_per_s:.0f} msg/s, bare paho "
            f"{r.paho_per_s:.0f} msg/s, bus/paho {r.ratio:.2f} ({r.messages} messages)"] + (
        [] if (b := report.bulk) is None else
        [f"{human_size(b.size_bytes)} bulk between two instances: bus {b.bus_mb_s:.0f} MB/s, bare paho "
         f"{b.paho_mb_s:.0f} MB/s, loopback TCP {b.loopback_mb_s:.0f} MB/s; bus/loopback {b.over_loopback:.2f}"])


def collectives_table(rows: list[CollectiveRow], how: str) -> Table:
    """The collective rows: median time per collective through the bus, against bare paho and the link."""
    from edgeswarm.bench.collectives import human_size

    table = Table(title=f"collectives, {how}, median per collective (bus: Bus + TensorExchange + CollectivePort; "
                        "paho: the same frames and steps over bare paho)")
    for col in ("op", "peers", "vector", "msgs", "bus ms", "paho ms", "bus/paho", "link ms", "bus/link", "msg/s"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for row in rows:
        table.add_row(row.op, str(row.peers), human_size(row.size_bytes), str(row.messages), f"{row.bus_s * 1e3:.2f}",
                      f"{row.paho_s * 1e3:.2f}", f"{row.over_paho:.2f}", f"{row.link_s * 1e3:.3f}",
                      f"{row.over_link:.1f}", f"{row.messages_per_s:.0f}")
    return table


def _split_list(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{what}: give at least one, comma-separated")
    return items


def hmp_config(args: argparse.Namespace) -> HmpBenchConfig:
    """The benchmark's configuration from ``edgeswarm bench hmp``'s arguments. Raises ConfigError."""
    from pydantic import ValidationError

    from edgeswarm.bench.hmp import ENVS, MODES, SECTIONS, HmpBenchConfig
    from edgeswarm.values.text_model import PRESETS

    sections = _split_list(args.sections, "--sections")
    envs = _split_list(args.envs.lower(), "--envs")
    generation_envs = _split_list(args.generation_envs.lower(), "--generation-envs")
    models = _split_list(args.models, "--models")
    modes = _split_list(args.modes, "--modes")
    bad = ([f"section {s}" for s in sections if s not in SECTIONS]
           + [f"env {e}" for e in envs + generation_envs + [args.bandwidth_env, args.overlap_env]
              if e not in ENVS]
           + [f"mode {m}" for m in modes if m not in MODES]
           + [f"model {m}" for m in models + [args.bandwidth_model, args.scaling_model, args.generation_model]
              if m not in PRESETS])
    if bad:
        raise ConfigError(f"unknown {', '.join(bad)} (envs a-f; modes {', '.join(MODES)}; models: the presets "
                          f"{', '.join(PRESETS)})")
    try:
        bandwidths = [float(b) for b in _split_list(args.bandwidths, "--bandwidths")]
    except ValueError:
        raise ConfigError(f"--bandwidths: {args.bandwidths!r} is not a list of numbers (Mbps)") from None
    if any(b <= 0 for b in bandwidths) or args.requests < 1 or args.layers < 1 or args.seq_len < 1 \
            or not 1 <= args.scaling_devices <= 4 or args.weak_tokens < 1 or args.generation_tokens < 2:
        raise ConfigError("bandwidths, --requests, --layers, --seq-len and --weak-tokens must be positive, "
                          "--scaling-devices 1 to 4 and --generation-tokens at least 2")
    try:
        return HmpBenchConfig(sections=sections, envs=envs, models=models, modes=modes, layers=args.layers,
                              seq_len=args.seq_len, requests=args.requests, bandwidths=bandwidths,
                              bandwidth_env=args.bandwidth_env, bandwidth_model=args.bandwidth_model,
                              scaling_model=args.scaling_model, scaling_devices=args.scaling_devices,
                              scaling_seq_len=args.scaling_seq_len, weak_tokens=args.weak_tokens,
                              overlap_env=args.overlap_env, generation_envs=generation_envs,
                              generation_model=args.generation_model,
                              generation_layers=args.generation_layers, generation_prompt=args.generation_prompt,
                              generation_tokens=args.generation_tokens)
    except ValidationError as exc:
        raise ConfigError(f"bad bench hmp options: {exc}") from None


def run_bench_hmp(args: argparse.Namespace) -> int:
    """``edgeswarm bench hmp``: Galaxy against Megatron-TP, SP and Local measured on emulated Galaxy environments
    (``edgeswarm.bench.hmp``); tables, and every run as JSON with --json."""
    from edgeswarm.bench.hmp import run_hmp_bench

    config = hmp_config(args)
    trace = Path(args.trace) if args.trace else None
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
    report = run_hmp_bench(config, trace_path=trace, json_path=Path(args.json) if args.json else None,
                           log=lambda m: err_console.print(f"[dim]{escape(m)}[/dim]", highlight=False))
    for table in hmp_tables(report):
        console.print(table)
    for line in hmp_lines(report):
        console.print(line, highlight=False)
    return 0 if all(r.error is None or r.error.startswith("failed") for r in report.runs) else 1


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def layer_flops(model: str, seq_len: int) -> float:
    """Multiply-adds times two of one layer of ``model`` over ``seq_len`` tokens (the GEMMs and attention)."""
    from edgeswarm.values.text_model import PRESETS

    cfg = PRESETS[model]
    return 2.0 * seq_len * (cfg.attention_params() + cfg.mlp_params()) + 4.0 * seq_len * seq_len * cfg.hidden


def hmp_tables(report: HmpReport) -> list[Table]:
    """The report's tables: the environments, the bandwidth sweep, scaling, overlap and generation."""
    from edgeswarm.bench.hmp import galaxy_of, speedups

    runs = report.runs
    tables: list[Table] = []
    ups, ups_all = speedups(runs), speedups(runs, all_devices=True)
    verdicts = {(v.env, v.model, v.mode): v for v in report.verdicts}
    for section, title in (("envs", "Galaxy environments at 125 Mbps"), ("bandwidth", "bandwidth sweep")):
        rows = [r for r in runs if r.section == section]
        if not rows:
            continue
        c = report.config
        t = Table(title=f"{title}: {c.layers} layer(s) of each model, {c.seq_len} tokens, prefill, median of "
                        f"{c.requests} requests on the coordinator; speedup = mode's latency / Galaxy's")
        for col in ("env", "Mbps", "model", "mode", "devices", "heads", "predicted ms", "measured ms",
                    "meas / pred", "layer: compute / sync / wait ms", "Galaxy speedup", "full model (planner)"):
            t.add_column(col, justify="left" if col in ("env", "model", "mode", "devices", "heads",
                                                          "full model (planner)") else "right")
        for r in rows:
            v = verdicts.get((r.env, r.model, r.mode))
            full = "-" if v is None or section != "envs" else ("fits" if v.fits else "OOM" if "memory" in v.reason
                                                                 or "budget" in v.reason or "holds" in v.reason
                                                                 else "infeasible")
            if r.error:
                t.add_row(r.env.upper(), f"{r.bandwidth_mbps:g}", r.model, r.mode, "-", "-", "-",
                          escape(r.error[:60]), "-", "-", "-", full)
                continue
            up = ups.get((r.section, r.env, r.bandwidth_mbps, r.model), {}).get(r.mode)
            up_all = ups_all.get((r.section, r.env, r.bandwidth_mbps, r.model), {}).get(r.mode)
            label = r.mode + ("" if r.mode != "galaxy" else " (all devices)" if not r.prune else " (planned)")
            t.add_row(r.env.upper(), f"{r.bandwidth_mbps:g}", r.model, label, str(len(r.devices)),
                      "/".join(map(str, r.heads)), _ms(r.predicted_s), _ms(r.latency_s), _x(r.ratio),
                      f"{r.compute_ms or 0:.0f} / {r.sync_ms or 0:.0f} / {r.waiting_ms or 0:.0f}",
                      "" if r.mode == "galaxy" else _x(up) if up == up_all else f"{_x(up)} ({_x(up_all)} all)",
                      full)
        tables.append(t)
    strong = {len(r.devices): r for r in runs if r.section == "strong" and r.latency_s}
    weak = {len(r.devices): r for r in runs if r.section == "weak" and r.latency_s}
    if strong or weak:
        t = Table(title="scaling: one layer on 1-4 Nano-M at 1000 Mbps (Galaxy, no devices left out; 1: Local)")
        for col in ("devices", "strong: tokens", "latency ms", "vs Local", "efficiency", "weak: tokens",
                    "latency ms", "GFLOP/s", "efficiency"):
            t.add_column(col, justify="right")
        for n in sorted(set(strong) | set(weak)):
            s, w = strong.get(n), weak.get(n)
            vs = strong[1].latency_s / s.latency_s if s and 1 in strong and s.latency_s else None
            gf = layer_flops(w.model, w.seq_len) / w.latency_s / 1e9 if w and w.latency_s else None
            gf1 = (layer_flops(weak[1].model, weak[1].seq_len) / weak[1].latency_s / 1e9 if 1 in weak
                   and weak[1].latency_s else None)
            t.add_row(str(n), str(s.seq_len) if s else "-", _ms(s.latency_s if s else None), _x(vs),
                      f"{vs / n:.0%}" if vs else "-", str(w.seq_len) if w else "-", _ms(w.latency_s if w else None),
                      f"{gf:.2f}" if gf else "-", f"{gf / gf1 / n:.0%}" if gf and gf1 else "-")
        tables.append(t)
    off = [r for r in runs if r.section == "overlap" and r.latency_s]
    if off:
        t = Table(title="overlap: Galaxy with tiles overlapping communication and GEMMs, against without")
        for col in ("env", "model", "overlap on ms", "overlap off ms", "saved ms", "on: wait ms", "off: wait ms",
                    "predicted on / off ms"):
            t.add_column(col, justify="left" if col in ("env", "model") else "right")
        for r in off:
            on = galaxy_of(runs, "envs", r.env, r.bandwidth_mbps, r.model, all_devices=True)
            if on is None or on.latency_s is None or r.latency_s is None:
                continue
            t.add_row(r.env.upper(), r.model, _ms(on.latency_s), _ms(r.latency_s), _ms(r.latency_s - on.latency_s),
                      f"{on.waiting_ms or 0:.0f}", f"{r.waiting_ms or 0:.0f}",
                      f"{_ms(on.predicted_s)} / {_ms(r.predicted_s)}")
        tables.append(t)
    gen = [r for r in runs if r.section == "generation"]
    if gen:
        passes = {(r.env, r.mode): r for r in runs if r.section == "token-pass"}
        t = Table(title="generation at 1000 Mbps: greedy tokens from the sharded KV cache; network share = sync + "
                        "waiting over the slowest rank's time in a one-token pass")
        for col in ("env", "devices", "model", "mode", "TTFT ms", "TPOT ms", "predicted TPOT ms",
                    "Galaxy's speedup", "network share", "predicted share"):
            t.add_column(col, justify="left" if col in ("env", "model", "mode") else "right")
        for r in gen:
            if r.error:
                t.add_row(r.env.upper(), "-", r.model, r.mode, escape(r.error[:60]), *["-"] * 5)
                continue
            galaxy = next((x for x in gen if x.env == r.env and x.mode == "galaxy" and x.tpot_s), None)
            p = passes.get((r.env, r.mode))
            vs = r.tpot_s / galaxy.tpot_s if galaxy and galaxy.tpot_s and r.tpot_s and r.mode != "galaxy" else None
            t.add_row(r.env.upper(), str(len(r.devices)), f"{r.model} x{r.layers}", r.mode, _ms(r.ttft_s),
                      _ms(r.tpot_s), _ms(r.predicted_tpot_s), _x(vs),
                      f"{p.network_share:.0%}" if p and p.network_share is not None else "-",
                      f"{r.predicted_network_share:.0%}" if r.predicted_network_share is not None else "-")
        tables.append(t)
    return tables


def hmp_lines(report: HmpReport) -> list[str]:
    """The goals checked, one line each, and where the trace is."""
    from edgeswarm.bench.hmp import speedups

    lines = []
    homo = {"a", "b", "c"}
    every = speedups(report.runs, all_devices=True)
    for (section, env, bw, model), cell in speedups(report.runs).items():
        if section != "envs":
            continue
        goal = 1.46 if env in homo else 2.5
        for what, c in (("as planned", cell), ("on every device", every.get((section, env, bw, model), {}))):
            if what != "as planned" and (c == cell or all(v is None for v in c.values())):
                continue
            mlm = c.get("megatron")
            worst = min((v for v in c.values() if v is not None), default=None)
            lines.append(f"Env {env.upper()} {model}, Galaxy {what}: {_x(mlm)} over Megatron-TP (goal >= {goal}x: "
                         f"{'met' if mlm and mlm >= goal else 'missed'}); against the fastest baseline "
                         f"{_x(worst)} ({'never slower' if worst is None or worst >= 1.0 else 'SLOWER'})")
    ratios = [r.ratio for r in report.runs if r.ratio is not None and r.section in ("envs", "bandwidth")]
    if ratios:
        inside = sum(0.8 <= x <= 1.2 for x in ratios)
        lines.append(f"measured / predicted: {inside} of {len(ratios)} runs within 20% (range {min(ratios):.2f}x "
                     f"to {max(ratios):.2f}x)")
    if report.trace:
        lines.append(f"Chrome trace of one Galaxy pass: {report.trace} ({report.trace_overlaps} communication spans "
                     "overlap a GEMM span); open it in https://ui.perfetto.dev")
    return lines
