"""The job kinds' own parts of the command line: their verbs (``edgeswarm NAME``), benchmarks (``edgeswarm bench
NAME``) and options of ``plan``, ``train`` and ``infer``, found through the workload registry (``Workload.commands``,
``benches``, ``plan_arguments``, ``train_arguments``, ``infer_arguments``), a plug-in's included, and run with what
the command line lends them (``workloads.commands.CommandTools``)."""

from __future__ import annotations

import argparse
from typing import Literal

from rich.markup import escape

from edgeswarm.bus import Bus
from edgeswarm.cli.common import add_hub_arg, cli_settings
from edgeswarm.cli.console import console, err_console
from edgeswarm.errors import ConfigError
from edgeswarm.plugins import load_target
from edgeswarm.runtime.client import client_bus
from edgeswarm.workloads import KINDS, installed_workload, kind_commands
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


def add_kind_arguments(parser: argparse.ArgumentParser,
                       hook: Literal["plan_arguments", "train_arguments", "infer_arguments"]) -> None:
    """Each installed kind's options for a command (its ``plan_arguments``, ``train_arguments`` or
    ``infer_arguments``) on ``parser``; a warning line for a plug-in's that cannot be added (one that does not load,
    an option another kind has)."""
    for kind in KINDS:
        work = installed_workload(kind)
        target = getattr(work, hook, "") if work is not None else ""
        if not target:
            continue
        try:
            load_target(target, f"the {hook.split('_')[0]} options of job kind {kind!r}")(parser)
        except (ConfigError, argparse.ArgumentError) as exc:
            err_console.print(f"[yellow]warning:[/yellow] {escape(str(exc))}", soft_wrap=True)


def command_tools(args: argparse.Namespace) -> CommandTools:
    """What the command line lends a kind's command run with ``args``: its consoles, a bus to the hub ``args.hub``
    (or $EDGESWARM_HUB_URL) names, and local clusters."""

    from edgeswarm.bench.clusters import running_cluster  # the launchers: only for a command that runs

    def hub_bus(role: str) -> Bus:
        return client_bus(cli_settings(getattr(args, "hub", None)), role=role)

    return CommandTools(console=console, err_console=err_console, cluster=running_cluster, hub_bus=hub_bus)


def run_kind_command(args: argparse.Namespace) -> int:
    """Run the kind's command ``args.kind_command`` with ``command_tools(args)``."""
    command: Command = args.kind_command
    return command.run(args, command_tools(args))
