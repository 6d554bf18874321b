"""A measured sweep's store as the report's figures read it.

`StoreView` says which dim holds the workers, the network sizes or the batch, and
turns the store into one row per grid point (medians and ranges over the done
repeats). `label_order` and `slice_of_others` are how every figure orders a dim's
labels and fixes the dims it does not show; `COLORS` and Marques et al.'s result
(`PAPER_POINT`) are shared by the figures and report.md.

Why one view: each figure family (:mod:`experiments.report.figures`,
:mod:`experiments.report.strategies`) and report.md
(:mod:`experiments.report.markdown`) must agree on what a point's figures are.
"""

from __future__ import annotations

import itertools
import json
import warnings
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402
import xarray as xr  # noqa: E402

from experiments.sweep.store_layout import (DONE, FAILED, PENDING,  # noqa: E402
                                           PREDICTED_COMPONENTS, infeasible)
from experiments.sweep.axes import build_axes, point_data  # noqa: E402
from experiments.sweep.summary import RATES, base_strategy  # noqa: E402
from pipeline.config.schema import ConfigError  # noqa: E402
from pipeline.records.step_breakdown import COMPONENTS  # noqa: E402

PAPER_POINT = (4, 3.28)  # Marques et al. 2018: 3.28x speedup with four CPUs
PAPER_STRATEGY = "kernel"  # the paper's method, as a store names its rows
PAPER_LABEL = "Marques et al. 2018: 3.28x on 4 CPUs (conv 500/1500)"
#: The network of that figure (configs/paper.yaml): its point is drawn only beside it.
PAPER_KERNELS = [500, 1500]
#: `StoreView.points`'s `missing` of a point not run: its predicted peak memory
#: exceeds a worker's limit (experiments/sweep/cli.py's check before the sweep).
TOO_BIG = "beyond memory"
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
POINT_FIGURES = ["step_time", "throughput", "speedup", "efficiency", "compute_time",
                 "storage_time", "master_time", "wait_time", "bytes_moved", "loss", "accuracy",
                 "n_workers", "capacity", "predicted_step_time"]
#: Figures a store may lack (written before they existed).
OPTIONAL_FIGURES = ["offered_workers", "client_cpu_per_step", "predicted_low", "predicted_high"]
#: A step's critical breakdown, measured and predicted (pipeline/records/step_breakdown.py),
#: where a store has it.
BREAKDOWN_FIGURES = [*(f"critical_{p}" for p in COMPONENTS),
                     *(f"predicted_{p}" for p in PREDICTED_COMPONENTS)]
#: Figures of stores written since memory is measured (older ones lack them).
MEMORY_FIGURES = ["memory_peak", "memory_working", "client_memory_peak"]


