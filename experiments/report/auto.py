"""``strategy: auto`` in the report: did the model pick the measured best?

Where a sweep measures ``auto`` next to fixed strategies, `auto_rows` lines up,
per point (every other coordinate fixed), what auto chose, auto's own measured
step, and the fastest fixed strategy it could have picked; `auto_section` writes
them as a report.md table. Pure functions of the store.

A strategy that runs on one worker whatever the cluster (`single`) is measured at
the fewest workers only, its points at more workers recorded not applicable
(experiments/sweep/points.py): at those, its measured point stands for it, since it
is what auto runs when it picks it there (one worker of the cluster). Leaving it
out would let auto, picking it, appear to beat the "best" by the whole gap between
`single` and the distributed strategies. Where auto's choice was measured nowhere
as a fixed strategy, there is nothing it can be compared with on equal terms, and
the row says so rather than give a figure.

Why its own module: the choice lives in the store's ``strategy_choice`` text
(JSON), which no other report part reads.
"""

from __future__ import annotations

import json

import pandas as pd
import xarray as xr

from experiments.sweep.summary import markdown_rows
from pipeline.strategies import STRATEGIES

AUTO = "auto"


def _choices(ds: xr.Dataset, dims: list[str]) -> dict[tuple[str, ...], str]:
    """Auto's chosen strategy per point (labels as text), from any repeat that has one."""
    if "strategy_choice" not in ds:
        return {}
    choice = ds.strategy_choice  # no strategy dim: every point runs the base's strategy
    if "strategy" in ds.dims:
        if AUTO not in [str(s) for s in ds.strategy.values]:
            return {}
        choice = choice.sel(strategy=AUTO)
    texts = choice.to_dataframe().reset_index()
    out: dict[tuple[str, ...], str] = {}
    for _, row in texts.iterrows():
        text = str(row["strategy_choice"] or "")
        if text:
            out.setdefault(tuple(str(row[d]) for d in dims), json.loads(text)["chosen"])
    return out


def _candidate(name: str) -> bool:
    """Whether auto could have picked `name`: a distributed strategy (not `reference`,
    the in-process baseline, nor auto itself); unknown names count as candidates."""
    strategy = STRATEGIES.get(name)
    return name != AUTO and (strategy is None or (strategy.uses_cluster
                                                  and not strategy.chosen_by_model))


def _one_worker(name: str) -> bool:
    """Whether `name` uses one worker whatever the cluster (`single`), so that a sweep
    measures it at the fewest workers only (experiments/sweep/points.py)."""
    strategy = STRATEGIES.get(name)
    return strategy is not None and strategy.one_worker


def _matching(rows: pd.DataFrame, dims: list[str], key: tuple[str, ...]) -> pd.DataFrame:
    """The rows whose labels along `dims` are `key`."""
    for dim, value in zip(dims, key):
        rows = rows[rows[dim].astype(str) == value]
    return rows


def measured_candidates(frame: pd.DataFrame, dims: list[str], key: tuple[str, ...],
                        worker_dim: str | None) -> pd.DataFrame:
    """Each strategy auto could pick, with the measured point that stands for it at the
    point `key` (labels along `dims`): its own point there; for a one-worker strategy
    (`single`) not measured there, its point at the same other coordinates and another
    worker count (where the sweep measured it). Columns ``strategy``, ``step_time`` and
    ``measured_at`` (``""`` at the point itself, else e.g. ``"workers 1"``)."""
    measured = frame[frame["strategy"].map(_candidate) & frame["step_time"].notna()]
    rows = []
    for name, own in measured.groupby("strategy", sort=False):
        here = _matching(own, dims, key)
        where = ""
        if here.empty and _one_worker(str(name)) and worker_dim in dims:
            others = [d for d in dims if d != worker_dim]
            here = _matching(own, others, tuple(v for d, v in zip(dims, key)
                                                if d != worker_dim))
            if not here.empty:
                where = f"{worker_dim} {here.iloc[0][worker_dim]}"
        if not here.empty:
            rows.append({"strategy": str(name), "step_time": float(here.iloc[0]["step_time"]),
                         "measured_at": where})
    return pd.DataFrame(rows, columns=["strategy", "step_time", "measured_at"])


