"""The model's error per strategy in the report: how far predictions were from runs.

`error_rows` gathers, per strategy, every done run (point and repeat) that has a
prediction: how many, the median absolute error, the signed median (a bias shows
as a sign) and the largest; `error_section` writes them as a report.md table. The
error is the store's ``prediction_error`` (predicted / measured - 1), against each
run's median step. Pure functions of the store.

Why: users choose a strategy by the model (``strategy: auto``) and put its figures in
papers; a table per strategy says where it can be trusted and which way it errs.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

from experiments.sweep.store_layout import DONE
from experiments.sweep.summary import markdown_rows


def error_rows(ds: xr.Dataset) -> pd.DataFrame:
    """Per strategy: ``runs``, ``median_abs``, ``median``, ``max_abs`` of
    ``prediction_error`` over its done runs with a prediction (empty without any)."""
    if "prediction_error" not in ds or "status" not in ds:
        return pd.DataFrame()
    errors = ds.prediction_error.where(ds.status == DONE)
    strategies = (list(ds.strategy.values) if "strategy" in ds.dims
                  else [str(ds.attrs.get("strategy", "?"))])
    rows = []
    for name in strategies:
        values = errors.sel(strategy=name) if "strategy" in ds.dims else errors
        values = np.asarray(values.values, dtype=float).ravel()
        values = values[np.isfinite(values)]
        if values.size:
            rows.append({"strategy": str(name), "runs": int(values.size),
                         "median_abs": float(np.median(np.abs(values))),
                         "median": float(np.median(values)),
                         "max_abs": float(np.max(np.abs(values)))})
    return pd.DataFrame(rows)


def error_section(ds: xr.Dataset) -> list[str]:
    """report.md's table of the model's error per strategy (none without predictions)."""
    rows = error_rows(ds)
    if rows.empty:
        return []
    table = [[row["strategy"], str(row["runs"]), f"{row['median_abs']:.1%}",
              f"{row['median']:+.1%}", f"{row['max_abs']:.1%}"] for _, row in rows.iterrows()]
    return ["## The model's error per strategy", "",
            "Over every done run with a prediction (points and repeats): predicted / "
            "measured - 1 against the run's median step. A signed median away from 0 is "
            "a bias.", "",
            *markdown_rows(["strategy", "runs", "median abs. error", "median error",
                            "largest abs. error"], table), ""]
