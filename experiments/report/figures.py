"""The measured sweep's figures, one function each: speedup, batch, placement,
step-time spread, prediction; and a predicted sweep's (`predicted_figure`). The
breakdown is :mod:`experiments.report.breakdown`.

Each takes the store's view (:mod:`experiments.report.view`) and the points'
table, draws its figure to `path` and returns True, or returns False where the
sweep's axes do not give it (no batch axis, no placement axis, no prediction):
see :func:`experiments.report.cli.make_report` for the files.

Why together: each follows one setting of the grid (workers, batch, placement, a
point's steps) with the same slicing and labelling of the other dims; the
strategies figure, which compares across settings, has its own module
(:mod:`experiments.report.strategies`).
"""

from __future__ import annotations

import json
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import xarray as xr  # noqa: E402
import yaml  # noqa: E402

from experiments.report.figure_files import legend_beside, save_figure  # noqa: E402
from experiments.report.gaps import (mark_missing, place_missing, with_missing,  # noqa: E402
                                    worker_counts)
from experiments.report.view import (COLORS, PAPER_LABEL, PAPER_POINT, has_paper_network,  # noqa: E402
                                     PAPER_STRATEGY, StoreView, label_order, slice_of_others)
from experiments.sweep.store_layout import DONE  # noqa: E402
from experiments.sweep.axes import value_label  # noqa: E402
from pipeline.strategies import STRATEGIES  # noqa: E402



def _base_network(ds: xr.Dataset) -> str:
    """The network every point shares (when it is not swept): its conv widths, e.g.
    '32/64', or a zoo preset by name and width, e.g. 'resnet20 (width 0.25)'."""
    try:
        network = yaml.safe_load(ds.attrs.get("config", ""))["base"]["network"]
        if network.get("preset"):
            width = network.get("width", 1)
            return str(network["preset"]) + ("" if width == 1 else f" (width {width:g})")
        return "/".join(str(layer["kernels"]) for layer in network["conv"])
    except (TypeError, KeyError, AttributeError, ValueError, yaml.YAMLError):
        return "as configured"


def in_one_process(name: str) -> bool:
    """Whether the store's strategy `name` trains in the client's process, with no
    workers to describe (its `uses_cluster`); a name this checkout does not register
    counts as one with workers."""
    strategy = STRATEGIES.get(name)
    return strategy is not None and not strategy.uses_cluster


def _label(keys: tuple, names: list[str]) -> str:
    parts = []
    reference = any(in_one_process(str(v)) for n, v in zip(names, keys) if n == "strategy")
    for name, value in zip(names, keys):
        if name == "strategy":
            parts.insert(0, str(value))
        elif name == "equal_workers":
            if not reference:  # plain PyTorch in one process has no workers
                parts.append("equal workers" if value else "unequal workers")
        else:
            parts.append(f"{name} {value}")
    return ", ".join(parts) or "all"


def speedup_label(keys: tuple, names: list[str], capacities: Sequence[float]) -> str:
    """A line's legend entry: its group (`_label`); a group measured at one setting
    only says which (`reference`: its threads, in one process)."""
    label = _label(keys, names)
    settings = sorted(set(capacities))
    if len(settings) > 1:
        return label
    if label.startswith("reference"):
        return f"{label}, {settings[0]:g} thread(s) (one process)"
    return f"{label} (at {settings[0]:g} only)"


def speedup_range(capacities: Sequence[float]) -> tuple[float, bool]:
    """The x axis's end (the measured capacities and the ideal line's 1, with room) and
    whether the paper's point lies within it (it is not allowed to stretch the axis:
    a sweep of two workers was drawn out to 4.3 for it)."""
    top = max(max(capacities, default=1.0), 1.0) * 1.08
    return top, PAPER_POINT[0] <= top


