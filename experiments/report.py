"""Figures and a table from a sweep's store: ``python -m experiments.report RESULTS``.

Writes, into ``<store>.report/`` next to the store (or ``--out DIR``):

- ``speedup.png``: speedup against workers (summed relative speed for unequal
  devices), one panel per network size, one line per strategy/batch/other
  setting, with the ideal line and Marques et al.'s 3.28x on 4 CPUs;
- ``breakdown.png``: where a step's time goes (compute, storage, master, wait) per
  strategy and worker set, with the measured step time marked;
- ``batch.png``: step time and throughput against batch size (if batch is swept);
- ``placement.png``: calibrated against even placement on unequal workers (if
  placement is swept);
- ``step_times.png``: the spread of every point's measured steps;
- ``prediction.png``: predicted against measured step time (once predicted);
- ``report.md``: provenance, the figures, the main table and any failures.

A scaling store (``mode: scaling``, predictions over hypothetical clusters) gets
its own figures instead: which strategy wins over devices x batch and devices x
bandwidth, and the speedup curves (:mod:`experiments.scaling_report`).

Figures use medians over the done repeats, with the repeats' range as error bars.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import xarray as xr  # noqa: E402
import yaml  # noqa: E402

from experiments.figures import save_figure, write_figures  # noqa: E402
from experiments.results import DONE, FAILED, SKIPPED, STORE_FORMAT  # noqa: E402
from experiments.scaling_report import make_scaling_report  # noqa: E402
from experiments.summary import base_strategy, format_table, summary_table  # noqa: E402
from experiments.sweep_axes import value_label  # noqa: E402

PAPER_POINT = (4, 3.28)  # Marques et al. 2018: 3.28x speedup with four CPUs
PAPER_LABEL = "Marques et al. 2018: 3.28x on 4 CPUs"
BREAKDOWN = [("compute_time", "compute", "#4c72b0"), ("storage_time", "storage", "#dd8452"),
             ("master_time", "master", "#55a868"), ("wait_time", "wait", "#c44e52")]
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
POINT_FIGURES = ["step_time", "throughput", "speedup", "efficiency", "compute_time",
                 "storage_time", "master_time", "wait_time", "bytes_moved", "loss", "accuracy",
                 "n_workers", "capacity", "predicted_step_time"]


class ReportError(ValueError):
    """The path is not a sweep store that can be reported on."""


def default_out_dir(store: str) -> str:
    stem = store.rstrip("/")
    return (stem[: -len(".zarr")] if stem.endswith(".zarr") else stem) + ".report"


# Reading ----------------------------------------------------------------------------


class StoreView:
    """The store plus what the figures need to know about its dims."""

    def __init__(self, ds: xr.Dataset) -> None:
        self.ds = ds
        self.axes: dict[str, list[str]] = json.loads(ds.attrs.get("axes", "{}"))
        self.baseline = ds.attrs.get("speedup_baseline", "single")
        self.dims = [d for d in ds.status.dims if d != "repeat"]

    def dim_with(self, *fields: str, prefix: bool = False) -> str | None:
        for dim, names in self.axes.items():
            if any((n.startswith(f) if prefix else n == f) for n in names for f in fields):
                return dim
        return None

    @property
    def worker_dim(self) -> str | None:
        return self.dim_with("cluster.workers", "cluster.use_workers")

    @property
    def network_dims(self) -> list[str]:
        return [d for d, names in self.axes.items()
                if names and all(n.startswith("network.conv") for n in names)]

    @property
    def batch_dim(self) -> str | None:
        return self.dim_with("train.batch")

    def points(self) -> pd.DataFrame:
        """One row per grid point: medians (and min/max) over done repeats, all labels."""
        ds = self.ds
        done = ds.status == DONE
        figures = ds[POINT_FIGURES].where(done)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            median = figures.median("repeat")
            low = figures.min("repeat")
            high = figures.max("repeat")
        table = median.copy()
        for name in ("step_time", "speedup", "efficiency"):
            table[f"{name}_low"] = low[name]
            table[f"{name}_high"] = high[name]
        table["done"] = done.sum("repeat")
        table = table.drop_vars([c for c in ("step", "warmup") if c in table.coords])
        if not self.dims:
            table = table.expand_dims("point")
        frame = table.to_dataframe().reset_index()
        for dim in self.dims:  # labels as text, in the store's order
            frame[dim] = frame[dim].astype(str)
        if "strategy" not in frame:
            config_strategy = base_strategy(ds)
            frame["strategy"] = config_strategy
        frame["relative_capacity"] = frame["speedup"] / frame["efficiency"]
        frame["equal_workers"] = np.isclose(frame["capacity"], frame["n_workers"])
        return frame


def _base_network(ds: xr.Dataset) -> str:
    """The conv widths every point shares, e.g. '32/64' (when the network is not swept)."""
    try:
        conv = yaml.safe_load(ds.attrs.get("config", ""))["base"]["network"]["conv"]
        return "/".join(str(layer["kernels"]) for layer in conv)
    except (TypeError, KeyError, AttributeError, yaml.YAMLError):
        return "as configured"


def _order(frame: pd.DataFrame, column: str, ds: xr.Dataset) -> list[str]:
    if column in ds.dims:
        return [str(v) for v in ds[column].values]
    return sorted(frame[column].astype(str).unique())


def _label(keys: tuple, names: list[str]) -> str:
    parts = []
    for name, value in zip(names, keys):
        if name == "strategy":
            parts.insert(0, str(value))
        elif name == "equal_workers":
            parts.append("equal workers" if value else "unequal workers")
        else:
            parts.append(f"{name} {value}")
    return ", ".join(parts) or "all"


# Figures ----------------------------------------------------------------------------


def speedup_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Speedup against workers, per network size, with the ideal line and the paper."""
    data = frame[(frame["strategy"] != sweep.baseline) & frame["speedup"].notna()]
    if data.empty:
        return False
    panels = sweep.network_dims
    wdim = sweep.worker_dim
    skip = set(panels) | {wdim, "strategy"}
    group = ["strategy"] + [d for d in sweep.dims if d not in skip]
    if wdim is not None:  # settings zipped with the workers (e.g. placement)
        group += [c for c in sweep.ds.coords if c not in sweep.ds.dims
                  and sweep.ds[c].dims == (wdim,) and "field" in sweep.ds[c].attrs
                  and sweep.ds[c].attrs["field"] not in ("cluster.workers",
                                                         "cluster.use_workers")]
    if not data["equal_workers"].all():
        group.append("equal_workers")
    panel_values = (sorted({tuple(r) for r in data[panels].astype(str).values},
                           key=lambda v: [_order(data, p, sweep.ds).index(x)
                                          for p, x in zip(panels, v)])
                    if panels else [()])
    columns = len(panel_values)
    fig, axes = plt.subplots(1, columns, figsize=(5.2 * columns + 1.5, 4.6), squeeze=False,
                             sharey=True)
    top = max(float(np.nanmax(data["relative_capacity"])), PAPER_POINT[0], 1.0) * 1.08
    ceiling = max(top, float(np.nanmax(data["speedup_high"])) * 1.08)
    keys_in_order = [k if isinstance(k, tuple) else (k,) for k, _ in
                     data.groupby(group, sort=False)]
    palette = {key: COLORS[i % len(COLORS)] for i, key in enumerate(keys_in_order)}
    for ax, panel in zip(axes[0], panel_values):
        subset = data
        for name, value in zip(panels, panel):
            subset = subset[subset[name] == value]
        ax.plot([0, top], [0, top], color="0.6", linestyle="--", linewidth=1, label="ideal")
        ax.plot(*PAPER_POINT, marker="*", markersize=14, color="black", linestyle="none",
                label=PAPER_LABEL)
        for key, lines in subset.groupby(group, sort=False):
            keys = key if isinstance(key, tuple) else (key,)
            lines = lines.sort_values("relative_capacity")
            color = palette[keys]
            if lines["relative_capacity"].nunique() <= 1:  # one measured setting:
                ax.axhline(float(lines["speedup"].median()), linestyle=":", linewidth=1.5,
                           color=color, label=f"{_label(keys, group)} (one process)")
                continue
            error = [lines["speedup"] - lines["speedup_low"],
                     lines["speedup_high"] - lines["speedup"]]
            ax.errorbar(lines["relative_capacity"], lines["speedup"], yerr=error, color=color,
                        marker="o", capsize=3, label=_label(keys, group))
        title = ", ".join(f"{n} {v}" for n, v in zip(panels, panel)) or _base_network(sweep.ds)
        ax.set_title(f"network {title}")
        ax.set_xlim(0, top)
        ax.set_ylim(0, ceiling)
        ax.set_xlabel("workers (summed relative speed if unequal)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"speedup over '{sweep.baseline}'")
    legend: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="center left",
               bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(f"{sweep.ds.attrs.get('sweep_name', '')}: speedup (median over repeats, "
                 "bars: range)")
    save_figure(fig, path)
    return True


def _slice_of_others(sweep: StoreView, frame: pd.DataFrame,
                     keep: list[str]) -> tuple[pd.DataFrame, str]:
    """Fix every dim not in `keep` at its last value (largest batch, largest network)."""
    chosen = []
    for dim in sweep.dims:
        if dim in keep:
            continue
        values = _order(frame, dim, sweep.ds)
        candidates = [v for v in values if frame[(frame[dim] == v)]["step_time"].notna().any()]
        value = (candidates or values)[-1]
        frame = frame[frame[dim] == value]
        chosen.append(f"{dim} {value}")
    return frame, ", ".join(chosen)


def strategies_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Every strategy side by side: step time (measured bars, predicted dots), speedup and
    workspace bytes per step, one group of bars per batch size, at the most workers
    (each strategy at the largest worker count it ran at; other dims at their last)."""
    if "strategy" not in sweep.dims or frame["strategy"].nunique() < 3:
        return False
    batch = sweep.batch_dim
    keep = ["strategy"] + [d for d in (batch, sweep.worker_dim) if d is not None]
    data, fixed = _slice_of_others(sweep, frame, keep)
    data = data[data["step_time"].notna()]
    if sweep.worker_dim is not None:  # per strategy, its most distributed point
        data = data.sort_values("relative_capacity").groupby(
            ["strategy"] + ([batch] if batch else []), sort=False).tail(1)
    if data.empty:
        return False
    strategies = [s for s in _order(frame, "strategy", sweep.ds) if s in set(data["strategy"])]
    batches = _order(data, batch, sweep.ds) if batch else [None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    width = 0.8 / len(batches)
    for b, value in enumerate(batches):
        rows = data if value is None else data[data[batch] == value]
        rows = rows.set_index("strategy").reindex(strategies)
        x = np.arange(len(strategies)) + (b - (len(batches) - 1) / 2) * width
        label = f"batch {value}" if value is not None else "measured"
        color = COLORS[b % len(COLORS)]
        axes[0].bar(x, rows["step_time"], width, color=color, label=label)
        axes[0].plot(x, rows["predicted_step_time"], "o", color="black", markersize=4,
                     label="predicted" if b == 0 else None)
        axes[1].bar(x, rows["speedup"], width, color=color, label=label)
        axes[2].bar(x, rows["bytes_moved"] / 1e6, width, color=color, label=label)
    for ax, title in zip(axes, ("step time (s)", f"speedup over '{sweep.baseline}'",
                                "workspace MB per step")):
        ax.set_xticks(np.arange(len(strategies)), strategies)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    workers = (f", {sweep.worker_dim}: each at its largest" if sweep.worker_dim else "")
    fig.suptitle(f"{sweep.ds.attrs.get('sweep_name', '')}: strategies side by side "
                 f"(medians over repeats{workers}{', ' + fixed if fixed else ''})")
    save_figure(fig, path)
    return True


def breakdown_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Stacked per-step time (compute, storage, master, wait) per strategy and workers."""
    keep = [d for d in ("strategy", sweep.worker_dim) if d]
    data, fixed = _slice_of_others(sweep, frame, keep)
    data = data[data["step_time"].notna()]
    if data.empty:
        return False
    labels = [" / ".join(str(row[d]) for d in keep) or "all" for _, row in data.iterrows()]
    fig, ax = plt.subplots(figsize=(max(5.5, 0.9 * len(data) + 2), 4.6))
    x = np.arange(len(data))
    bottom = np.zeros(len(data))
    for name, label, color in BREAKDOWN:
        values = np.nan_to_num(data[name].to_numpy(dtype=float))
        ax.bar(x, values, bottom=bottom, color=color, label=label, width=0.65)
        bottom += values
    ax.plot(x, data["step_time"], marker="_", markersize=28, markeredgewidth=2,
            color="black", linestyle="none", label="measured step time")
    ax.set_xticks(x, labels, rotation=30 if len(data) > 4 else 0, ha="right" if len(data) > 4
                  else "center")
    ax.set_ylabel("seconds per step (median)")
    ax.set_xlabel(" / ".join(keep))
    ax.set_title("where a step's time goes" + (f" ({fixed})" if fixed else ""))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), markerscale=0.4)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)
    return True


