"""Figures and a table from a scaling sweep's store (``mode: scaling``).

:func:`experiments.report.cli.make_report` hands scaling stores here. Written into the
report directory:

- ``winner_workers_batch.png``: which strategy is fastest over devices x batch, one
  panel per link bandwidth (and one row per network, or whatever else is swept);
  each cell shows the winner's speedup over one device;
- ``winner_workers_bandwidth.png``: the same over devices x link bandwidth, one
  panel per batch;
- ``scaling_speedup.png``: speedup against devices per strategy (log-log, the
  ideal line), one panel per link bandwidth and row per network, one line per
  batch (darker: larger);
- ``report.md``: provenance, the device presets, the figures, a table of winners
  and the infeasible points.

Ties (equal predicted times up to float error, as for every strategy on one
device) go to the strategy listed first in the sweep. Dims a figure does not show
are fixed at their last value, and the figure says so. Both rules live in
:mod:`experiments.scaling.view`, which figures and table share.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import xarray as xr  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from experiments.report.figure_files import save_figure, write_figures  # noqa: E402
from experiments.sweep.store_layout import DONE, FAILED  # noqa: E402
from experiments.scaling.run import BASELINE  # noqa: E402
from experiments.scaling.anchors import anchor_lines  # noqa: E402
from experiments.scaling.regions import crossover_table, hybrid_region_table  # noqa: E402
from experiments.scaling.view import ScalingView, one_device_only, winners  # noqa: E402
from experiments.sweep.summary import base_strategy  # noqa: E402

__all__ = ["make_scaling_report"]

#: Light enough for black cell text.
STRATEGY_COLORS = {"single": "#c9c9c9", "kernel": "#7fb1e3", "data": "#f5ad79",
                   "hybrid": "#9fd08a"}
LINE_COLORS = {"single": "#555555", "kernel": "#1f6fc0", "data": "#e06a12",
               "hybrid": "#3c9a2a"}
EXTRA_COLORS = ["#d9a0d9", "#e6d37a", "#8fd3d3", "#e39a9a"]


def _speedup_text(value: float) -> str:
    if not np.isfinite(value):
        return ""
    return f"{value:.0f}" if value >= 9.95 else f"{value:.1f}"


def _colors(strategies: list[str]) -> list[str]:
    extra = iter(EXTRA_COLORS * 4)
    return [STRATEGY_COLORS.get(s) or next(extra) for s in strategies]


# Winner maps --------------------------------------------------------------------------


def winner_figure(view: ScalingView, y_dim: str | None, column_dim: str | None,
                  path: str, what: str) -> bool:
    """Which strategy is fastest over devices (x) and ``y_dim``, panels over ``column_dim``."""
    sdim, xdim = view.strategy_dim, view.workers_dim
    if sdim is None or xdim is None or y_dim is None or view.ds.sizes[sdim] < 2:
        return False
    shown = [sdim, xdim, y_dim] + ([column_dim] if column_dim else [])
    row_dim, fixed, fixed_text = view.layout(shown)
    times = view.times().sel(fixed)
    speedup = view.ds.speedup.where(view.ds.status == DONE).isel(repeat=0).sel(fixed)
    strategies = view.labels(sdim)
    rows = view.labels(row_dim) if row_dim else [None]
    columns = view.labels(column_dim) if column_dim else [None]
    xs, ys = view.labels(xdim), view.labels(y_dim)
    cmap = ListedColormap(_colors(strategies)).with_extremes(bad="white")
    width = max(3.2, 0.42 * len(xs) + 1.0)
    height = max(2.2, 0.42 * len(ys) + 1.1)
    fig, axes = plt.subplots(len(rows), len(columns), squeeze=False, sharex=True, sharey=True,
                             figsize=(width * len(columns) + 0.8, height * len(rows) + 1.2))
    none_feasible = False
    for r, row in enumerate(rows):
        for c, column in enumerate(columns):
            ax = axes[r][c]
            pick = _panel(view, row_dim, r, column_dim, c)
            t = times.sel(pick).transpose(sdim, y_dim, xdim).values
            s = speedup.sel(pick).transpose(sdim, y_dim, xdim).values
            best = winners(t)
            none_feasible = none_feasible or bool((best < 0).any())
            shown_map = np.ma.masked_less(best.astype(float), 0)
            ax.imshow(shown_map, cmap=cmap, vmin=-0.5, vmax=len(strategies) - 0.5,
                      origin="lower", aspect="auto", interpolation="nearest")
            for (yi, xi), w in np.ndenumerate(best):
                text = _speedup_text(s[w, yi, xi]) if w >= 0 else "-"
                ax.text(xi, yi, text, ha="center", va="center", fontsize=6.5)
            long_labels = max(len(x) for x in xs) > 4 and len(xs) > 3
            ax.set_xticks(range(len(xs)), xs, rotation=90 if long_labels else 0, fontsize=7)
            ax.set_yticks(range(len(ys)), ys, fontsize=7)
            ax.set_xticks(np.arange(len(xs)) - 0.5, minor=True)
            ax.set_yticks(np.arange(len(ys)) - 0.5, minor=True)
            ax.grid(which="minor", color="white", linewidth=0.8)
            ax.tick_params(which="minor", length=0)
            parts = [view.title(d, v) for d, v in ((row_dim, row), (column_dim, column)) if d]
            ax.set_title(", ".join(parts), fontsize=9)
            if r == len(rows) - 1:
                ax.set_xlabel(view.axis_name(xdim), fontsize=8)
            if c == 0:
                ax.set_ylabel(view.axis_name(y_dim), fontsize=8)
    handles = [Patch(facecolor=color, edgecolor="0.5", label=name)
               for name, color in zip(strategies, _colors(strategies))]
    if none_feasible:
        handles.append(Patch(facecolor="white", edgecolor="0.5", label="none can run (-)"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
               bbox_to_anchor=(0.5, 0.0), frameon=False)
    title = (f"{view.ds.attrs.get('sweep_name', '')}: fastest strategy (predicted) over "
             f"{what}; cell: its speedup over one device")
    if fixed_text:
        title += f"\n({fixed_text})"
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
    return True


# Speedup curves -----------------------------------------------------------------------


def speedup_figure(view: ScalingView, path: str) -> bool:
    """Speedup against devices per strategy (log-log) with the ideal line."""
    xdim = view.workers_dim
    if xdim is None:
        return False
    sdim, bdim, ldim = view.strategy_dim, view.batch_dim, view.bandwidth_dim
    column_dim = ldim
    shown = [d for d in (sdim, xdim, bdim, column_dim) if d]
    row_dim, fixed, fixed_text = view.layout(shown)
    figures = view.ds[["speedup", "capacity", "n_workers"]]
    ds = figures.where(view.ds.status == DONE).isel(repeat=0).sel(fixed)
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
    widths = np.linspace(1.0, 2.2, len(batches))
    alphas = np.linspace(0.35, 1.0, len(batches))
    extra = iter(EXTRA_COLORS * 4)
    colors = {s: LINE_COLORS.get(s) or next(extra) for s in strategies}
    for r, row in enumerate(rows):
        for c, column in enumerate(columns):
            ax = axes[r][c]
            pick = _panel(view, row_dim, r, column_dim, c)
            panel = ds.sel(pick)
            ax.plot([1, max(top, 2)], [1, max(top, 2)], color="0.6", linestyle="--",
                    linewidth=1)
            for si, strategy in enumerate(strategies):
                lines = panel.isel({sdim: si}) if sdim else panel
                _strategy_lines(ax, lines, xdim, bdim, counts, colors[strategy], alphas,
                                widths)
            parts = [view.title(d, v) for d, v in ((row_dim, row), (column_dim, column)) if d]
            _speedup_axes(ax, ", ".join(parts) or "all", r == len(rows) - 1, c == 0, mixed)
    axes[0][0].set_ylim(max(low / 1.5, 1e-3), max(high, top) * 1.5)
    _speedup_legend(fig, colors, batches if bdim else [], alphas, widths, mixed)
    title = (f"{view.ds.attrs.get('sweep_name', '')}: predicted speedup against devices "
             "(missing points: infeasible)")
    if fixed_text:
        title += f"\n({fixed_text})"
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
    return True


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
                              markersize=5, label="a mix (baseline: its first kind)"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
               frameon=False)


def _panel(view: Any, row_dim: str | None, row: int, column_dim: str | None,
           column: int) -> dict[str, Any]:
    """The coordinates that pick one panel of a rows x columns grid of plots."""
    pick = {}
    if row_dim:
        pick[row_dim] = view.ds[row_dim].values[row]
    if column_dim:
        pick[column_dim] = view.ds[column_dim].values[column]
    return pick


# The markdown report ------------------------------------------------------------------


def _preset_lines(ds: xr.Dataset) -> list[str]:
    presets = json.loads(ds.attrs.get("presets", "{}"))
    lines = []
    for name, entries in presets.items():
        for entry in entries:
            lines.append(f"- `{name}`: {entry['flops'] / 1e12:.3g} TFLOP/s, conv "
                         f"{entry['conv_efficiency']:.2f} / dense {entry['dense_efficiency']:.2f}"
                         f" of it; memory {entry['mem_bw'] / 1e9:.4g} GB/s x "
                         f"{entry['mem_efficiency']:.2f}. {entry['source']}.")
    return lines


def network_figures(view: ScalingView) -> dict[str, str]:
    """Per network of a swept network dim, the file of its own winner map."""
    if view.network_dim is None:
        return {}
    return {network: f"winner_{network}.png" for network in view.labels(view.network_dim)}


def winner_table(view: ScalingView) -> str | None:
    """Markdown: per setting of the other dims, the winner and its speedup per device count."""
    sdim, xdim = view.strategy_dim, view.workers_dim
    if sdim is None or xdim is None:
        return None
    times = view.times()
    speedup = view.ds.speedup.where(view.ds.status == DONE).isel(repeat=0)
    # settings such as the network first, then bandwidth and batch (fastest-varying)
    others = [d for d in view.dims if d not in (sdim, xdim, view.bandwidth_dim, view.batch_dim)]
    others += [d for d in (view.bandwidth_dim, view.batch_dim) if d]
    strategies, xs = view.labels(sdim), view.labels(xdim)
    lines = ["| " + " | ".join(others + [f"{x} dev." for x in xs]) + " |",
             "|" + "|".join(["---"] * len(others) + ["--:"] * len(xs)) + "|"]
    for position in np.ndindex(*(view.ds.sizes[d] for d in others)):
        pick = {d: i for d, i in zip(others, position)}
        t = times.isel(pick).transpose(sdim, xdim).values
        s = speedup.isel(pick).transpose(sdim, xdim).values
        best = winners(t)
        cells = [f"{strategies[w]} {_speedup_text(s[w, i])}x" if w >= 0 else "-"
                 for i, w in enumerate(best)]
        labels = [view.labels(d)[i] for d, i in zip(others, position)]
        lines.append("| " + " | ".join(labels + cells) + " |")
    return "\n".join(lines)


def write_markdown(view: ScalingView, figures: list[str], path: str) -> None:
    ds = view.ds
    status = ds.status.values
    failures = [str(f) for f, s in zip(ds.failure.values.ravel(), status.ravel())
                if s == FAILED]
    infeasible = sum(1 for f in failures if f.startswith("Infeasible"))
    lines = [f"# Scaling sweep `{ds.attrs.get('sweep_name', '?')}` (predicted)", ""]
    if ds.attrs.get("description"):
        lines += [str(ds.attrs["description"]), ""]
    lines += [
        f"- points: {int((status == DONE).sum())} predicted, {infeasible} infeasible, "
        f"{len(failures) - infeasible} failed, of {status.size}",
        f"- model: {ds.attrs.get('model', 'pipeline.costmodel')}; nothing was measured",
        f"- code revision {ds.attrs.get('code_revision', '?')}; written "
        f"{ds.attrs.get('finished', '?')}",
        f"- command: `{ds.attrs.get('command', '')}`",
        "- speedup: predicted step time of `single` on one device of the mix's first kind "
        "(same network and batch) over the point's; efficiency divides it by the devices' "
        "summed relative speed (their count, for equal devices).",
        "", "Device kinds:", "",
    ]
    lines += _preset_lines(ds)
    lines += ["", "## Figures", ""]
    captions = {name: f"Fastest strategy over devices and link bandwidth: {network}"
                for network, name in network_figures(view).items()}
    captions |= {"winner_workers_batch.png": "Fastest strategy over devices and batch",
                "winner_workers_bandwidth.png": "Fastest strategy over devices and bandwidth",
                "scaling_speedup.png": "Speedup against devices"}
    for name in figures:
        lines += [f"![{captions.get(name, name)}]({name})", ""]
    table = winner_table(view)
    if table:
        lines += ["## Fastest strategy and its speedup", "", table, ""]
    lines += _region_sections(view)
    if failures:
        lines += ["## Points without a prediction", ""]
        for reason, count in Counter(_reason_kind(f) for f in failures).most_common():
            lines.append(f"- {count} x {reason}")
        lines.append("")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))


def _region_sections(view: ScalingView) -> list[str]:
    """Where kernel overtakes data, the hybrid's region, and the anchors."""
    lines = []
    crossover = crossover_table(view)
    if crossover:
        lines += ["## Where kernel parallelism overtakes data parallelism", "",
                  "The fewest devices (two or more) at which `kernel`'s predicted step is "
                  "shorter than `data`'s (both predicted), per link bandwidth; none: never in the grid; -: "
                  "never both feasible (memory, or a sample per device).",
                  "", *crossover, ""]
    region = hybrid_region_table(view)
    if region:
        lines += ["## Where the hybrid wins", "",
                  "The device counts at which `hybrid` is the fastest strategy, per link "
                  "bandwidth.", "", *region, ""]
    return lines + ["## Anchors", "", "Published figures against the model's (presets as "
                    "above; docs/model.md).", "", *anchor_lines(), ""]


def _reason_kind(reason: str) -> str:
    """A failure reason with its numbers blanked, to group alike points."""
    return re.sub(r"\b\d+\b", "N", reason)


def make_scaling_report(ds: xr.Dataset, out_dir: str) -> list[str]:
    """Write the three figures (those the axes allow) and report.md; returns the paths."""
    view = ScalingView(ds)
    makers = [
        ("winner_workers_batch.png",
         lambda p: winner_figure(view, view.batch_dim, view.bandwidth_dim, p,
                                 "devices x batch")),
        ("winner_workers_bandwidth.png",
         lambda p: winner_figure(view, view.bandwidth_dim, view.batch_dim, p,
                                 "devices x link bandwidth")),
        ("scaling_speedup.png", lambda p: speedup_figure(view, p)),
    ]
    for network, name in network_figures(view).items():
        makers.append((name, lambda p, n=network: winner_figure(
            view.of_network(n), view.bandwidth_dim, view.batch_dim, p,
            f"devices x link bandwidth ({n})")))
    written = write_figures(makers, out_dir)
    report = os.path.join(out_dir, "report.md")
    write_markdown(view, written, report)
    return [os.path.join(out_dir, name) for name in written] + [report]
