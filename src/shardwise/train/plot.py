"""``--plot``: loss and memory over the steps as a PNG, drawn by matplotlib,
the optional ``plot`` extra (``pip install 'shardwise[plot]'``). The figure
is rendered by matplotlib's Agg backend through its own canvas, so no display
is needed and the backend of a program that embeds the loop (pyplot's global
choice) is left alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import ConfigError

__all__ = ["Panel", "check_matplotlib", "write_plot"]

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")  # one per panel, top to bottom


@dataclass(frozen=True)
class Panel:
    """One line chart: a title and a series of ``(x, y)`` values."""

    title: str
    xs: Sequence[float]
    ys: Sequence[float]


def check_matplotlib(plot: str) -> None:
    """A :class:`ConfigError` naming the fix if ``plot`` (a PNG path) is set
    but matplotlib is not installed; checked with the configuration, before
    any rank starts, rather than after the training, when the plot is drawn.

    Args:
        plot: the ``plot`` setting (empty: no plot, nothing to check).
    """
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            f"plot={plot!r} needs matplotlib, which is not installed: run `pip install 'shardwise[plot]'` "
            "(or `pip install matplotlib`), or drop --plot"
        )


def write_plot(path: str | os.PathLike[str], panels: Sequence[Panel]) -> None:
    """Write ``panels`` as a PNG at ``path`` (parent directories created), one
    line chart per panel, stacked, sharing the step axis. Non-finite values
    (a diverged loss) leave gaps.

    Args:
        path: the PNG file.
        panels: the charts, top to bottom.
    """
    target = Path(path)
    check_matplotlib(str(target))
    figure_module = importlib.import_module("matplotlib.figure")
    agg = importlib.import_module("matplotlib.backends.backend_agg")
    target.parent.mkdir(parents=True, exist_ok=True)
    fig = figure_module.Figure(figsize=(7.2, 2.6 * max(1, len(panels))), dpi=100)
    agg.FigureCanvasAgg(fig)  # Agg renders this figure only: no pyplot, no global backend switch
    axes = fig.subplots(max(1, len(panels)), 1, sharex=True, squeeze=False)[:, 0]
    for i, (ax, panel) in enumerate(zip(axes, panels)):
        ax.plot(list(panel.xs), list(panel.ys), color=COLOURS[i % len(COLOURS)], linewidth=1.5)
        ax.set_title(panel.title, loc="left", fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(target, format="png")