def batch_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Step time and throughput against batch size, per strategy and workers."""
    bdim = sweep.batch_dim
    if bdim is None:
        return False
    keep = [d for d in ("strategy", sweep.worker_dim, bdim) if d]
    data, fixed = _slice_of_others(sweep, frame, keep)
    data = data[data["step_time"].notna()].copy()
    if data.empty:
        return False
    data["batch_value"] = pd.to_numeric(data[bdim], errors="coerce")
    group = [d for d in keep if d != bdim]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    for keys, lines in data.groupby(group, sort=False) if group else [((), data)]:
        keys = keys if isinstance(keys, tuple) else (keys,)
        lines = lines.sort_values("batch_value")
        label = _label(keys, group)
        left.plot(lines["batch_value"], lines["step_time"], marker="o", label=label)
        right.plot(lines["batch_value"], lines["throughput"], marker="o", label=label)
    left.set_ylabel("step time (s, median)")
    right.set_ylabel("throughput (samples/s)")
    for ax in (left, right):
        ax.set_xlabel("batch size")
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
                 & (frame["strategy"] == "kernel")]
    if data.empty or data["placement"].nunique() < 2:
        return False
    pdim = "placement" if "placement" in sweep.dims else None
    keep = [d for d in ("strategy", sweep.worker_dim, pdim) if d]
    data, fixed = _slice_of_others(sweep, data, keep)
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


# The markdown report ----------------------------------------------------------------


def _provenance(ds: xr.Dataset) -> list[str]:
    machine = json.loads(ds.attrs.get("machine", "{}"))
    versions = json.loads(ds.attrs.get("versions", "{}"))
    status = ds.status.values
    memory = machine.get("memory_bytes")
    lines = [
        f"- points: {int((status == DONE).sum())} done, {int((status == FAILED).sum())} "
        f"failed, {int((status == 0).sum())} pending, {int((status == SKIPPED).sum())} not "
        f"applicable (they would repeat another point), of {status.size}",
        f"- machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
        + (f", {memory / 2**30:.0f} GiB" if memory else "")
        + (f", GPUs: {', '.join(machine['gpus'])}" if machine.get("gpus") else ", no GPU")
        + f" ({machine.get('host', '?')})",
        f"- code revision {ds.attrs.get('code_revision', '?')}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- started {ds.attrs.get('started', '?')}, finished {ds.attrs.get('finished', '?')}",
        f"- command: `{ds.attrs.get('command', '')}`",
        f"- speedup is against `{ds.attrs.get('speedup_baseline', 'single')}` at the same "
        "other coordinates (median over its repeats); efficiency divides it by the "
        "workers' summed relative speed over the baseline's.",
    ]
    cores = machine.get("cores")
    if cores and "n_workers" in ds and np.nanmax(ds.n_workers.values, initial=0) + 1 > cores:
        lines.append(f"- note: some points ran more worker threads (+1 master) than the "
                     f"{cores} cores here; their timings include contention.")
    return lines


def _paper_comparison(sweep: StoreView, frame: pd.DataFrame) -> str | None:
    data = frame[(frame["strategy"] == "kernel") & frame["equal_workers"]
                 & np.isclose(frame["n_workers"], PAPER_POINT[0])]
    if data.empty or data["speedup"].isna().all():
        return None
    best = data.loc[data["speedup"].idxmax()]
    where = ", ".join(f"{d} {best[d]}" for d in sweep.dims)
    return (f"Best kernel-parallel speedup on {PAPER_POINT[0]} equal workers: "
            f"{best['speedup']:.2f}x (efficiency {best['efficiency']:.0%}; {where}); the paper "
            f"reports {PAPER_POINT[1]}x ({PAPER_POINT[1] / PAPER_POINT[0]:.0%}).")


def device_shares(kernel_split: str, batch_split: str, worker_devices: str
                  ) -> list[tuple[str, str, float]]:
    """``(worker, "device, tag", share)`` of a run's work: its kernels over all conv
    layers (kernel, single) or its samples (data, hybrid), as the store keeps them."""
    workers = json.loads(worker_devices or "[]")
    kernels = json.loads(kernel_split or "[]")
    rows = [list(r) for r in zip(*kernels)] if kernels else [[k] for k in json.loads(
        batch_split or "[]")]
    total = sum(sum(r) for r in rows)
    if not workers or len(rows) != len(workers) or not total:
        return []
    return [(name, f"{device}, {tag}", sum(row) / total)
            for (name, tag, device), row in zip(workers, rows)]


def mixes_section(ds: xr.Dataset, sweep: StoreView) -> list[str]:
    """report.md's table of step time and each device's share, point by point (first
    done repeat), where the sweep varies its devices (a `cluster.devices`, `resources`
    or `workers` axis) or runs whose workers differ in device or tag."""
    if "worker_devices" not in ds:
        return []
    status, texts = ds.status.values, {n: ds[n].values for n in (
        "kernel_split", "batch_split", "worker_devices")}
    labels = {dim: [str(v) for v in ds[dim].values] for dim in sweep.dims}
    rows, kinds = [], set()
    for position in np.ndindex(*status.shape[:-1]):
        done = np.flatnonzero(status[position] == DONE)
        if not done.size:
            continue
        cell = position + (int(done[0]),)
        shares = device_shares(*(str(texts[n][cell]) for n in texts))
        kinds.update(kind for _n, kind, _s in shares)
        where = ", ".join(f"{d} {labels[d][i]}" for d, i in zip(sweep.dims, position))
        step = float(np.nanmedian(ds.step_time.values[position][done]))
        rows.append(f"| {where or 'the point'} | {step * 1e3:.1f} | " + ", ".join(
            f"{name} ({kind}) {share:.0%}" for name, kind, share in shares) + " |")
    mixed = sweep.dim_with("cluster.devices", "cluster.resources", "cluster.workers") \
        or len(kinds) > 1
    if not rows or not mixed:
        return []
    return ["## Device mixes", "",
            "Step time (median over done repeats) and each worker's share of the work "
            "(kernels over all conv layers, or samples), from the first done repeat. "
            "Workers of a mix that are not listed were given nothing (left out by the "
            "placement).", "", "| point | step (ms) | shares |", "|---|---:|---|", *rows, ""]


def write_markdown(ds: xr.Dataset, sweep: StoreView, frame: pd.DataFrame, figures: list[str],
                   path: str) -> None:
    table = summary_table(ds)
    lines = [f"# Sweep `{ds.attrs.get('sweep_name', '?')}`", ""]
    lines += _provenance(ds)
    comparison = _paper_comparison(sweep, frame)
    if comparison:
        lines += ["", comparison]
    accuracies = frame.dropna(subset=["accuracy"]).groupby("strategy")["accuracy"]
    if len(accuracies) > 1:
        spread = ", ".join(f"{s} {a.min():.3f}" + (f"-{a.max():.3f}" if a.max() > a.min() else "")
                           for s, a in accuracies)
        lines += ["", f"Test accuracy by strategy (distribution must not change it): {spread}."]
    lines += ["", "## Figures", ""]
    captions = {"speedup.png": "Speedup against workers", "breakdown.png": "Time breakdown",
                "batch.png": "Batch size", "placement.png": "Placement on unequal workers",
                "step_times.png": "Spread of measured steps",
                "prediction.png": "Predicted against measured"}
    for name in figures:
        lines += [f"![{captions.get(name, name)}]({name})", ""]
    lines += ["## Main figures (median over done repeats)", "", format_table(table, True), ""]
    lines += mixes_section(ds, sweep)
    failures = table[table["failure"] != ""]
    if not failures.empty:
        lines += ["## Failed points", ""]
        dims = [d for d in sweep.dims]
        for _, row in failures.iterrows():
            where = ", ".join(f"{d}={row[d]}" for d in dims) or "the point"
            lines.append(f"- {where}: {row['failure']}")
        lines.append("")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))


def make_report(store: str, out_dir: str | None = None) -> list[str]:
    """Write the figures and report.md; returns the paths written."""
    if not os.path.exists(store):
        raise ReportError(f"{store}: no such results store")
    try:
        ds = xr.open_zarr(store).load()
    except Exception as error:  # noqa: BLE001 - any unreadable store gets one line
        raise ReportError(f"{store}: not a readable Zarr store ({error})") from None
    if ds.attrs.get("store_format") != STORE_FORMAT or "status" not in ds:
        raise ReportError(f"{store}: not a sweep results store")
    out_dir = out_dir or default_out_dir(store)
    os.makedirs(out_dir, exist_ok=True)
    if ds.attrs.get("mode") == "scaling":  # predicted over hypothetical clusters
        return make_scaling_report(ds, out_dir)
    sweep = StoreView(ds)
    frame = sweep.points()
    makers: list[tuple[str, Any]] = [
        ("strategies.png", lambda p: strategies_figure(sweep, frame, p)),
        ("speedup.png", lambda p: speedup_figure(sweep, frame, p)),
        ("breakdown.png", lambda p: breakdown_figure(sweep, frame, p)),
        ("batch.png", lambda p: batch_figure(sweep, frame, p)),
        ("placement.png", lambda p: placement_figure(sweep, frame, p)),
        ("step_times.png", lambda p: step_times_figure(sweep, p)),
        ("prediction.png", lambda p: prediction_figure(frame, p)),
    ]
    written = write_figures(makers, out_dir)
    report = os.path.join(out_dir, "report.md")
    write_markdown(ds, sweep, frame, written, report)
    return [os.path.join(out_dir, name) for name in written] + [report]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.report",
                                     description="Figures and a table from a sweep's store.")
    parser.add_argument("results", help="the sweep's Zarr store (results/<name>.zarr)")
    parser.add_argument("--out", help="directory for the files (default <store>.report/)")
    args = parser.parse_args(argv)
    try:
        paths = make_report(args.results, args.out)
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
