"""``edgeswarm plan``: profile a cluster (or read saved profiles), plan HPP training, compare with the baselines.

The profiles come from one of three places: ``--profiles PATH`` (a saved ClusterProfile JSON, or a folder of
them, picked by model), ``--cluster FILE|NAME`` (start that cluster locally, have every emulated device's
profiler measure itself and its links, stop it), or ``--hub URL`` (profile the devices of a running cluster).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgeswarm.cli.console import err_console
from edgeswarm.cli.profile import parse_batch_sizes
from edgeswarm.devices.cluster import load_cluster
from edgeswarm.errors import ConfigError, ProfileError
from edgeswarm.extras import require_extra
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.messages.jobs import DEFAULT_KIND
from edgeswarm.plugins import load_target
from edgeswarm.profiling.cache import write_json_atomic
from edgeswarm.profiling.gather import profile_at_hub
from edgeswarm.values.profiles import ClusterProfile, ModelSpec, parse_config
from edgeswarm.workloads import KINDS, workload

DEFAULT_BATCH_SIZES = "1,2,4,8,16,32,64,128"


def add_plan_parser(sub: argparse._SubParsersAction, *, kind_options: bool = True) -> None:  # type: ignore[type-arg]
    """Register ``edgeswarm plan``; with ``kind_options``, every installed kind's own options too (its
    ``plan_arguments``: finding them imports every kind)."""
    p = sub.add_parser("plan", help="plan HPP training of a model on a cluster and compare with single, DP and PP")
    p.add_argument("--model", required=True, help="zoo model name (see `edgeswarm profile --help`)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="model config entry")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--cluster", help="cluster file or bundled name (e.g. asteroid-env-d-100mbps): started "
                                       "locally and profiled on the fly")
    src.add_argument("--profiles", help="a saved ClusterProfile JSON file, or a folder of them")
    src.add_argument("--hub", help="profile the online devices of the cluster at this hub broker URL")
    p.add_argument("--global-batch", type=int, default=256, help="samples per training round (default 256)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per round M (default: the best power of two for each strategy)")
    p.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default="sgd")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help="batch sizes to profile at")
    p.add_argument("--method", choices=("calibrated", "measured"), default="calibrated",
                   help="profiling method on emulated devices (see `edgeswarm profile`)")
    p.add_argument("--save-profiles", metavar="DIR", help="also write the cluster profile JSON into DIR")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the profiles")
    p.add_argument("--json", action="store_true", help="print the plan and baselines as JSON")
    p.add_argument("--png", metavar="FILE", help="draw the stage-to-device map and one round's 1F1B timeline")
    p.add_argument("--kind", default=DEFAULT_KIND, metavar="KIND",
                   help=f"the job kind to plan ({', '.join(KINDS)}; default {DEFAULT_KIND}: HPP training; "
                        "serve-pipeline: throughput-optimal pipelined inference)")
    p.add_argument("--exclude", default="", help="serve-pipeline, serve-hmp: comma-separated devices not to use")
    if kind_options:
        from edgeswarm.cli.kind_commands import add_kind_arguments

        add_kind_arguments(p, "plan_arguments")


def run_plan(args: argparse.Namespace) -> int:
    """``edgeswarm plan --kind KIND``: the kind's plan (its ``plan_cli``) for a cluster profiled on the fly, read
    from saved profiles or found at a running hub."""
    from edgeswarm.cli.kind_commands import command_tools

    tools = command_tools(args)
    work = workload(args.kind)
    if not work.plan_cli:
        raise ConfigError(f"job kind {args.kind} has no offline planner: `edgeswarm plan` cannot show its plan")
    show = load_target(work.plan_cli, f"the offline planner of job kind {args.kind!r}")
    if not work.plan_profiles_zoo:
        return int(show(args, None, tools))
    spec = ModelSpec(name=args.model, config=parse_config(args.config))
    if args.png:
        require_extra("plot")  # now, not after profiling a cluster
    if args.profiles:
        cluster = load_profiles(Path(args.profiles), spec)
    elif args.cluster:
        cluster = profile_local_cluster(args.cluster, spec, parse_batch_sizes(args.batch_sizes), args.method,
                                        args.timeout)
    else:
        cluster = profile_running_cluster(args.hub, spec, parse_batch_sizes(args.batch_sizes), args.method,
                                          args.timeout)
    if args.save_profiles:
        path = save_profiles(Path(args.save_profiles), cluster)
        err_console.print(f"cluster profile written to {path}")
    return int(show(args, cluster, tools))


def load_profiles(path: Path, spec: ModelSpec) -> ClusterProfile:
    """A ClusterProfile from a JSON file, or the one for ``spec`` (by model name and config) in a folder."""
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"no profile JSON files in {path}; write some with `edgeswarm plan ... --save-profiles`")
    found: list[str] = []
    for f in files:
        try:
            cluster = ClusterProfile.model_validate_json(f.read_text())
        except (OSError, ValueError) as exc:
            if not path.is_dir():
                raise ConfigError(f"{f} is not a cluster profile: {exc}") from exc
            continue
        found.append(cluster.model.model.name)
        if cluster.model.model.name == spec.name and all(cluster.model.model.config.get(k) == v
                                                         for k, v in spec.config.items()):
            return cluster
    raise ProfileError(f"no profile for {spec.name} {spec.config or ''} in {path} "
                       f"(found: {', '.join(found) or 'none'})")


def save_profiles(folder: Path, cluster: ClusterProfile) -> Path:
    """Write the cluster profile as ``folder/<model>-<fingerprint>.json``; returns the path."""
    path = folder / f"{cluster.model.model.name}-{cluster.model.fingerprint[:12]}.json"
    write_json_atomic(path, cluster.model_dump(mode="json"))
    return path


def profile_local_cluster(cluster_arg: str, spec: ModelSpec, batch_sizes: list[int], method: str,
                          timeout_s: float) -> ClusterProfile:
    """Start the cluster locally, profile every device and link over MQTT, and stop it."""
    cluster_spec = load_cluster(cluster_arg)
    nodes = [d.id for d in cluster_spec.devices]
    with LocalCluster(cluster_spec, dashboard_port=None) as local:
        err_console.print(f"started {cluster_arg} locally ({len(nodes)} devices, broker {local.hub_url}); profiling")
        return profile_at_hub(local.hub_url, spec, batch_sizes, method=method, timeout_s=timeout_s, nodes=nodes,
                              progress=_progress)


def profile_running_cluster(hub: str, spec: ModelSpec, batch_sizes: list[int], method: str,
                            timeout_s: float) -> ClusterProfile:
    """Profile the devices online at ``hub``."""
    return profile_at_hub(hub, spec, batch_sizes, method=method, timeout_s=timeout_s, progress=_progress)


def _progress(node: str, fraction: float, message: str) -> None:
    err_console.print(f"  {node}: {fraction:4.0%} {message}", highlight=False)


