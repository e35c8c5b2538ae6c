"""What every subcommand shares: the ``--hub`` argument and the client settings it gives. (Kept apart from
``main``, which imports the subcommands, so that no subcommand imports ``main`` back.)"""

from __future__ import annotations

import argparse
import os

from edgeswarm.settings import Settings


def add_hub_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--hub`` (the hub broker URL) to ``parser``."""
    parser.add_argument("--hub", default=None,
                        help="hub broker URL, mqtt://host:port or mqtts://host:port (default: $EDGESWARM_HUB_URL or "
                        "mqtt://127.0.0.1:1883); credentials come from EDGESWARM_MQTT_USERNAME and "
                        "EDGESWARM_MQTT_PASSWORD_FILE")


def hub_url(arg: str | None) -> str | None:
    """The hub URL from ``--hub`` or ``$EDGESWARM_HUB_URL``; None when neither is given."""
    return arg or os.environ.get("EDGESWARM_HUB_URL")


def cli_settings(hub: str | None) -> Settings:
    """Settings for a command-line client, with ``--hub`` applied."""
    return Settings(hub_url=hub) if hub else Settings()
