"""The strategies figure: every strategy side by side, measured and predicted.

One group of bars per batch size, at each strategy's most distributed point:
step time (measured bars, the model's prediction as dots), speedup over the
baseline, and workspace bytes moved per step. Drawn where the sweep has a
strategy axis with three strategies or more.

Why a figure of its own: it compares strategies across the grid (each at the
most workers it ran on), where the other figures follow one setting
(:mod:`experiments.report.figures`).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.report.figure_files import save_figure  # noqa: E402
from experiments.report.gaps import place_missing, with_missing, worker_counts  # noqa: E402
from experiments.report.view import COLORS, StoreView, label_order, slice_of_others  # noqa: E402


def strategies_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Every strategy side by side: step time (measured bars, predicted dots), speedup and
    workspace bytes per step, one group of bars per batch size, at the most workers
    (each strategy at the largest worker count it ran at; other dims at their last)."""
    if "strategy" not in sweep.dims or frame["strategy"].nunique() < 3:
        return False
    batch = sweep.batch_dim
    keep = ["strategy"] + [d for d in (batch, sweep.worker_dim) if d is not None]
    data, fixed = slice_of_others(sweep, frame, keep)
    wdim = sweep.worker_dim
    data = place_missing(with_missing(data, "step_time"), "relative_capacity", wdim,
                         worker_counts(sweep.ds, wdim))
    if wdim is not None:  # per strategy, its most distributed point, done or not: a
        # failed one is an empty, labelled slot, not the next one down passed off as it
        data = data[data["relative_capacity"].notna()].sort_values(
            "relative_capacity", kind="stable").groupby(
            ["strategy"] + ([batch] if batch else []), sort=False).tail(1)
    if data["step_time"].isna().all():
        return False
    strategies = [s for s in label_order(frame, "strategy", sweep.ds)
                  if s in set(data["strategy"])]
    batches = label_order(data, batch, sweep.ds) if batch else [None]
    predicted = data["predicted_step_time"].notna().any()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    width = 0.8 / len(batches)
    for b, value in enumerate(batches):
        rows = data if value is None else data[data[batch] == value]
        rows = rows.set_index("strategy").reindex(strategies)
        x = np.arange(len(strategies)) + (b - (len(batches) - 1) / 2) * width
        label = f"batch {value}" if value is not None else "measured"
        color = COLORS[b % len(COLORS)]
        axes[0].bar(x, rows["step_time"], width, color=color, label=label)
        if predicted:  # no legend entry for dots the store has none of
            axes[0].plot(x, rows["predicted_step_time"], "o", color="black", markersize=4,
                         label="predicted" if b == 0 else None)
        axes[1].bar(x, rows["speedup"], width, color=color, label=label)
        axes[2].bar(x, rows["bytes_moved"] / 1e6, width, color=color, label=label)
        for ax in axes:  # a slot with no bar says why
            for position, state in zip(x, rows["missing"].fillna("")):
                if state:
                    ax.text(position, 0, f" {state}", rotation=90, ha="center",
                            va="bottom", fontsize=8, color="#c44e52")
    speedup = f"speedup over '{sweep.baseline}'" + (
        "" if data["speedup"].notna().any() else " (none: no done point of it)")
    at = {str(name): _at(rows, wdim) for name, rows in data.groupby("strategy", sort=False)}
    ticks = [at[name] for name in strategies]
    for ax, title in zip(axes, ("step time (s)", speedup, "exchange MB per step")):
        ax.set_xticks(np.arange(len(strategies)), ticks)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    workers = (f", {sweep.worker_dim}: each at its largest" if sweep.worker_dim else "")
    fig.suptitle(f"{sweep.ds.attrs.get('sweep_name', '')}: strategies side by side "
                 f"(medians over repeats{workers}{', ' + fixed if fixed else ''})")
    save_figure(fig, path)
    return True


def _at(rows: pd.DataFrame, wdim: str | None) -> str:
    """A strategy's tick: its name, and the workers its bars are at (`wdim`'s labels)."""
    name = str(rows["strategy"].iloc[0]) if not rows.empty else ""
    if wdim is None or rows.empty:
        return name
    return f"{name}\n{wdim} {'/'.join(dict.fromkeys(rows[wdim].astype(str)))}"
