"""The job kinds' own commands on the command line: their verbs (``edgeswarm NAME``) and benchmarks (``edgeswarm
bench NAME``), found through the workload registry (``Workload.commands``, ``Workload.benches``), a plug-in's
included, and run with what the command line lends them (``workloads.commands.CommandTools``)."""

from __future__ import annotations

import argparse
from typing import Literal

from rich.markup import escape

from edgeswarm.bench.clusters import running_cluster
from edgeswarm.bus import Bus
from edgeswarm.cli.common import add_hub_arg, cli_settings
from edgeswarm.cli.console import console, err_console
from edgeswarm.runtime.client import client_bus
from edgeswarm.workloads import kind_commands
from edgeswarm.workloads.commands import Command, CommandTools


def add_kind_commands(sub: argparse._SubParsersAction, which: Literal["commands", "benches"]) -> None:  # type: ignore[type-arg]
    """Add every installed kind's verbs (``which`` "commands") or benchmarks ("benches") to the subcommands ``sub``;
    one warning line for each that cannot be offered (a plug-in's that does not load, a name already taken)."""
    commands, problems = kind_commands(which, taken=set(sub.choices))
    for problem in problems:
        err_console.print(f"[yellow]warning:[/yellow] {escape(problem)}", soft_wrap=True)
    for command in commands:
        parser = sub.add_parser(command.name, help=command.help)
        command.add_arguments(parser)
        if command.hub:
            add_hub_arg(parser)
        parser.set_defaults(kind_command=command)


def command_tools(args: argparse.Namespace) -> CommandTools:
    """What the command line lends a kind's command run with ``args``: its consoles, a bus to the hub ``args.hub``
    (or $EDGESWARM_HUB_URL) names, and local clusters."""

    def hub_bus(role: str) -> Bus:
        return client_bus(cli_settings(getattr(args, "hub", None)), role=role)

    return CommandTools(console=console, err_console=err_console, cluster=running_cluster, hub_bus=hub_bus)


def run_kind_command(args: argparse.Namespace) -> int:
    """Run the kind's command ``args.kind_command`` with ``command_tools(args)``."""
    command: Command = args.kind_command
    return command.run(args, command_tools(args))