def speedup_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Speedup against workers, per network size, with the ideal line and the paper."""
    if frame["speedup"].notna().sum() == 0 or frame[frame["strategy"] != sweep.baseline][
            "speedup"].isna().all():
        return False
    panels = sweep.network_dims
    wdim = sweep.worker_dim
    data = place_missing(with_missing(frame[frame["strategy"] != sweep.baseline], "speedup"),
                         "relative_capacity", wdim, worker_counts(sweep.ds, wdim))
    skip = set(panels) | {wdim, "strategy"}
    group = ["strategy"] + [d for d in sweep.dims if d not in skip]
    if wdim is not None:  # settings zipped with the workers (e.g. placement)
        group += [c for c in sweep.ds.coords if c not in sweep.ds.dims
                  and sweep.ds[c].dims == (wdim,) and "field" in sweep.ds[c].attrs
                  and sweep.ds[c].attrs["field"] not in ("cluster.workers",
                                                         "cluster.use_workers")]
    if not data.loc[data["speedup"].notna(), "equal_workers"].all():
        group.append("equal_workers")
    orphans = frame[(frame["strategy"] != sweep.baseline) & frame["step_time"].notna()
                    & frame["speedup"].isna()]  # measured, but their baseline is not
    panel_values = (sorted({tuple(r) for r in data[panels].astype(str).values},
                           key=lambda v: [label_order(data, p, sweep.ds).index(x)
                                          for p, x in zip(panels, v)])
                    if panels else [()])
    columns = len(panel_values)
    fig, axes = plt.subplots(1, columns, figsize=(5.2 * columns + 1.5, 4.6), squeeze=False,
                             sharey=True)
    top, paper_inside = speedup_range([float(c) for c in data["relative_capacity"]
                                       if np.isfinite(c)])
    ceiling = max(top, float(np.nanmax(data["speedup_high"])) * 1.08)
    keys_in_order = [k if isinstance(k, tuple) else (k,) for k, _ in
                     data.groupby(group, sort=False)]
    palette = {key: COLORS[i % len(COLORS)] for i, key in enumerate(keys_in_order)}
    for ax, panel in zip(axes[0], panel_values):
        subset = data
        for name, value in zip(panels, panel):
            subset = subset[subset[name] == value]
        ax.plot([0, top], [0, top], color="0.6", linestyle="--", linewidth=1, label="ideal")
        if has_paper_network(sweep.ds):  # beside another network, no figure to compare
            ax.plot(*(PAPER_POINT if paper_inside else ([], [])), marker="*", markersize=14,
                    color="black", linestyle="none",
                    label=PAPER_LABEL if paper_inside else f"{PAPER_LABEL} (beyond this axis)")
        _no_baseline(ax, orphans, panels, panel, group, sweep.baseline)
        for key, lines in subset.groupby(group, sort=False):
            keys = key if isinstance(key, tuple) else (key,)
            lines = lines.sort_values("relative_capacity")
            color = palette[keys]
            mark_missing(ax, lines, "relative_capacity", color)
            measured = lines[lines["speedup"].notna()]
            if measured.empty:  # failed or not run wherever it was set
                continue
            label = speedup_label(keys, group, list(measured["relative_capacity"]))
            one_process = any(in_one_process(str(v)) for n, v in zip(group, keys)
                              if n == "strategy")
            if one_process and lines["relative_capacity"].nunique() <= 1:  # a baseline in
                ax.axhline(float(measured["speedup"].median()), linestyle=":",  # one
                           linewidth=1.5, color=color, label=label)  # process, across
                continue  # (a point of workers, e.g. an unequal pair, stays a point)
            error = [lines["speedup"] - lines["speedup_low"],
                     lines["speedup_high"] - lines["speedup"]]
            ax.errorbar(lines["relative_capacity"], lines["speedup"], yerr=error, color=color,
                        marker="o", capsize=3, label=label)
        title = ", ".join(f"{n} {v}" for n, v in zip(panels, panel)) or _base_network(sweep.ds)
        ax.set_title(f"network {title}")
        ax.set_xlim(0, top)
        ax.set_ylim(0, ceiling)
        ax.set_xlabel("workers (summed relative speed if unequal)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"speedup over '{sweep.baseline}'")
    legend_beside(fig, axes[0])
    fig.suptitle(f"{sweep.ds.attrs.get('sweep_name', '')}: speedup (median over repeats, "
                 "bars: range)")
    save_figure(fig, path)
    return True


def _no_baseline(ax, orphans: pd.DataFrame, panels: list[str], panel: tuple, group: list[str],
                 baseline: str) -> None:
    """A legend entry for each line of the panel whose points were measured but have no
    speedup, their baseline not done: a line left out says why, rather than looking
    as if it had never been swept."""
    for name, value in zip(panels, panel):
        orphans = orphans[orphans[name] == value]
    for key, _rows in orphans.groupby(group, sort=False):
        keys = key if isinstance(key, tuple) else (key,)
        ax.plot([], [], linestyle="none", label=f"{_label(keys, group)}: measured, no speedup "
                f"(its '{baseline}' baseline did not finish)")


def batch_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Step time and throughput against batch size, per strategy and workers."""
    bdim = sweep.batch_dim
    if bdim is None:
        return False
    keep = [d for d in ("strategy", sweep.worker_dim, bdim) if d]
    data, fixed = slice_of_others(sweep, frame, keep)
    data = with_missing(data, "step_time").copy()
    if data["step_time"].isna().all():
        return False
    data["batch_value"] = sweep.batch_sizes(data)
    group = [d for d in keep if d != bdim]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    for index, (keys, lines) in enumerate(data.groupby(group, sort=False) if group
                                          else [((), data)]):
        keys = keys if isinstance(keys, tuple) else (keys,)
        lines = lines.sort_values("batch_value")
        label = _label(keys, group) if lines["step_time"].notna().any() else None
        color = COLORS[index % len(COLORS)]
        for ax, name in ((left, "step_time"), (right, "throughput")):
            ax.plot(lines["batch_value"], lines[name], marker="o", label=label, color=color)
            mark_missing(ax, lines, "batch_value", color)
    left.set_ylabel("step time (s, median)")
    right.set_ylabel("throughput (samples/s)")
    for ax in (left, right):
        ax.set_xlabel(sweep.batch_label())
        ax.grid(alpha=0.3)
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("batch size" + (f" ({fixed})" if fixed else ""))
    save_figure(fig, path)
    return True


