"""``strategy: auto`` in the report: did the model pick the measured best?

Where a sweep measures ``auto`` next to fixed strategies, `auto_rows` lines up,
per point (every other coordinate fixed), what auto chose, auto's own measured
step, and the fastest fixed strategy measured at the same coordinates;
`auto_section` writes them as a report.md table. Pure functions of the store.

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
    if "strategy_choice" not in ds or AUTO not in [str(s) for s in ds.strategy.values]:
        return {}
    texts = ds.strategy_choice.sel(strategy=AUTO).to_dataframe().reset_index()
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


def auto_rows(ds: xr.Dataset, frame: pd.DataFrame, dims: list[str]) -> pd.DataFrame:
    """Per auto point: `dims` (the other coordinates), ``chosen``, ``auto_s`` (auto's
    measured median step), ``best`` and ``best_s`` (the fastest fixed strategy
    measured there), ``chosen_s`` (the chosen strategy's own fixed point, if
    measured) and ``auto_over_best`` (auto_s / best_s - 1)."""
    choices = _choices(ds, dims)
    rows = []
    autos = frame[(frame["strategy"] == AUTO) & frame["step_time"].notna()]
    for _, auto in autos.iterrows():
        key = tuple(str(auto[d]) for d in dims)
        same = frame[frame["strategy"].map(_candidate) & frame["step_time"].notna()]
        for dim, value in zip(dims, key):
            same = same[same[dim].astype(str) == value]
        chosen = choices.get(key, "")
        row = dict(zip(dims, key), chosen=chosen, auto_s=float(auto["step_time"]),
                   best="", best_s=float("nan"), chosen_s=float("nan"),
                   auto_over_best=float("nan"))
        if not same.empty:
            best = same.loc[same["step_time"].idxmin()]
            row.update(best=str(best["strategy"]), best_s=float(best["step_time"]),
                       auto_over_best=row["auto_s"] / float(best["step_time"]) - 1)
            mine = same[same["strategy"] == chosen]["step_time"]
            if not mine.empty:
                row["chosen_s"] = float(mine.iloc[0])
        rows.append(row)
    return pd.DataFrame(rows)


def auto_section(ds: xr.Dataset, frame: pd.DataFrame, dims: list[str]) -> list[str]:
    """report.md's table of auto's choices against the measured best."""
    rows = auto_rows(ds, frame, [d for d in dims if d != "strategy"])
    if rows.empty:
        return []
    others = [d for d in dims if d != "strategy"]
    header = others + ["auto chose", "auto s/step", "measured best", "best s/step",
                       "auto vs best"]
    table = []
    for _, row in rows.iterrows():
        over = row["auto_over_best"]
        table.append([str(row[d]) for d in others] + [
            row["chosen"] or "?", f"{row['auto_s']:.4f}", row["best"] or "-",
            "-" if pd.isna(row["best_s"]) else f"{row['best_s']:.4f}",
            "-" if pd.isna(over) else f"{over:+.0%}"])
    lines = ["## Strategy auto against the measured best", "",
             "Per point, what `strategy: auto` chose (the model's fastest on its probe), "
             "its own measured step, and the fastest of the strategies it chooses among "
             "(not `reference`) measured at the same coordinates.", "",
             *markdown_rows(header, table)]
    return lines + [""]
