"""What a kind adds to ``edgeswarm bench peers``: a section that runs the kind and a tool its users would pick
instead (Flower, torch's own pipeline or tensor parallelism) on the same cluster, model, data and seeds, and says
how they compare.

A kind names its sections in ``Workload.peers`` ("module:Class" of a ``PeerSection``); the command line finds them
through the registry, runs the ones asked for on clusters in network namespaces (so the peer's processes cross the
same kernel-shaped links as the kind's services) and prints every section's rows in one table. A row is one figure
measured both ways in one run (``ours`` and ``peer``, in ``unit``), the raw figures beside it, and the cross-check
that makes the comparison fair (the same outputs, the same math) with whether it held.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgeswarm.devices.compute import sharing_cores
from edgeswarm.errors import ConfigError, EdgeswarmError

if TYPE_CHECKING:
    import torch

    from edgeswarm.devices.emulation import DeviceProfile
    from edgeswarm.workloads.commands import BenchCluster, CommandTools

R = TypeVar("R", bound=BaseModel)
FAILED_GRACE_S = 5.0  # after one rank failed, how long the others get to finish


class PeersConfig(BaseModel):
    """What every section is asked to run: ``quick`` (the smallest sizes, one cell: what the test suite runs, to
    check that every cross-check holds and every row has figures), the ``bandwidths`` (Mbps) and device counts of
    the cells, ``requests`` (measured repetitions of each figure) and ``flower_env``, the virtual environment Flower
    runs from ("": this one)."""

    model_config = ConfigDict(extra="forbid")

    quick: bool = False
    bandwidths: list[float] = Field(default_factory=lambda: [125.0, 1000.0], min_length=1)
    devices: list[int] = Field(default_factory=lambda: [2, 3, 4], min_length=1)
    requests: int = Field(default=3, ge=1, le=100)
    flower_env: str = ""


class Figure(BaseModel):
    """One raw figure beside a row: ``name``, ``value`` in ``unit`` (None: not measured)."""

    model_config = ConfigDict(frozen=True)

    name: str
    value: float | None
    unit: str = ""


class PeerRow(BaseModel):
    """One figure of one cell, measured on our kind (``ours``) and on the peer (``peer``) in one run, in ``unit``
    (``better``: which way is better). ``checked``: the cell's cross-check held (``check`` says what it compared,
    and by how much they differed); ``error``: why a side has no figure (the peer cannot run the cell, say)."""

    section: str
    cell: str
    metric: str
    ours: str
    peer: str
    ours_value: float | None = None
    peer_value: float | None = None
    unit: str = "s"
    better: Literal["lower", "higher"] = "lower"
    checked: bool | None = None
    check: str = ""
    error: str = ""
    figures: list[Figure] = Field(default_factory=list)

    @property
    def advantage(self) -> float | None:
        """How many times better ours is than the peer's (above 1: ours is ahead); None without both figures."""
        if not self.ours_value or not self.peer_value:
            return None
        if self.better == "lower":
            return self.peer_value / self.ours_value
        return self.ours_value / self.peer_value


class PeerSection(ABC):
    """One section of ``edgeswarm bench peers``: ``name`` (as ``--sections`` names it), ``title`` (one line for the
    table), ``extra`` (the optional extra whose packages its peer needs, "" for none) and ``netns`` (whether it runs
    its clusters in network namespaces: root, iproute2, nftables and Mosquitto)."""

    name: ClassVar[str]
    title: ClassVar[str]
    extra: ClassVar[str] = ""
    netns: ClassVar[bool] = True

    @abstractmethod
    def run(self, config: PeersConfig, tools: CommandTools) -> list[PeerRow]:
        """Measure every cell of ``config`` both ways (clusters from ``tools.cluster`` with ``netns=True``), logging
        progress with ``tools.log``. A cell one side cannot run is a row with its ``error``; raises EdgeswarmError
        only when nothing could be measured at all."""