def placement_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Calibrated against even placement on unequal workers: the paper's claim."""
    if "placement" not in frame:
        return False
    data = frame[(~frame["equal_workers"]) & frame["step_time"].notna()
                 & (frame["strategy"] == PAPER_STRATEGY)]
    if data.empty or data["placement"].nunique() < 2:
        return False
    pdim = "placement" if "placement" in sweep.dims else None
    keep = [d for d in ("strategy", sweep.worker_dim, pdim) if d]
    data, fixed = slice_of_others(sweep, data, keep)
    data = data.assign(worker_set=_worker_sets(sweep, data))
    sets = list(dict.fromkeys(data["worker_set"]))
    placements = sorted(data["placement"].astype(str).unique())
    fig, ax = plt.subplots(figsize=(max(5.5, 1.8 * len(sets) + 2), 4.4))
    width = 0.8 / len(placements)
    for index, placement in enumerate(placements):
        rows = data[data["placement"].astype(str) == placement]
        heights = [rows[rows["worker_set"] == s]["step_time"].median() for s in sets]
        bars = ax.bar(np.arange(len(sets)) + index * width, heights, width=width,
                      label=placement, color=COLORS[index % len(COLORS)])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(np.arange(len(sets)) + width * (len(placements) - 1) / 2, sets)
    ax.set_xlabel("worker speeds (relative)")
    ax.set_ylabel("step time (s, median)")
    ax.set_title("placement on unequal workers" + (f" ({fixed})" if fixed else ""))
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)
    return True


def _worker_sets(sweep: StoreView, data: pd.DataFrame) -> list[str]:
    """Each row's worker set as speeds ('1+0.5'), apart from what is zipped with it."""
    wdim = sweep.worker_dim
    if wdim is not None and sweep.axes.get(wdim) == ["cluster.workers"]:
        return [str(v) for v in data[wdim]]
    for name, coord in sweep.ds.coords.items():
        if wdim and coord.dims == (wdim,) and coord.attrs.get("field") == "cluster.workers":
            texts = [str(v) for v in data[name]] if name in data else []
            try:
                return [value_label("cluster.workers", json.loads(t)) for t in texts]
            except ValueError:
                return texts
    return [str(v) for v in data["worker_labels"]] if "worker_labels" in data else \
        ["workers"] * len(data)


