"""Commands a job kind adds to the command line: its own verbs (``edgeswarm NAME``, the kind's ``commands``) and its
benchmarks (``edgeswarm bench NAME``, its ``benches``).

A kind's package holds them (its ``cli`` and ``bench`` modules), built in or a plug-in's alike; the command line
offers them beside its own, builds their arguments and lends them what only the command line may hold
(``CommandTools``): its consoles, a client bus to the hub it names, and a way to start a whole cluster on this
machine. So a kind's commands never import the command line or the launchers above it.
"""

from __future__ import annotations

import argparse
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from rich.console import Console
from rich.markup import escape

from edgeswarm.errors import ConfigError
from edgeswarm.files import output_file

if TYPE_CHECKING:
    from edgeswarm.bus import Bus
    from edgeswarm.devices.cluster import ClusterSpec


def report_file(path: str) -> Path:
    """An argparse ``type`` for a file a command writes when it ends (``--out``): refused at once, with the reason,
    when it is a folder or under a file (``files.output_file``)."""
    try:
        return output_file(path)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


class BenchCluster(Protocol):
    """A cluster running on this machine for a benchmark (processes, or hosts in network namespaces)."""

    @property
    def hub_url(self) -> str: ...

    def client_env(self) -> dict[str, str]:
        """The environment of a client of this cluster (its hub URL and an operator's credentials)."""
        ...

    def power_cut(self, node: str) -> None:
        """SIGKILL every process of ``node``, as a power cut would."""
        ...

    def address(self, node: str) -> str:
        """``node``'s address on the cluster's network."""
        ...

    def interface(self, node: str) -> str:
        """The network interface ``node``'s processes reach the other nodes through."""
        ...

    def spawn(self, node: str, argv: list[str], *, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` as a process of ``node`` (in its namespace, across its shaped link, on a namespace
        cluster), its output to ``log_path``; the caller stops it."""
        ...

    def link_bytes(self, node: str) -> int | None:
        """Bytes through ``node``'s link so far, both ways, all protocols; None where nodes share loopback (a
        local cluster)."""
        ...


class StartCluster(Protocol):
    def __call__(self, spec: ClusterSpec, *, workdir: Path | None = None, extra_env: Mapping[str, str] | None = None,
                 skip_services: Sequence[str] = (), netns: bool = False, timeout_s: float = 120.0,
                 as_hub: bool = False) -> AbstractContextManager[tuple[BenchCluster, Bus]]:
        """``spec`` started on this machine (with ``netns``: each node a network namespace, its links shaped by the
        kernel) with a client bus on it, once every service it started is online (within ``timeout_s`` seconds, or
        EdgeswarmError); both are stopped when the block ends. ``extra_env`` goes to every service;
        ``skip_services`` are not started. The bus logs in as the operator, a client, unless ``as_hub``: then as the
        hub member, for a benchmark that runs a job's coordinator in its own process (on a secure cluster, only the
        hub may address the workers)."""
        ...


def pipeline_cluster(cluster: StartCluster, spec: ClusterSpec, profile_dir: Path, *, netns: bool = False,
                     as_hub: bool = False) -> AbstractContextManager[tuple[BenchCluster, Bus]]:
    """``spec`` started with ``cluster`` for pipelines only (no tensor-shard-worker competes for the host's cores),
    its devices sharing the profile cache ``profile_dir``: what the training, recovery and serving benchmarks run
    on. Its coordinator keeps every job on the plan its profiles give (no closed-loop re-plan, no saved speeds):
    the benchmarks compare plans as planned, with the loop's refitted predictions beside. ``as_hub``: see
    ``StartCluster``."""
    from edgeswarm.service_registry import TENSOR_SHARD_WORKER

    return cluster(spec, extra_env={"EDGESWARM_PROFILE_DIR": str(profile_dir), "EDGESWARM_REBALANCE": "false"},
                   skip_services=(TENSOR_SHARD_WORKER,), netns=netns, as_hub=as_hub)


@dataclass(frozen=True)
class CommandTools:
    """What the command line lends a kind's command: where its tables go, where its progress lines go, a client bus
    to the hub the command line names (``hub_bus(role)``: ``--hub`` or $EDGESWARM_HUB_URL, EDGESWARM_* credentials;
    the caller stops it), and clusters."""

    console: Console
    err_console: Console
    cluster: StartCluster
    hub_bus: Callable[[str], Bus]

    def log(self, message: str) -> None:
        """A progress line on stderr (dimmed), never read as markup."""
        self.err_console.print(f"[dim]{escape(message)}[/dim]", highlight=False)


class Command(ABC):
    """One command: ``name`` (unique among the kinds' and the command line's own), ``help`` (one line for
    ``--help``), its arguments and its run. ``hub``: the command line gives it ``--hub``, for ``tools.hub_bus``."""

    name: ClassVar[str]
    help: ClassVar[str]
    hub: ClassVar[bool] = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this command's options to its parser (none by default)."""
        return None

    @abstractmethod
    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        """Run with the parsed ``args``; returns the exit status. Raises ConfigError for a bad option (the command
        line reports it in one line) and EdgeswarmError when what it does cannot be done."""


class Bench(Command):
    """A benchmark, offered as ``edgeswarm bench NAME``."""
