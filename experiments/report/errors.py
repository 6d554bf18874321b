"""The model's error per strategy in the report: how far predictions were from runs.

`error_rows` gathers, per strategy, every done run (point and repeat) that has a
prediction: how many, the median absolute error, the signed median (a bias shows
as a sign) and the largest; beside them the signed median of ``compute_error`` (the
model's compute against the run's: where it carries the miss, the machine ran at
another speed than at its probe) and how far repeats of one point measured apart
(`repeat_spread`: the machine's own noise, below which no error can be told from
it). `error_section` writes them as a report.md table, with the machines the runs
and their probes were measured on (`measured_on`: the workers', which on a cluster
are not the client's). The error is the store's
``prediction_error`` (predicted / measured - 1), against each run's median step.
Pure functions of the store.

Why: users choose a strategy by the model (``strategy: auto``) and put its figures in
papers; a table per strategy says where it can be trusted and which way it errs.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import xarray as xr

from experiments.sweep.store_layout import DONE
from experiments.sweep.summary import base_strategy, markdown_rows, repeat_spread_of


def error_rows(ds: xr.Dataset) -> pd.DataFrame:
    """Per strategy: ``runs``, ``median_abs``, ``median``, ``max_abs`` of
    ``prediction_error`` over its done runs with a prediction (empty without any),
    ``compute_median`` (the signed median of ``compute_error``) and ``repeat_spread``
    (`repeat_spread`); NaN where the store has no such figures."""
    if "prediction_error" not in ds or "status" not in ds:
        return pd.DataFrame()
    rows = _rows(ds, ds.prediction_error)
    if rows.empty:
        return rows
    compute = _rows(ds, ds.compute_error) if "compute_error" in ds else pd.DataFrame()
    medians = dict(zip(compute.get("strategy", []), compute.get("median", [])))
    spreads = repeat_spread(ds)
    return rows.assign(compute_median=[medians.get(n, np.nan) for n in rows.strategy],
                       repeat_spread=[spreads.get(n, np.nan) for n in rows.strategy])


def repeat_spread(ds: xr.Dataset) -> dict[str, float]:
    """Per strategy, the median over its points of how far the point's done repeats
    measured apart: (largest - smallest) / median of their median steps; points with
    fewer than two done repeats count for nothing, and a strategy without any such
    point is left out. A model error below this is within the machine's own noise."""
    if "step_time" not in ds or "repeat" not in ds.dims or ds.sizes["repeat"] < 2:
        return {}
    times = ds.step_time.where(ds.status == DONE)
    strategies = list(ds.strategy.values) if "strategy" in ds.dims else [None]
    out = {}
    for name in strategies:
        values = times.sel(strategy=name) if name is not None else times
        other = [d for d in values.dims if d != "repeat"]
        per_point = np.asarray(values.transpose(*other, "repeat").values, dtype=float)
        per_point = per_point.reshape(-1, values.sizes["repeat"])
        spreads = [spread for spread in map(repeat_spread_of, per_point) if np.isfinite(spread)]
        if spreads:
            out[str(name if name is not None else base_strategy(ds))] = (
                float(np.median(spreads)))
    return out


def memory_error_rows(ds: xr.Dataset) -> pd.DataFrame:
    """As `error_rows`, of the memory model: the largest predicted peak of a worker
    (``predicted_peak_memory``) over the fullest worker's measured peak
    (``memory_peak``), less 1."""
    if not {"predicted_peak_memory", "memory_peak", "status"} <= set(ds.variables):
        return pd.DataFrame()
    return _rows(ds, ds.predicted_peak_memory / ds.memory_peak - 1.0)


def _rows(ds: xr.Dataset, errors: xr.DataArray) -> pd.DataFrame:
    errors = errors.where(ds.status == DONE)
    strategies = (list(ds.strategy.values) if "strategy" in ds.dims
                  else [str(base_strategy(ds))])
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
    """Where the store's runs were measured (and their probes made): the machines
    its done points' workers trained on (``worker_machines``: on a cluster of
    other hosts, not the client's), else, in a store without them, its ``machine``
    attr (the client's): the CPU model first, as the error holds for that machine."""
    machines = workers_machines(ds)
    if len(machines) == 1:
        return f"{machines[0]} (the workers' machine): the error holds for that machine"
    if machines:
        return (f"{'; '.join(machines)} (the workers' machines): the error holds for "
                "those machines")
    machine = json.loads(ds.attrs.get("machine", "{}"))
    return (f"{machine.get('cpu', 'an unrecorded CPU')}, {machine.get('cores', '?')} cores "
            f"(host {machine.get('host', '?')}): the error holds for that machine")


def workers_machines(ds: xr.Dataset) -> list[str]:
    """The machines the done points' workers trained on, as they said them, in the
    store's order; none in a store written before they were kept."""
    if "worker_machines" not in ds or "status" not in ds:
        return []
    done = np.asarray(ds.status.values == DONE)
    texts = np.asarray(ds.worker_machines.values)[done]
    said = [str(w.get("machine")) for text in texts
            for w in json.loads(str(text or "") or "{}").values() if w.get("machine")]
    return list(dict.fromkeys(said))


def error_section(ds: xr.Dataset) -> list[str]:
    """report.md's tables of the model's error per strategy, step time and then peak
    memory (none without predictions)."""
    lines = []
    for rows, title, what in (
            (error_rows(ds), "The model's error per strategy",
             "predicted / measured - 1 against the run's median step; the compute "
             "error is the model's compute against the run's (where it carries the "
             "error, the machine ran at another speed than at its probe), and the "
             "repeat spread how far repeats of one point measured apart, (largest - "
             "smallest) / median, the median over points: an error within it cannot be "
             "told from the machine's own noise"),
            (memory_error_rows(ds), "The memory model's error per strategy",
             "the largest predicted peak of a worker / the fullest worker's measured "
             "peak - 1 (resident memory, a bare process included)")):
        if rows.empty:
            continue
        extra = [c for c in ("compute_median", "repeat_spread") if c in rows]
        table = [[row["strategy"], str(row["runs"]), f"{row['median_abs']:.1%}",
                  f"{row['median']:+.1%}", f"{row['max_abs']:.1%}",
                  *(_percent(row[c], signed=c == "compute_median") for c in extra)]
                 for _, row in rows.iterrows()]
        lines += [f"## {title}", "",
                  f"Over every done run with a prediction (points and repeats): {what}. "
                  "A signed median away from 0 is a bias. Measured on "
                  f"{measured_on(ds)}, after its own probe.", "",
                  *markdown_rows(["strategy", "runs", "median abs. error", "median error",
                                  "largest abs. error",
                                  *(EXTRA_COLUMNS[c] for c in extra)], table), ""]
    return lines


#: The step-time table's columns beyond the error's own.
EXTRA_COLUMNS = {"compute_median": "median compute error", "repeat_spread": "repeat spread"}


def _percent(value: float, signed: bool) -> str:
    """A table cell: a per cent, or a dash where there is no figure."""
    if not np.isfinite(value):
        return "-"
    return f"{value:+.1%}" if signed else f"{value:.1%}"
