"""``edgeswarm health SERVICE``: whether a service on this machine is heartbeating (compose's healthcheck).

Exit status 0 when the service's heartbeat stamp (edgeswarm.runtime.health) is fresh, 1 when it is stale or
missing, 2 for a usage mistake. It reads only a local file: it works while the brokers are down, and is cheap
enough to run every few seconds.
"""

from __future__ import annotations

import argparse

from edgeswarm.cli.console import console, err_console
from edgeswarm.errors import ConfigError
from edgeswarm.runtime.health import check_health, stamp_path
from edgeswarm.service_registry import service_names


def add_health_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``health SERVICE [--node N] [--max-age S]`` under the subparsers ``sub``."""
    health = sub.add_parser("health", help="exit 0 when SERVICE on this machine heartbeats (container healthcheck)")
    health.add_argument("service", help="the service to check: " + ", ".join(service_names()))
    health.add_argument("--node", default=None,
                        help="its node id (default: $EDGESWARM_NODE_ID, as the service takes it)")
    health.add_argument("--max-age", type=float, default=None, metavar="S",
                        help="seconds since its last heartbeat beyond which it is unhealthy (default: what the "
                        "service stamped, its heartbeat interval x EDGESWARM_HEARTBEAT_TIMEOUT_FACTOR)")


def run_health(args: argparse.Namespace) -> int:
    """Print one line on the service's health; 0 when healthy, 1 when not. Raises ConfigError for an unknown
    service or an invalid setting."""
    from edgeswarm.cli.service import load_settings

    # By name only: a healthcheck imports nothing of the plug-ins.
    if args.service not in service_names():
        raise ConfigError(f"unknown service {args.service!r}; available: {', '.join(sorted(service_names()))}")
    settings = load_settings()
    # Without --node, the node id the service itself would take from this environment (this host's name if unset).
    node = args.node or settings.node_id
    verdict = check_health(stamp_path(settings.health_dir, node, args.service), max_age_s=args.max_age)
    if verdict.healthy:
        console.print(f"healthy: {verdict.detail}", markup=False, highlight=False)
        return 0
    err_console.print(f"unhealthy: {verdict.detail}", markup=False, highlight=False)
    return 1
