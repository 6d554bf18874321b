"""Points with no figures in the measured report's line figures: marked, never bridged.

A point none of whose repeats finished (`missing` in
:meth:`experiments.report.view.StoreView.points`: "failed", or "not run" in a store
still pending) has no step time, speedup or memory. A line drawn only through the
points that have them joins the neighbours of such a point as if it had been
measured between them, and the reader of a paper's figure cannot tell. So the
figures keep it in their lines as a gap (NaN: matplotlib breaks a line there) and
mark it on the x axis, in its line's colour: an ``x`` for a failed point, a hollow
circle for one not run yet, a hollow square for one not run because its predicted
peak memory exceeds a worker's limit, with one legend entry each.

`place_missing` gives such a point its x where the figure's x is a figure of the
point (relative capacity, workers used) from the done points at the same label of
the dim; `mark_missing` draws the marks.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from experiments.report.view import TOO_BIG

#: The mark and legend entry of each kind of missing point.
MARKS = {"failed": ("x", "failed point (no figure; see report.md)"),
         "not run": ("o", "point not run yet (no figure)"),
         TOO_BIG: ("s", "not run: predicted peak beyond a worker's memory (report.md)")}


def with_missing(frame: pd.DataFrame, figure: str) -> pd.DataFrame:
    """The rows that have `figure`, and those of points that have none because they
    failed or did not run (`missing`)."""
    return frame[frame[figure].notna() | (frame["missing"] != "")]


def place_missing(frame: pd.DataFrame, x: str, dim: str | None,
                  counts: dict[str, int] | None = None) -> pd.DataFrame:
    """`frame` with the missing points' `x` filled where it is a figure of the point
    (relative capacity, workers used) that a point without figures lacks: from the
    done points at the same label of `dim` (their median), else, for a label that
    is a count of equal workers (`counts`, `worker_counts`), that count times what
    `x` is per worker on the done points of equal workers. Left NaN where neither
    gives it (such a point is not marked: its place on the axis is unknown)."""
    if dim is None or dim not in frame or "missing" not in frame:
        return frame
    lacking = (frame["missing"] != "") & frame[x].isna()
    if not lacking.any():
        return frame
    done = frame[(frame["missing"] == "") & frame[x].notna()]
    known = done.groupby(dim)[x].median()
    frame = frame.copy()
    frame.loc[lacking, x] = frame.loc[lacking, dim].map(known).to_numpy(dtype=float)
    equal = done[done["equal_workers"]] if "equal_workers" in done else done
    per_worker = (equal[x] / equal["n_workers"]).median() if not equal.empty else np.nan
    still = lacking & frame[x].isna() & frame[dim].isin(list(counts or {}))
    if still.any() and np.isfinite(per_worker):
        frame.loc[still, x] = frame.loc[still, dim].map(counts).to_numpy(dtype=float) \
            * per_worker
        if "equal_workers" in frame:
            frame.loc[still, "equal_workers"] = True
    return frame


def worker_counts(ds, dim: str | None) -> dict[str, int]:
    """Each label of the workers dim `dim` whose `cluster.workers` is a count of
    equal workers (not a list of them), with that count."""
    if dim is None or dim not in ds.dims:
        return {}
    for name, coord in ds.coords.items():
        field = coord.attrs.get("field") or (coord.attrs.get("fields") or "")
        if coord.dims == (dim,) and "cluster.workers" in str(field) and \
                np.issubdtype(coord.dtype, np.integer):
            return {str(label): int(count) for label, count in
                    zip(ds[dim].values, coord.values)}
    return {}


def mark_missing(ax, rows: pd.DataFrame, x: str, color: str) -> None:
    """Mark each missing point of `rows` on `ax`'s x axis at its `x`, in `color`."""
    if "missing" not in rows:
        return
    for state, (marker, label) in MARKS.items():
        where = rows[(rows["missing"] == state) & rows[x].notna()]
        if where.empty:
            continue
        xs = where[x].to_numpy(dtype=float)
        ax.plot(xs, np.full(xs.size, 0.03), marker=marker, linestyle="none", color=color,
                markersize=9, markeredgewidth=2, fillstyle="none", clip_on=False,
                transform=ax.get_xaxis_transform(), label="_nolegend_")
        if label in ax.get_legend_handles_labels()[1]:
            continue
        ax.plot([], [], marker=marker, linestyle="none", color="black", markersize=9,
                markeredgewidth=2, fillstyle="none", label=label)
