"""How cost grows: a strategy's step time and its critical breakdown against batch
and workers, measured beside the model's prediction (one figure per strategy).

Each figure has a row of panels per grown dim the strategy ran at two values or
more: against the batch, a panel per worker set; against the workers, a panel per
batch. At each value two stacked bars: the measured components
(``compute``, ``exchange``, ``dataset``, ``wait``, ``client``: the store's
``critical_<component>``, along each step's critical worker,
pipeline/records/step_breakdown.py) and the model's (``predicted_compute``,
``predicted_exchange``, ``predicted_wait``, ``predicted_client``, hatched); dots mark the measured
median step, crosses the predicted step.

Drawn where the store has the breakdown (sweeps written since it was added) and a
batch or workers dim (experiments/configs/growth.yaml has both).

Why its own module: the other figures compare strategies at one setting; here each
strategy gets its own figure, read against the model's breakdown.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.report.figure_files import save_figure  # noqa: E402
from experiments.report.view import StoreView, label_order, slice_of_others  # noqa: E402
from experiments.sweep.store_layout import PREDICTED_COMPONENTS  # noqa: E402
from pipeline.records.step_breakdown import COMPONENTS  # noqa: E402

COMPONENT_COLORS = {"compute": "#4c72b0", "exchange": "#dd8452", "dataset": "#8172b3",
                    "wait": "#c44e52", "client": "#937860"}


def growth_dims(sweep: StoreView) -> list[str]:
    """The dims along which cost grows: batch, then workers (those the sweep has)."""
    return [d for d in (sweep.batch_dim, sweep.worker_dim) if d is not None]


def growth_strategies(sweep: StoreView, frame: pd.DataFrame) -> list[str]:
    """The strategies that get a growth figure: measured components at two values or more of
    a grown dim."""
    if "critical_compute" not in frame or not growth_dims(sweep):
        return []
    out = []
    for strategy in label_order(frame, "strategy", sweep.ds):
        rows = frame[(frame["strategy"] == strategy) & frame["critical_compute"].notna()]
        if any(rows[d].nunique() >= 2 for d in growth_dims(sweep)):
            out.append(strategy)
    return out


def growth_rows(sweep: StoreView, frame: pd.DataFrame, strategy: str, dim: str,
                at: dict[str, str] | None = None) -> tuple[pd.DataFrame, str]:
    """The strategy's points along `dim`, in the store's order: the dims in `at` at
    those values, every other dim at its last value with figures for this strategy;
    and what was fixed (text)."""
    rows = frame[(frame["strategy"] == strategy) & frame["step_time"].notna()]
    for name, value in (at or {}).items():
        rows = rows[rows[name] == value]
    rows, fixed = slice_of_others(sweep, rows, ["strategy", dim, *(at or {})])
    fixed = ", ".join([*(f"{name} {value}" for name, value in (at or {}).items()),
                       *([fixed] if fixed else [])])
    order = label_order(frame, dim, sweep.ds)
    rows = rows.assign(_at=[order.index(v) for v in rows[dim]]).sort_values("_at")
    return rows.drop(columns="_at"), fixed


def _stack(ax, x: np.ndarray, rows: pd.DataFrame, names: list[tuple[str, str]],
           width: float, hatch: str | None, alpha: float, label: bool) -> None:
    bottom = np.zeros(len(rows))
    for component, column in names:
        values = np.nan_to_num(rows[column].to_numpy(dtype=float))
        ax.bar(x, values, width, bottom=bottom, color=COMPONENT_COLORS[component], alpha=alpha,
               hatch=hatch, edgecolor="white" if hatch is None else "0.3", linewidth=0.5,
               label=component if label else None)
        bottom += values


def growth_panels(sweep: StoreView, frame: pd.DataFrame, strategy: str
                  ) -> list[list[tuple[str, pd.DataFrame, str]]]:
    """The strategy's panels, a row per grown dim: (dim, its points along it, what was
    fixed) at each value of the other grown dim (if the sweep has one), where it has
    figures at two values or more of `dim`."""
    dims = growth_dims(sweep)
    ran = frame[(frame["strategy"] == strategy) & frame["step_time"].notna()]
    grid = []
    for dim in dims:
        others = [d for d in dims if d != dim]
        settings = ([{others[0]: v} for v in label_order(frame, others[0], sweep.ds)
                     if v in set(ran[others[0]])] if others else [{}])
        row = []
        for at in settings:
            rows, fixed = growth_rows(sweep, frame, strategy, dim, at)
            if rows[dim].nunique() >= 2:
                row.append((dim, rows, fixed))
        if row:
            grid.append(row)
    return grid


def growth_figure(sweep: StoreView, frame: pd.DataFrame, strategy: str, path: str) -> bool:
    """The strategy's figure: `growth_panels`' grid; False where it has none."""
    grid = growth_panels(sweep, frame, strategy)
    if not grid:
        return False
    columns = max(len(row) for row in grid)
    fig, axes = plt.subplots(len(grid), columns, figsize=(4.8 * columns + 0.5, 4.0 * len(grid)),
                             squeeze=False)
    for r, row in enumerate(grid):
        for c in range(len(row), columns):
            axes[r][c].set_visible(False)
    panels = [(axes[r][c], panel) for r, row in enumerate(grid) for c, panel in enumerate(row)]
    measured = [(p, f"critical_{p}") for p in COMPONENTS]
    # stores written before the model had a wait part lack predicted_wait
    predicted = [(p, f"predicted_{p}") for p in PREDICTED_COMPONENTS
                 if f"predicted_{p}" in frame]
    for ax, (dim, rows, fixed) in panels:
        x = np.arange(len(rows))
        width = 0.38
        _stack(ax, x - width / 2, rows, measured, width, None, 0.95, ax is axes[0][0])
        has_model = rows["predicted_step_time"].notna().any()
        if has_model:
            _stack(ax, x + width / 2, rows, predicted, width, "//", 0.45, False)
            ax.plot(x + width / 2, rows["predicted_step_time"], "x", color="black",
                    markersize=7, label="predicted step" if ax is axes[0][0] else None)
        ax.plot(x - width / 2, rows["step_time"], "o", color="black", markersize=4,
                label="measured step (median)" if ax is axes[0][0] else None)
        labels = [str(v) for v in rows[dim]]
        ax.set_xticks(x, labels, rotation=20 if max(map(len, labels)) > 6 else 0)
        ax.set_xlabel(dim if has_model else f"{dim} (no prediction)")
        ax.set_ylabel("seconds per step")
        ax.set_title(f"against {dim}" + (f" ({fixed})" if fixed else ""), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{sweep.ds.attrs.get('sweep_name', '')}: how '{strategy}' grows\n(left bars: "
                 "measured, components along each step's critical worker; right, hatched: "
                 "the model's; medians over repeats)", fontsize=10)
    save_figure(fig, path)
    return True


def growth_section(figures: list[str]) -> list[str]:
    """report.md's section on the growth figures written (none: no section)."""
    names = [name for name in figures if name.startswith("growth_")]
    if not names:
        return []
    lines = ["## How cost grows", "",
             "Step time and its components against batch and workers, one figure per strategy "
             "(medians over repeats). Left bar: measured, along each step's critical "
             "worker: compute (emulated slow-down included), exchange (workspace reads and "
             "writes), dataset reads, wait (blocked on a peer's slot) and client (the "
             "rest of the step: client, scheduler, dispatch). Right bar, hatched: the "
             "model's critical path (compute, exchange, Dask overhead as client); dots: "
             "measured median step, crosses: predicted step.", ""]
    for name in names:
        strategy = name[len("growth_"):-len(".png")]
        lines += [f"![How {strategy} grows]({name})", ""]
    return lines
