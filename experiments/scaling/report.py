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
import math
import os
import re
from collections import Counter

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import xarray as xr  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from experiments.report.figure_files import write_figures  # noqa: E402
from experiments.sweep.store_layout import DONE, FAILED  # noqa: E402
from experiments.scaling.anchors import ANCHOR_PRESETS, anchor_lines  # noqa: E402
from experiments.scaling.hardware import PRESETS  # noqa: E402
from pipeline.records.record import code_revision  # noqa: E402
from experiments.scaling.regions import (crossover_table, hybrid_region_table,  # noqa: E402
                                         point_table)
from experiments.scaling.figure_style import (UNFIT_NOTE, baseline_fits, colors,  # noqa: E402
                                              panel, save_titled, speedup_text)
from experiments.scaling.speedup_figure import speedup_figure  # noqa: E402
from experiments.scaling.view import ScalingView, winners  # noqa: E402

__all__ = ["make_scaling_report", "fixed_settings", "anchor_note"]

#: A preset's fields that set a predicted step time.
RATE_FIELDS = ("flops", "mem_bw", "conv_efficiency", "dense_efficiency", "mem_efficiency")

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
    fits = baseline_fits(view).isel(repeat=0).sel(fixed)
    strategies = view.labels(sdim)
    rows = view.labels(row_dim) if row_dim else [None]
    columns = view.labels(column_dim) if column_dim else [None]
    xs, ys = view.labels(xdim), view.labels(y_dim)
    cmap = ListedColormap(colors(strategies)).with_extremes(bad="white")
    width = max(3.2, 0.42 * len(xs) + 1.0)
    height = max(2.2, 0.42 * len(ys) + 1.1)
    fig, axes = plt.subplots(len(rows), len(columns), squeeze=False, sharex=True, sharey=True,
                             figsize=(width * len(columns) + 0.8, height * len(rows) + 1.2))
    none_feasible = unfit = False
    for r, row in enumerate(rows):
        for c, column in enumerate(columns):
            ax = axes[r][c]
            pick = panel(view, row_dim, r, column_dim, c)
            t = times.sel(pick).transpose(sdim, y_dim, xdim).values
            s = speedup.sel(pick).transpose(sdim, y_dim, xdim).values
            f = fits.sel(pick).transpose(sdim, y_dim, xdim).values
            best = winners(t)
            none_feasible = none_feasible or bool((best < 0).any())
            unfit = unfit or any(f[w, yi, xi] == 0 for (yi, xi), w in np.ndenumerate(best)
                                 if w >= 0)
            shown_map = np.ma.masked_less(best.astype(float), 0)
            ax.imshow(shown_map, cmap=cmap, vmin=-0.5, vmax=len(strategies) - 0.5,
                      origin="lower", aspect="auto", interpolation="nearest")
            for (yi, xi), w in np.ndenumerate(best):
                text = speedup_text(s[w, yi, xi], f[w, yi, xi]) if w >= 0 else "-"
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
               for name, color in zip(strategies, colors(strategies))]
    if none_feasible:
        handles.append(Patch(facecolor="white", edgecolor="0.5", label="none can run (-)"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
               bbox_to_anchor=(0.5, 0.0), frameon=False)
    title = (f"{view.ds.attrs.get('sweep_name', '')}: fastest strategy (predicted) over "
             f"{what}; cell: its speedup over one device")
    save_titled(fig, path, title, fixed_text, unfit)
    return True


# Speedup curves -----------------------------------------------------------------------


# The markdown report ------------------------------------------------------------------


def _preset_lines(ds: xr.Dataset) -> list[str]:
    presets = json.loads(ds.attrs.get("presets", "{}"))
    lines = []
    for name, entries in presets.items():
        for entry in entries:
            holds = entry.get("memory")
            holds = ("" if holds is None else "; holds unlimited" if holds == math.inf
                     else f"; holds {holds / 1e9:.4g} GB")
            lines.append(f"- `{name}`: {entry['flops'] / 1e12:.3g} TFLOP/s, conv "
                         f"{entry['conv_efficiency']:.2f} / dense {entry['dense_efficiency']:.2f}"
                         f" of it; memory {entry['mem_bw'] / 1e9:.4g} GB/s x "
                         f"{entry['mem_efficiency']:.2f}{holds}. {entry['source']}.")
    return lines


#: Fields of the base point the report leaves out where they hold nothing.
_UNSET = (None, [], {})


def fixed_settings(view: ScalingView) -> str:
    """What every point shares (the base point less the swept fields and the device
    kinds, which have their own lines), as `field=value` items."""
    swept = view.swept_fields()
    items = []

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and value and prefix != "hardware.devices":
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
            return
        if prefix == "hardware.kinds" or prefix.startswith("hardware.kinds."):
            return
        if any(prefix == f or prefix.startswith(f + ".") or f.startswith(prefix + ".")
               for f in swept):
            return
        if value in _UNSET and prefix != "hardware.store":
            return
        items.append(f"`{prefix}={json.dumps(value)}`")

    walk("", view.base_point())
    return ", ".join(items)


def network_figures(view: ScalingView) -> dict[str, str]:
    """Per network of a swept network dim, the file of its own winner map."""
    if view.network_dim is None:
        return {}
    return {network: f"winner_{re.sub(r'[^A-Za-z0-9_.+-]', '_', network)}.png"
            for network in view.labels(view.network_dim)}  # a zip's "vgg16/0.25": no folder


def winner_table(view: ScalingView) -> str | None:
    """Markdown: per setting of the other dims, the winner and its speedup per device count."""
    sdim, xdim = view.strategy_dim, view.workers_dim
    if sdim is None or xdim is None:
        return None
    times = view.times()
    speedup = view.ds.speedup.where(view.ds.status == DONE).isel(repeat=0)
    fits = baseline_fits(view).isel(repeat=0)
    # settings such as the network first, then bandwidth and batch (fastest-varying)
    others = [d for d in view.dims if d not in (sdim, xdim, view.bandwidth_dim, view.batch_dim)]
    others += [d for d in (view.bandwidth_dim, view.batch_dim) if d]
    strategies, xs = view.labels(sdim), view.labels(xdim)
    unfit = False
    lines = ["| " + " | ".join([view.header(d) for d in others] + [f"{x} dev." for x in xs])
             + " |",
             "|" + "|".join(["---"] * len(others) + ["--:"] * len(xs)) + "|"]
    for position in np.ndindex(*(view.ds.sizes[d] for d in others)):
        pick = {d: i for d, i in zip(others, position)}
        t = times.isel(pick).transpose(sdim, xdim).values
        s = speedup.isel(pick).transpose(sdim, xdim).values
        f = fits.isel(pick).transpose(sdim, xdim).values
        best = winners(t)
        cells = [f"{strategies[w]} {speedup_text(s[w, i], f[w, i], 'x')}" if w >= 0 else "-"
                 for i, w in enumerate(best)]
        unfit = unfit or any(f[w, i] == 0 for i, w in enumerate(best) if w >= 0)
        labels = [view.labels(d)[i] for d, i in zip(others, position)]
        lines.append("| " + " | ".join(labels + cells) + " |")
    return "\n".join(lines + (["", UNFIT_NOTE] if unfit else []))


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
        "- speedup: predicted step time of `single` on one device of the mix's fastest kind "
        "(same network and batch) over the point's; efficiency divides it by the devices' "
        "summed relative speed (their count, for equal devices).",
    ]
    fixed = fixed_settings(view)
    if fixed:
        lines.append(f"- every point (besides the swept fields): {fixed}"
                     + ("; `hardware.store=null`: direct links" if "`hardware.store=null`"
                        in fixed else ""))
    lines += [
        "", "Device kinds:", "",
    ]
    lines += _preset_lines(ds)
    lines += ["", "## Figures", ""] if figures else [""]
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
    points = point_table(view)
    if points:
        lines += ["## Every point", "", *points, ""]
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
                  "bandwidth; none: nowhere in the grid; -: `hybrid` never feasible (memory, "
                  "or a sample per device).", "", *region, ""]
    stored = view.ds.attrs.get("anchors")
    records = json.loads(stored) if stored else None
    return lines + ["## Anchors", "", anchor_note(view.ds), "", *anchor_lines(records), ""]


def anchor_note(ds: xr.Dataset) -> str:
    """What the anchors stand on: the stock presets, which the sweep's may not be."""
    note = ("Published figures against the model's, on the stock `a100` and `k20` presets "
            "(experiments/scaling/hardware.py; docs/model.md)")
    note += (", predicted by the sweep's code." if ds.attrs.get("anchors") else
             f", predicted now by code revision {code_revision()} (the store does not keep "
             "the sweep's).")
    used = json.loads(ds.attrs.get("presets", "{}"))
    differ = [name for name in ANCHOR_PRESETS for entry in used.get(name, [])
              if any(entry.get(f) != getattr(PRESETS[name], f) for f in RATE_FIELDS)]
    if differ:
        names = ", ".join(f"`{name}`" for name in dict.fromkeys(differ))
        note += (f" This sweep's {names} is not the stock preset (its rates are set by the "
                 "sweep): the anchors do not check it.")
    return note


def _reason_kind(reason: str) -> str:
    """A failure reason with its numbers blanked, to group alike points."""
    return re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b", "N", reason)


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