def run_ranks(running: BenchCluster, nodes: list[str], argv: Callable[[int, str, Path], list[str]], result: type[R],
              *, name: str, wait_s: float) -> R:
    """A peer's processes over torch.distributed: rank r on ``nodes[r]`` (in its namespace, across its shaped link)
    running ``argv(r, master, out)``, where ``master`` is rank 0's address:port and ``out`` the file rank 0 writes
    its ``result`` to (JSON); that result. Every process is stopped by its PID before this returns. Raises
    EdgeswarmError naming ``name`` when a rank fails without rank 0's result or they do not finish within
    ``wait_s`` seconds."""
    port = random.randint(20000, 29999)  # a namespace of its own: nothing listens there but its broker
    master = f"{running.address(nodes[0])}:{port}"
    with tempfile.TemporaryDirectory(prefix="edgeswarm-peer-") as folder:
        out = Path(folder) / "result.json"
        base = peer_env()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank, node in enumerate(nodes):
                # gloo finds the address it tells its peers from the host name, which a namespace resolves to
                # loopback: it is told the interface that reaches them.
                env = {**base, "GLOO_SOCKET_IFNAME": running.interface(node)}
                procs.append(running.spawn(node, argv(rank, master, out), env=env,
                                           log_path=Path(folder) / f"rank{rank}.log"))
            deadline = time.monotonic() + wait_s
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    # a rank failed (rank 0 says why when it can); the others would wait for it until gloo's timeout
                    deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
                time.sleep(0.2)
            if out.exists():
                try:
                    return result.model_validate_json(out.read_text())
                except ValidationError as exc:
                    raise EdgeswarmError(f"{name}: rank 0 wrote an unreadable result: {exc}") from None
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is None:
                raise EdgeswarmError(f"{name} on {', '.join(nodes)}: no result within {wait_s:.0f} s")
            said = (Path(folder) / f"rank{failed}.log").read_text(errors="replace")[-1500:]
            raise EdgeswarmError(f"{name} on {', '.join(nodes)}: rank {failed} failed: {said}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=30)


def peer_env() -> dict[str, str]:
    """The environment of a peer's processes: this one's, less our settings but where to compute (the peer is no
    node of the cluster), sharing the host's cores as the cluster's services do (``devices.compute.sharing_cores``)."""
    return sharing_cores({k: v for k, v in os.environ.items()
                          if not k.startswith("EDGESWARM_") or k == "EDGESWARM_COMPUTE"})


def rank_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """The options every peer's rank program takes: ``--rank``, ``--world``, ``--master`` (rank 0's address:port),
    ``--device-class`` (what the rank computes as) and ``--out`` (where rank 0 writes its result)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="rank 0's address:port")
    p.add_argument("--device-class", default="native")
    p.add_argument("--out", type=Path, required=True, help="where rank 0 writes its result (JSON)")
    return p


def finish_rank(args: argparse.Namespace, result: BaseModel, error: str) -> int:
    """Rank 0 writes ``result`` to ``args.out``; the exit status: 1 when ``error`` says why the peer could not run."""
    if args.rank == 0:
        args.out.write_text(result.model_dump_json())
    return 1 if error else 0


def exit_rank(code: int) -> None:
    """End a peer's rank process with ``code`` once its result is written: stdio flushed, then ``os._exit``. The
    interpreter's teardown would run the destructors of gloo's and torch's threads after the process group is gone,
    and a rank whose work was done (past the last barrier, its peer's result written) was seen to abort there."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_device(device_class: str, *, collectives: bool = True) -> tuple[DeviceProfile, torch.device]:
    """A peer's process computing as ``device_class``: its profile (the class's slow-down), its threads applied
    (``devices.compute.use_device_threads``), and where a worker of that class computes (EDGESWARM_COMPUTE, resolved
    as ``devices.compute.resolve_compute`` does; an emulated class: the CPU). With ``collectives`` (torch.distributed
    over gloo, on host tensors here) an accelerator is refused with ConfigError."""
    from edgeswarm.devices.compute import resolve_compute, use_device_threads
    from edgeswarm.devices.emulation import DeviceProfile
    from edgeswarm.settings import Settings

    device = DeviceProfile.of_class(device_class)
    use_device_threads(device)
    compute = resolve_compute(Settings().compute, device)
    if collectives and compute.type != "cpu":
        raise ConfigError(f"the torch peers run over gloo on the CPU, and {device.device_class} computes on "
                          f"{compute}: bench peers' cells use emulated classes (or set EDGESWARM_COMPUTE=cpu)")
    return device, compute
