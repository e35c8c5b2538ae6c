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

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from edgeswarm.workloads.commands import CommandTools


class PeersConfig(BaseModel):
    """What every section is asked to run: ``quick`` (the smallest sizes, one cell: what the test suite runs, to
    check that every cross-check holds and every row has figures), the ``bandwidths`` (Mbps) and device counts of
    the cells, and ``requests`` (measured repetitions of each figure)."""

    model_config = ConfigDict(extra="forbid")

    quick: bool = False
    bandwidths: list[float] = Field(default_factory=lambda: [125.0, 1000.0], min_length=1)
    devices: list[int] = Field(default_factory=lambda: [2, 3, 4], min_length=1)
    requests: int = Field(default=3, ge=1, le=100)


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
    table) and ``extra`` (the optional extra whose packages its peer needs, "" for none)."""

    name: ClassVar[str]
    title: ClassVar[str]
    extra: ClassVar[str] = ""

    @abstractmethod
    def run(self, config: PeersConfig, tools: CommandTools) -> list[PeerRow]:
        """Measure every cell of ``config`` both ways (clusters from ``tools.cluster`` with ``netns=True``), logging
        progress with ``tools.log``. A cell one side cannot run is a row with its ``error``; raises EdgeswarmError
        only when nothing could be measured at all."""
