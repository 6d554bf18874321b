"""What the scaling report's figures and tables share: each strategy's colours, how a
speedup is written (and marked where its baseline does not fit one device), and
which coordinates pick one panel of a grid of plots."""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from experiments.report.figure_files import save_figure
from experiments.scaling.baseline import UNFIT_BASELINE, UNFIT_NOTE
from experiments.scaling.view import ScalingView

__all__ = ["STRATEGY_COLORS", "LINE_COLORS", "EXTRA_COLORS", "UNFIT_BASELINE", "UNFIT_NOTE",
           "speedup_text", "baseline_fits", "colors", "panel", "save_titled", "titled",
           "UNFIT_LINE_NOTE"]

#: Light enough for black cell text.
STRATEGY_COLORS = {"single": "#c9c9c9", "kernel": "#7fb1e3", "data": "#f5ad79",
                   "hybrid": "#9fd08a"}
LINE_COLORS = {"single": "#555555", "kernel": "#1f6fc0", "data": "#e06a12",
               "hybrid": "#3c9a2a"}
EXTRA_COLORS = ["#d9a0d9", "#e6d37a", "#8fd3d3", "#e39a9a"]


#: The same on a line plot, which marks such a point with an open marker.
UNFIT_LINE_NOTE = ("open markers: `single` does not fit one device's memory at that network "
                   "and batch; the speedup is against its predicted step as if it did")


def speedup_text(value: float, baseline_fits: float = 1.0, unit: str = "") -> str:
    """A speedup with two figures at most, and at least one significant one (a point
    hundreds of times slower than one device reads 0.003, not 0.0), then ``unit``
    ("x" in a table), marked where its baseline could not run (`UNFIT_BASELINE`)."""
    if not np.isfinite(value):
        return ""
    text = (f"{value:.0f}" if value >= 9.95 else f"{value:.1f}" if value >= 0.095
            else f"{value:.1g}")
    return text + unit + (UNFIT_BASELINE if baseline_fits == 0 else "")


def baseline_fits(view: ScalingView) -> Any:
    """The store's `baseline_fits` (1 everywhere for a store written before it)."""
    ds = view.ds
    return ds.baseline_fits if "baseline_fits" in ds else xr.ones_like(ds.speedup)


def colors(strategies: list[str]) -> list[str]:
    """Each strategy's cell colour: its own, or one of the extras in turn."""
    extra = iter(EXTRA_COLORS * 4)
    return [STRATEGY_COLORS.get(s) or next(extra) for s in strategies]


def panel(view: Any, row_dim: str | None, row: int, column_dim: str | None,
           column: int) -> dict[str, Any]:
    """The coordinates that pick one panel of a rows x columns grid of plots."""
    pick = {}
    if row_dim:
        pick[row_dim] = view.ds[row_dim].values[row]
    if column_dim:
        pick[column_dim] = view.ds[column_dim].values[column]
    return pick


def titled(fig: Any, title: str, fixed_text: str, unfit: bool, note: str = UNFIT_NOTE
           ) -> Any:
    """Title a figure: with the dims it fixes, and `note` (what a marked speedup means)
    where it shows one; returns it."""
    if fixed_text:
        title += f"\n({fixed_text})"
    if unfit:
        title += f"\n{note}"
    fig.suptitle(title, fontsize=10)
    return fig


def save_titled(fig: Any, path: str, title: str, fixed_text: str, unfit: bool) -> None:
    """`titled`, then saved."""
    save_figure(titled(fig, title, fixed_text, unfit), path)
