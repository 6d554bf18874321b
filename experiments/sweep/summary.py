"""A sweep's store read back as a table: one row per grid point, repeats pooled.

`summary_table` gives the main figures (medians over done repeats) of every grid
point; `format_table` prints them as aligned text (the sweep's closing table) or
markdown (the report's); `base_strategy` is the strategy of a store without a
strategy axis.

Why apart from the store's writes (:mod:`experiments.sweep.results`): the sweep, the
measured report and the scaling report all read stores this way, while only the
sweeps write them.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr
import yaml

from experiments.sweep.store_layout import DONE, FAILED, INFEASIBLE, SKIPPED

def _labels(ds: xr.Dataset, dim: str) -> list[str]:
    return [str(v) for v in ds[dim].values]


def repeat_spread_of(times: np.ndarray) -> float:
    """How far one point's repeats measured apart: (largest - smallest) / median of
    their step times (the NaNs of runs not done left out); NaN with fewer than two.
    A model error within it cannot be told from the machine's own noise."""
    times = np.asarray(times, dtype=float)
    times = times[np.isfinite(times)]
    if times.size < 2:
        return float("nan")
    return float((times.max() - times.min()) / np.median(times))


#: Figures that are one number over a point's step time (its samples, the baseline's
#: median step): pooled over repeats as that number over their median step, so that
#: they agree with the step time's median (the baseline's own speedup is 1.00) where
#: the median of an even number of rates, the mean of the middle two, would not.
RATES = ("throughput", "speedup", "efficiency")


def summary_table(ds: xr.Dataset) -> pd.DataFrame:
    """One row per grid point (repeats pooled): the main figures, for print and report
    (the fullest worker's working memory among them, where the store has it).

    Figures are medians over the done repeats; ``runs`` counts done/all repeats, and
    ``repeat_spread`` how far they measured apart (`repeat_spread_of`). A row's
    ``prediction_error`` is its own predicted over its step time, less 1, so that the
    three columns agree (the median of the repeats' errors did not: -20 % beside
    0.0293 s predicted and 0.0336 s measured).
    """
    dims = [d for d in ds.status.dims if d != "repeat"]
    status = ds.status.values
    figures = {name: ds[name].values for name in (
        "step_time", "step_time_p25", "step_time_p75", "throughput", "speedup", "efficiency",
        "compute_time", "storage_time", "master_time", "wait_time", "bytes_moved", "loss",
        "accuracy", "predicted_step_time", "prediction_error", "compute_error",
        "memory_working")
        if name in ds}  # stores written before memory (compute's error) have none
    failures = ds.failure.values
    labels = {dim: _labels(ds, dim) for dim in dims}
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for position in np.ndindex(*status.shape[:-1]):
            if (status[position] == SKIPPED).all():  # not applicable: no row
                continue
            done = status[position] == DONE
            row: dict[str, Any] = {dim: labels[dim][i] for dim, i in zip(dims, position)}
            row["runs"] = f"{int(done.sum())}/{done.size}"
            steps = figures["step_time"][position][done] if "step_time" in figures else None
            for name, values in figures.items():
                picked = values[position][done]
                row[name] = float(np.nanmedian(picked)) if picked.size else np.nan
                if name in RATES and steps is not None and picked.size:
                    pooled = np.nanmedian(picked * steps) / np.nanmedian(steps)
                    row[name] = float(pooled) if np.isfinite(pooled) else row[name]
            if np.isfinite(row.get("predicted_step_time", np.nan)) and \
                    row.get("step_time", 0) > 0:  # the row's own two medians, as its
                row["prediction_error"] = row["predicted_step_time"] / row["step_time"] - 1
            row["repeat_spread"] = repeat_spread_of(figures["step_time"][position][done])
            reasons = sorted({str(r) for r, s in zip(failures[position], status[position])
                              if s == FAILED and str(r)})
            row["failure"] = "; ".join(reasons)
            row["beyond_memory"] = bool(reasons) and all(r.startswith(INFEASIBLE)
                                                         for r in reasons)
            rows.append(row)
    return pd.DataFrame(rows)


def format_table(table: pd.DataFrame, markdown: bool = False) -> str:
    """The main figures as aligned text (or a markdown table)."""
    columns = [c for c in table.columns if c not in (
        "step_time_p25", "step_time_p75", "predicted_step_time", "prediction_error",
        "compute_error", "repeat_spread", "failure", "beyond_memory")]
    if "memory_working" in table and table["memory_working"].isna().all():
        columns.remove("memory_working")
    if table["predicted_step_time"].notna().any():
        columns += ["predicted_step_time", "prediction_error"]
        if "compute_error" in table and table["compute_error"].notna().any():
            columns.append("compute_error")
    if "repeat_spread" in table and table["repeat_spread"].notna().any():
        columns.append("repeat_spread")  # last, beside any errors: the noise they sit in
    names = {"step_time": "step s", "throughput": "samples/s", "speedup": "speedup",
             "efficiency": "effic.", "compute_time": "compute s", "storage_time": "exchange s",
             "master_time": "master s", "wait_time": "wait s", "bytes_moved": "MB/step",
             "loss": "loss", "accuracy": "acc.", "predicted_step_time": "predicted s",
             "prediction_error": "pred. err", "memory_working": "working MB",
             "compute_error": "compute err", "repeat_spread": "rep. spread"}
    formats = {"step_time": "{:.4f}", "throughput": "{:.1f}", "speedup": "{:.2f}",
               "efficiency": "{:.2f}", "compute_time": "{:.4f}", "storage_time": "{:.4f}",
               "master_time": "{:.4f}", "wait_time": "{:.4f}", "loss": "{:.3f}",
               "accuracy": "{:.3f}", "predicted_step_time": "{:.4f}",
               "prediction_error": "{:+.0%}", "compute_error": "{:+.0%}",
               "repeat_spread": "{:.0%}"}
    header = [names.get(c, c) for c in columns]
    body = []
    for _, row in table.iterrows():
        cells = []
        for column in columns:
            value = row[column]
            if column in ("bytes_moved", "memory_working"):
                cells.append("-" if pd.isna(value) else f"{value / 1e6:.2f}")
            elif column in formats:
                cells.append("-" if pd.isna(value) else formats[column].format(value))
            else:
                cells.append(str(value))
        if row.get("failure"):
            cells[columns.index("runs")] += (" (not run: memory)" if row.get("beyond_memory")
                                             else " (failed)")
        body.append(cells)
    if markdown:
        numeric = set(names)
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("--:" if c in numeric else "---" for c in columns) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(cells[i]) for cells in body)) if body else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in body]
    return "\n".join(lines)


def base_strategy(ds: xr.Dataset) -> str:
    """The base config's strategy of a sweep store (for stores without that axis)."""
    try:
        return str(yaml.safe_load(ds.attrs.get("config", ""))["base"].get("strategy", "kernel"))
    except (TypeError, KeyError, AttributeError, yaml.YAMLError):
        return "kernel"


def markdown_rows(header: list[str], rows: list[list[str]]) -> list[str]:
    """A small markdown table as report.md lines: the header, its rule, one line a row."""
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cells) + " |" for cells in rows])


def clock(seconds: float) -> str:
    """A duration as the sweep's progress lines give it: ``01:05`` or ``1:02:03``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else \
        f"{rest // 60:02d}:{rest % 60:02d}"
