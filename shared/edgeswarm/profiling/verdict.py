"""How a benchmark's predictions came true: each cell's measured over predicted figure, the count within the goal's
tolerance, and for each miss what the run itself says of it.

A miss is put down, in this order, to:

* a saturated host (``profiling.host_load``): the emulated devices could wait for cores, so the cell may measure this
  host rather than the plan;
* the devices' speeds, when the cell is within ``REFIT_TOLERANCE`` of the closed loop's refitted prediction (the
  same plan priced on what the job measured): the plan's shape was priced right, the profile's speeds were not
  those of the run;
* nothing the run measured, otherwise: the cell's figure against its refitted one is given.

Pure functions over ``Cell``s; each benchmark makes its cells from its own rows.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from edgeswarm.profiling.host_load import SATURATED_NOTE, saturated

TOLERANCE = 0.15  # issue 33's goal: measured/predicted within 15 percent
REFIT_TOLERANCE = 0.10  # the goal once the closed loop has converged


class Cell(BaseModel):
    """One measured cell: ``ratio`` is measured over predicted (a time's, or a throughput's), ``refitted_ratio``
    measured over the closed loop's refitted prediction (None: none was made), ``host_busy`` the host's busy share
    over the cell (None: not read)."""

    model_config = ConfigDict(frozen=True)

    name: str
    ratio: float
    refitted_ratio: float | None = None
    host_busy: float | None = None


class Miss(BaseModel):
    model_config = ConfigDict(frozen=True)

    cell: Cell
    why: str


class Verdict(BaseModel):
    """``within`` of ``cells`` cells within ``TOLERANCE``; each miss with what the run says of it; whether any cell
    ran on a saturated host."""

    model_config = ConfigDict(frozen=True)

    cells: int
    within: int
    misses: list[Miss]
    saturated: bool = False


def _inside(ratio: float, tolerance: float) -> bool:
    return abs(ratio - 1.0) <= tolerance + 1e-12


def why_missed(cell: Cell) -> str:
    """What the run measured that accounts for ``cell``'s miss (see the module's docstring)."""
    if cell.host_busy is not None and saturated(cell.host_busy):
        return f"host {cell.host_busy:.0%} busy: the emulated devices could wait for cores"
    if cell.refitted_ratio is None:
        return "no refitted prediction to compare with"
    if _inside(cell.refitted_ratio, REFIT_TOLERANCE):
        return (f"{cell.refitted_ratio:.2f}x of its refitted prediction: the devices ran at other speeds than "
                "profiled")
    return f"{cell.refitted_ratio:.2f}x of its refitted prediction too: not explained by the run"


def verdict(cells: list[Cell]) -> Verdict:
    """The count of ``cells`` within ``TOLERANCE`` and each miss with its reason, in the cells' order."""
    misses = [Miss(cell=c, why=why_missed(c)) for c in cells if not _inside(c.ratio, TOLERANCE)]
    return Verdict(cells=len(cells), within=len(cells) - len(misses), misses=misses,
                   saturated=any(saturated(c.host_busy) for c in cells))


def verdict_lines(v: Verdict, what: str = "cells") -> list[str]:
    """The verdict for people: a line with the count of ``what`` (the cells' noun), one per miss, and what a
    saturated host means where a cell ran on one."""
    if v.cells == 0:
        return []
    lines = [f"{what}: measured / predicted within {TOLERANCE:.0%} in {v.within} of {v.cells} "
             f"({v.within / v.cells:.0%})"]
    lines += [f"  miss: {m.cell.name} {m.cell.ratio:.2f}x ({m.why})" for m in v.misses]
    return lines + ([SATURATED_NOTE] if v.saturated else [])