def step_times_figure(sweep: StoreView, path: str, limit: int = 40) -> bool:
    """Box plot of every done point's measured steps: noise and stragglers at a glance."""
    ds = sweep.ds
    measured = ~ds.warmup.values
    series = ds.step_time_series.values
    status = ds.status.values
    boxes, labels = [], []
    for position in np.ndindex(*status.shape):
        if status[position] != DONE:
            continue
        values = series[position][measured]
        values = values[np.isfinite(values)]
        if values.size:
            boxes.append(values)
            names = [str(ds[d].values[i]) for d, i in zip(sweep.dims, position[:-1])]
            labels.append(" / ".join(names + [f"r{position[-1]}"]))
    if not boxes:
        return False
    shown = "" if len(boxes) <= limit else f", first {limit} of {len(boxes)}"
    boxes, labels = boxes[:limit], labels[:limit]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(boxes) + 2), 4.6))
    ax.boxplot(boxes, tick_labels=labels)
    ax.set_ylabel("step time (s)")
    ax.set_title(f"measured steps of each point ({' / '.join(sweep.dims + ['repeat'])}"
                 f"{shown})")
    plt.setp(ax.get_xticklabels(), rotation=60, ha="right", fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)
    return True


def prediction_figure(frame: pd.DataFrame, path: str) -> bool:
    """Predicted against measured step time, per strategy (once there is a model)."""
    data = frame[frame["predicted_step_time"].notna() & frame["step_time"].notna()]
    if data.empty:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for strategy, rows in data.groupby("strategy"):
        ax.scatter(rows["step_time"], rows["predicted_step_time"], label=strategy)
    top = float(np.nanmax(data[["step_time", "predicted_step_time"]].to_numpy())) * 1.1
    ax.plot([0, top], [0, top], color="0.6", linestyle="--", label="exact")
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title("performance model against measurement (per point)")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)
    return True


def predicted_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """The model's step time of a sweep that measured nothing (`mode: predict`), with
    its band as bars: against the workers (else the strategies), one line per strategy
    and other setting. Not drawn where steps were measured: `prediction_figure` and
    the strategies figure show the model beside them there."""
    if frame["step_time"].notna().any():
        return False
    data = frame[frame["predicted_step_time"].notna()]
    if data.empty:
        return False
    wdim = sweep.worker_dim
    x_dim = wdim if wdim in sweep.dims else ("strategy" if "strategy" in sweep.dims else None)
    labels = label_order(frame, x_dim, sweep.ds) if x_dim else ["the point"]
    group = [d for d in sweep.dims if d != x_dim]
    fig, ax = plt.subplots(figsize=(max(5.5, 0.9 * len(labels) + 3), 4.6))
    lines_of = data.groupby(group, sort=False) if group else [((), data)]
    for index, (keys, lines) in enumerate(lines_of):
        keys = keys if isinstance(keys, tuple) else (keys,)
        x = [labels.index(str(v)) for v in lines[x_dim]] if x_dim else [0] * len(lines)
        order = np.argsort(x, kind="stable")
        step = lines["predicted_step_time"].to_numpy(dtype=float)[order]
        bounds = [lines.get(name, pd.Series(np.nan, index=lines.index)).to_numpy(dtype=float)
                  [order] for name in ("predicted_low", "predicted_high")]
        error = [np.clip(np.nan_to_num(step - bounds[0]), 0, None),
                 np.clip(np.nan_to_num(bounds[1] - step), 0, None)]
        ax.errorbar(np.asarray(x)[order], step, yerr=error, marker="o", capsize=3,
                    color=COLORS[index % len(COLORS)], label=_label(keys, group))
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel(x_dim or "")
    ax.set_ylabel("predicted step time (s)")
    top, bottom = float(data["predicted_step_time"].max()), float(
        data["predicted_step_time"].min())
    if bottom > 0 and top / bottom > 20:  # networks of very different sizes
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.set_title("the model's step time (predicted, nothing measured; bars: its band)")
    legend_beside(fig, [ax])
    save_figure(fig, path)
    return True
