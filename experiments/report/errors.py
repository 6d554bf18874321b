"""The model's error per strategy in the report: how far predictions were from runs.

`error_rows` gathers, per strategy, every done run (point and repeat) that has a
prediction: how many, the median absolute error, the signed median (a bias shows
as a sign) and the largest; `error_section` writes them as a report.md table, with the
CPU model the runs and their probes were measured on (`measured_on`). The
error is the store's ``prediction_error`` (predicted / measured - 1), against each
run's median step. Pure functions of the store.

Why: users choose a strategy by the model (``strategy: auto``) and put its figures in
papers; a table per strategy says where it can be trusted and which way it errs.
"""

from __future__ import annotations

import json

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


def measured_on(ds: xr.Dataset) -> str:
    """The machine the store's runs were measured (and its probes made) on, from its
    ``machine`` attr: the CPU model first, as the error holds for that machine."""
    machine = json.loads(ds.attrs.get("machine", "{}"))
    return (f"{machine.get('cpu', 'an unrecorded CPU')}, {machine.get('cores', '?')} cores "
            f"(host {machine.get('host', '?')})")


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
            f"a bias. Measured on {measured_on(ds)}: the error holds for that machine, "
            "after its own probe.", "",
            *markdown_rows(["strategy", "runs", "median abs. error", "median error",
                            "largest abs. error"], table), ""]