def auto_rows(ds: xr.Dataset, frame: pd.DataFrame, dims: list[str],
              worker_dim: str | None = None) -> pd.DataFrame:
    """Per auto point: `dims` (the other coordinates), ``chosen``, ``auto_s`` (auto's
    measured median step), ``best`` and ``best_s`` (the fastest strategy auto could
    pick, measured as `measured_candidates` finds it: ``best_at`` says where, ``""``
    at the point itself), ``chosen_s`` and ``chosen_at`` (the chosen strategy's own
    fixed point, if measured), ``auto_over_best`` (auto_s / best_s - 1; NaN where
    auto's choice was measured nowhere as a fixed strategy: the best of the others is
    then no fair bar) and ``auto_workers`` ("1 of 2" where auto's placement left
    workers out, else ""). `worker_dim` is the sweep's workers dim, if any."""
    choices = _choices(ds, dims)
    rows = []
    autos = frame[(frame["strategy"] == AUTO) & frame["step_time"].notna()]
    for _, auto in autos.iterrows():
        key = tuple(str(auto[d]) for d in dims)
        same = measured_candidates(frame, dims, key, worker_dim)
        chosen = choices.get(key, "")
        used, offered = auto.get("n_workers"), auto.get("offered_workers")
        row = dict(zip(dims, key), chosen=chosen, auto_s=float(auto["step_time"]),
                   best="", best_s=float("nan"), best_at="", chosen_s=float("nan"),
                   chosen_at="", auto_over_best=float("nan"),
                   # its placement left workers out: the step is of fewer workers
                   auto_workers=f"{used:g} of {offered:g}" if pd.notna(used) and pd.notna(
                       offered) and used < offered else "")
        mine = same[same["strategy"] == chosen]
        if not mine.empty:
            row.update(chosen_s=float(mine.iloc[0]["step_time"]),
                       chosen_at=str(mine.iloc[0]["measured_at"]))
        if not same.empty:
            best = same.loc[same["step_time"].idxmin()]
            row.update(best=str(best["strategy"]), best_s=float(best["step_time"]),
                       best_at=str(best["measured_at"]))
            if not chosen or not mine.empty:  # an unknown choice: as the store has it
                row["auto_over_best"] = row["auto_s"] / row["best_s"] - 1
        rows.append(row)
    return pd.DataFrame(rows)


def auto_section(ds: xr.Dataset, frame: pd.DataFrame, dims: list[str],
                 worker_dim: str | None = None) -> list[str]:
    """report.md's table of auto's choices against the measured best."""
    others = [d for d in dims if d != "strategy"]
    rows = auto_rows(ds, frame, others, worker_dim)
    if rows.empty:
        return []
    header = others + ["auto chose", "auto s/step", "measured best", "best s/step",
                       "auto vs best"]
    table = []
    for _, row in rows.iterrows():
        over = row["auto_over_best"]
        best = row["best"] or "-"
        if row["best_at"]:
            best += f" (at {row['best_at']})"
        if pd.notna(over):
            versus = f"{over:+.0%}"
        elif row["chosen"] and row["best"] and pd.isna(row["chosen_s"]):
            versus = f"- ({row['chosen']} not measured)"
        else:
            versus = "-"
        chose = row["chosen"] or "?"
        if row["auto_workers"]:
            chose += f" (on {row['auto_workers']} workers)"
        table.append([str(row[d]) for d in others] + [
            chose, f"{row['auto_s']:.4f}", best,
            "-" if pd.isna(row["best_s"]) else f"{row['best_s']:.4f}", versus])
    lines = ["## Strategy auto against the measured best", "",
             "Per point, what `strategy: auto` chose (the model's fastest on its probe), "
             "its own measured step, and the fastest of the strategies it chooses among "
             "(not `reference`) measured at the same coordinates. `single` runs on one "
             "worker whatever the cluster, so the sweep measures it at the fewest workers "
             "only: at more workers that point stands for it (it is what auto runs when "
             "it picks `single` there), marked \"at\" where it was measured. Where auto's "
             "choice was not measured as a fixed strategy, no comparison is given. Where "
             "its placement left workers out, \"on 1 of 2 workers\" says so: its step is "
             "then the fewer workers' (kernel on one worker is `single`'s arithmetic, "
             "measured at another moment).", "",
             *markdown_rows(header, table)]
    return lines + [""]
