"""The loss and accuracy curve of a training job as a PNG."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from edgeswarm.extras import missing_extra

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ModuleNotFoundError:  # matplotlib is the `plot` extra
    raise missing_extra("plot") from None

_DPI = 110


def render_loss_png(rounds: Sequence[int], losses: Sequence[float], accuracies: Sequence[float], path: pathlib.Path,
                    *, title: str = "") -> None:
    """Write loss (left axis) and accuracy (right axis, percent) against rounds done as a PNG at ``path``.
    Raises ValueError for sequences of different lengths or none at all, OSError when the file cannot be written."""
    if not rounds or not len(rounds) == len(losses) == len(accuracies):
        raise ValueError(f"need one loss and accuracy per round: {len(rounds)} rounds, {len(losses)} losses, "
                         f"{len(accuracies)} accuracies")
    fig = Figure(figsize=(7.0, 4.0), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(rounds, losses, marker="o", markersize=3, color="tab:blue", label="loss")
    ax.set_xlabel("rounds done")
    ax.set_ylabel("training loss (mean over the mini-batch)", color="tab:blue")
    acc = ax.twinx()
    acc.plot(rounds, [100 * a for a in accuracies], marker="s", markersize=3, color="tab:orange", label="accuracy")
    acc.set_ylabel("accuracy on the mini-batch (%)", color="tab:orange")
    acc.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    fig.suptitle(title or "training loss and accuracy", fontsize=11)
    fig.savefig(path, format="png")
