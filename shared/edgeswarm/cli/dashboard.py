"""``edgeswarm dashboard --hub URL``: the dashboard service in this process, against any cluster; prints its URL.

It is an observer, not a member: it announces nothing (no status, heartbeat or Last Will), so it never shows among
the cluster's nodes, and a client identity (``edgeswarm credentials``) is enough to run it. Its messages (answers
to trace requests) name the node its broker identity names (EDGESWARM_MQTT_USERNAME), else EDGESWARM_NODE_ID when
set, else ``dashboard``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pydantic import ValidationError

from edgeswarm.cli.common import add_hub_arg, hub_url
from edgeswarm.cli.console import console
from edgeswarm.cli.failures import settings_problem
from edgeswarm.errors import ConfigError
from edgeswarm.logs import configure_logging
from edgeswarm.settings import Settings

DEFAULT_NODE = "dashboard"


def add_dashboard_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``dashboard`` to the subcommands."""
    p = sub.add_parser("dashboard", help="the cluster on one live page in the browser (nodes, links, jobs and their "
                       "plans, health warnings), its Prometheus metrics and jobs' traces")
    add_hub_arg(p)
    p.add_argument("--host", default=None,
                   help="listen on this address (default $EDGESWARM_DASHBOARD_HOST or 127.0.0.1; beyond loopback it "
                   "needs --token-file)")
    p.add_argument("--port", type=int, default=None,
                   help="listen on this port (default $EDGESWARM_DASHBOARD_PORT or 8080; 0: any free port)")
    p.add_argument("--token-file", default=None,
                   help="a file holding the token every request must carry (Authorization: Bearer, or ?token= on "
                   "the page's URL once)")


def dashboard_settings(args: argparse.Namespace) -> Settings:
    """The settings the command line and the environment give. Raises ConfigError naming a wrong value."""
    overrides: dict[str, object] = {}
    hub = hub_url(args.hub)
    if hub:
        overrides["hub_url"] = hub
    if args.host is not None:
        overrides["dashboard_host"] = args.host
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port takes 0 (any free port) to 65535, not {args.port}")
        overrides["dashboard_port"] = args.port
    if args.token_file is not None:
        overrides["dashboard_token_file"] = Path(args.token_file)
    try:
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise ConfigError(settings_problem(exc)) from None
    if "EDGESWARM_NODE_ID" not in os.environ:
        node = settings.credentials().username or DEFAULT_NODE
        settings = settings.model_copy(update={"node_id": node})
    return settings


def run_dashboard(args: argparse.Namespace) -> int:
    settings = dashboard_settings(args)
    configure_logging(settings.node_id, "dashboard", os.environ.get("EDGESWARM_LOG_LEVEL", "WARNING"),
                      settings.log_json)
    from edgeswarm.services.dashboard.service import DashboardService

    def listening(url: str) -> None:
        note = f" (token: {settings.dashboard_token_file})" if settings.dashboard_token_file else ""
        console.print(f"dashboard of {settings.hub_url} at {url}{note}; Ctrl-C stops it", markup=False,
                      soft_wrap=True)

    return DashboardService(settings, on_listening=listening, member=False).run()