def has_paper_network(ds: xr.Dataset) -> bool:
    """Whether some point of the store trains the paper's network (`PAPER_KERNELS`):
    its sweep's points as the sweep builds them (`build_axes`, `point_data`), over the
    axes and zip groups that set a network field. Beside another network the paper's
    speedup is no figure to compare with, and a reader of the figure could take it
    for one."""
    try:
        config = yaml.safe_load(ds.attrs.get("config", "")) or {}
        base = config.get("base") if isinstance(config.get("base"), dict) else {}
        axes = [axis for axis in build_axes(SimpleNamespace(
            axes=config.get("axes") or {}, zip=config.get("zip") or [], measure=None))
                if any(field.startswith("network.") for field in axis.fields)]
    except (yaml.YAMLError, ConfigError, AttributeError, TypeError):
        return False
    for position in itertools.product(*(range(len(axis)) for axis in axes)):
        conv = (point_data(base, axes, position).get("network") or {}).get("conv") or []
        if [layer.get("kernels") for layer in conv if isinstance(layer, dict)] == PAPER_KERNELS:
            return True
    return False


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

    def batch_field(self) -> str | None:
        """The name of the coordinate that holds each position's batch size along
        `batch_dim`: the dim itself where it sweeps `train.batch` alone, else the
        coordinate of that field in its zip group (whose own labels read `8/0.05`)."""
        bdim = self.batch_dim
        if bdim is None or self.axes.get(bdim) == ["train.batch"]:
            return bdim
        return next((str(name) for name, coord in self.ds.coords.items()
                     if coord.dims == (bdim,) and coord.attrs.get("field") == "train.batch"),
                    bdim)

    def batch_sizes(self, frame: pd.DataFrame) -> pd.Series:
        """Each row's batch size (samples), as a number: `batch_field`'s values."""
        return pd.to_numeric(frame[self.batch_field()], errors="coerce")

    def batch_label(self) -> str:
        """The batch axis's label: what else moves with it, for a zip group."""
        others = [f for f in self.axes.get(self.batch_dim or "", []) if f != "train.batch"]
        return "batch size (samples)" + (f"; zipped with {', '.join(others)}" if others
                                         else "")

    def points(self) -> pd.DataFrame:
        """One row per grid point: medians (and min/max) over done repeats, all labels;
        `missing` says why a point has no figures: `TOO_BIG` (no repeat done, each
        failed one not run as beyond its workers' memory), "failed" (no repeat done,
        one failed), "not run" (none done or failed, one pending), else "" (done, or
        not applicable), so that a figure marks it rather than drawing past it."""
        ds = self.ds
        done = ds.status == DONE
        figures = ds[POINT_FIGURES + [n for n in BREAKDOWN_FIGURES + OPTIONAL_FIGURES
                                       + MEMORY_FIGURES if n in ds]].where(done)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            median = figures.median("repeat")
            low = figures.min("repeat")
            high = figures.max("repeat")
            steps = figures.step_time
            for name in RATES:  # as the main table pools them
                pooled = (figures[name] * steps).median("repeat") / steps.median("repeat")
                median[name] = pooled.fillna(median[name])
        table = median.copy()
        for name in ("step_time", "speedup", "efficiency"):
            table[f"{name}_low"] = low[name]
            table[f"{name}_high"] = high[name]
        table["done"] = done.sum("repeat")
        failed, pending = ((ds.status == state).sum("repeat") for state in (FAILED, PENDING))
        too_big = ((ds.status == FAILED) & xr.apply_ufunc(infeasible, ds.failure)).sum(
            "repeat") if "failure" in ds else xr.zeros_like(failed)
        table["missing"] = xr.where(table["done"] > 0, "",
                                    xr.where((failed > 0) & (too_big == failed), TOO_BIG,
                                             xr.where(failed > 0, "failed",
                                                      xr.where(pending > 0, "not run", ""))))
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
        # Equal: as fast together as as many unslowed devices as the point was given
        # (idle ones included; stores without offered_workers: those used).
        given = frame["offered_workers"].fillna(frame["n_workers"]) \
            if "offered_workers" in frame else frame["n_workers"]
        frame["equal_workers"] = np.isclose(frame["capacity"], given)
        return frame


def label_order(frame: pd.DataFrame, column: str, ds: xr.Dataset) -> list[str]:
    """A column's labels in the store's order (sorted, for a column that is no dim)."""
    if column in ds.dims:
        return [str(v) for v in ds[column].values]
    return sorted(frame[column].astype(str).unique())


def slice_of_others(sweep: StoreView, frame: pd.DataFrame,
                    keep: list[str]) -> tuple[pd.DataFrame, str]:
    """Fix every dim not in `keep` at its last value (largest batch, largest network)."""
    chosen = []
    for dim in sweep.dims:
        if dim in keep:
            continue
        values = label_order(frame, dim, sweep.ds)
        candidates = [v for v in values if frame[(frame[dim] == v)]["step_time"].notna().any()]
        value = (candidates or values)[-1]
        frame = frame[frame[dim] == value]
        chosen.append(f"{dim} {value}")
    return frame, ", ".join(chosen)
