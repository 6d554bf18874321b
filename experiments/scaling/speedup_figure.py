"""The scaling report's speedup figure (``scaling_speedup.png``): speedup against
devices per strategy, log-log, with the ideal line; one panel per link bandwidth and
row per network, one line per batch (darker: larger), a lone marker per mix."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import xarray as xr  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from experiments.report.figure_files import save_figure  # noqa: E402
from experiments.scaling.figure_style import (EXTRA_COLORS, LINE_COLORS,  # noqa: E402
                                              UNFIT_LINE_NOTE, baseline_fits, panel, titled)
from experiments.scaling.baseline import BASELINE  # noqa: E402
from experiments.scaling.view import ScalingView, one_device_only  # noqa: E402
from experiments.sweep.store_layout import DONE  # noqa: E402
from experiments.sweep.summary import base_strategy  # noqa: E402

__all__ = ["speedup_figure", "draw_speedup"]


def speedup_figure(view: ScalingView, path: str) -> bool:
    """Speedup against devices per strategy (log-log) with the ideal line."""
    fig = draw_speedup(view)
    if fig is not None:
        save_figure(fig, path)
    return fig is not None


def draw_speedup(view: ScalingView) -> Any:
    """`speedup_figure`'s figure, titled (None where the store has no devices dim)."""
    xdim = view.workers_dim
    if xdim is None:
        return None
    sdim, bdim, ldim = view.strategy_dim, view.batch_dim, view.bandwidth_dim
    column_dim = ldim
    shown = [d for d in (sdim, xdim, bdim, column_dim) if d]
    row_dim, fixed, fixed_text = view.layout(shown)
    figures = view.ds[["speedup", "capacity", "n_workers"]].assign(fits=baseline_fits(view))
    ds = figures.where(view.ds.status == DONE).isel(repeat=0).sel(fixed)
    unfit = bool((ds.fits == 0).any())
    strategies = view.labels(sdim) if sdim else [base_strategy(view.ds)]
    batches = view.labels(bdim) if bdim else [None]
    rows = view.labels(row_dim) if row_dim else [None]
    columns = view.labels(column_dim) if column_dim else [None]
    counts = view.plain_counts(xdim)  # connected lines; mixes are lone markers
    mixed = not counts.all()
    fig, axes = plt.subplots(len(rows), len(columns), squeeze=False, sharex=True, sharey=True,
                             figsize=(3.6 * len(columns) + 1.0, 3.2 * len(rows) + 1.0))
    top = float(np.nanmax(ds.capacity.values)) if np.isfinite(ds.capacity.values).any() else 1
    low = np.nanmin(ds.speedup.values) if np.isfinite(ds.speedup.values).any() else 1
    high = np.nanmax(ds.speedup.values) if np.isfinite(ds.speedup.values).any() else 1
    # darker and wider for larger batches; one batch as the largest (it was drawn faint)
    widths = np.linspace(1.0, 2.2, len(batches)) if len(batches) > 1 else np.array([2.0])
    alphas = np.linspace(0.35, 1.0, len(batches)) if len(batches) > 1 else np.array([1.0])
    extra = iter(EXTRA_COLORS * 4)
    colors = {s: LINE_COLORS.get(s) or next(extra) for s in strategies}
    for r, row in enumerate(rows):
        for c, column in enumerate(columns):
            ax = axes[r][c]
            pick = panel(view, row_dim, r, column_dim, c)
            cell = ds.sel(pick)
            ax.plot([1, max(top, 2)], [1, max(top, 2)], color="0.6", linestyle="--",
                    linewidth=1)
            for si, strategy in enumerate(strategies):
                lines = cell.isel({sdim: si}) if sdim else cell
                _strategy_lines(ax, lines, xdim, bdim, counts, colors[strategy], alphas,
                                widths)
            parts = [view.title(d, v) for d, v in ((row_dim, row), (column_dim, column)) if d]
            _speedup_axes(ax, ", ".join(parts) or "all", r == len(rows) - 1, c == 0, mixed)
    axes[0][0].set_ylim(max(low / 1.5, 1e-3), max(high, top) * 1.5)
    _speedup_legend(fig, colors, batches if bdim else [], alphas, widths, mixed)
    title = (f"{view.ds.attrs.get('sweep_name', '')}: predicted speedup against devices "
             "(missing points: infeasible)")
    return titled(fig, title, fixed_text, unfit, UNFIT_LINE_NOTE)


def _strategy_lines(ax: Any, lines: xr.Dataset, xdim: str, bdim: str | None,
                    counts: np.ndarray, color: Any, alphas: np.ndarray,
                    widths: np.ndarray) -> None:
    """One strategy's speedup on a panel: a line per batch over the plain device
    counts and a lone marker per mix; the baseline (`single`) as its speedup of 1."""
    if one_device_only(lines):
        ax.axhline(1.0, color=color, linestyle=":", linewidth=1.2)
        return
    for bi in range(len(alphas)):
        line = (lines.isel({bdim: bi}) if bdim else lines).transpose(xdim)
        x, y = line.capacity.values, line.speedup.values
        keep = np.isfinite(x) & np.isfinite(y)
        order = np.argsort(np.where(keep & counts, x, np.inf))
        order = order[:int((keep & counts).sum())]
        ax.plot(x[order], y[order], color=color, alpha=alphas[bi],
                linewidth=widths[bi], marker="o", markersize=2.5)
        lone = keep & ~counts
        ax.plot(x[lone], y[lone], color=color, alpha=alphas[bi],
                linestyle="none", marker="D", markersize=5)
        unfit = keep & (line.fits.values == 0)  # against a baseline no device could run
        for where, marker in ((unfit & counts, "o"), (unfit & ~counts, "D")):
            ax.plot(x[where], y[where], color=color, alpha=alphas[bi], linestyle="none",
                    marker=marker, markersize=5.5, markerfacecolor="white")


def _speedup_axes(ax: Any, title: str, bottom: bool, left: bool, mixed: bool) -> None:
    """A panel's log scales, grid, title, and labels on the bottom row and left column."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title, fontsize=9)
    if bottom:
        ax.set_xlabel("devices" + (" (mixes: summed relative speed)" if mixed
                                   else ""), fontsize=8)
    if left:
        ax.set_ylabel("speedup over one device", fontsize=8)
    ax.tick_params(labelsize=7)


def _speedup_legend(fig: Any, colors: dict[str, Any], batches: list, alphas: np.ndarray,
                    widths: np.ndarray, mixed: bool) -> None:
    """The ideal line, each strategy's colour, each batch's weight (`batches`: none
    where the batch is not swept) and the mixes' marker, right of the panels."""
    handles = [Line2D([], [], color="0.6", linestyle="--", label="ideal")]
    handles += [Line2D([], [], color=color, linewidth=2,
                       linestyle=":" if s == BASELINE else "-",
                       label=s + (" (baseline)" if s == BASELINE else ""))
                for s, color in colors.items()]
    handles += [Line2D([], [], color="black", alpha=a, linewidth=w, label=f"batch {b}")
                for b, a, w in zip(batches, alphas, widths)]
    if mixed:
        handles.append(Line2D([], [], color="black", linestyle="none", marker="D",
                              markersize=5, label="a mix (baseline: its fastest kind)"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
               frameon=False)
