"""A sweep over link rates in the report: step time against rate, measured and
predicted, and which strategy wins at each rate.

Present where the sweep varies `cluster.link.rate` (workers behind shaped links,
pipeline/cluster/links.py). `link_winners` is the pure part: per rate (and per value of
every other dim), the strategy with the shortest measured step and the one the
model predicts shortest, so the report can say where the winner flips and whether
the model flips at the same rate. `link_figure` draws the curves; `links_section`
writes the table.

Why its own module: the figure, the winners and their table read the same rate
axis, and none of the other report modules knows what a link is.
"""

from __future__ import annotations

import matplotlib
matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.report.figure_files import save_figure  # noqa: E402
from experiments.report.view import COLORS, StoreView  # noqa: E402
from experiments.sweep.summary import markdown_rows  # noqa: E402
from pipeline.cluster.links import rate_bits  # noqa: E402

RATE_FIELD = "cluster.link.rate"


def link_dim(sweep: StoreView) -> str | None:
    """The dim that sweeps the link rate, if any."""
    return sweep.dim_with(RATE_FIELD)


def _with_bits(frame: pd.DataFrame, dim: str) -> pd.DataFrame:
    data = frame.copy()
    data["rate_bits"] = [rate_bits(str(v)) for v in data[dim]]
    return data


def link_winners(frame: pd.DataFrame, dim: str, others: list[str]) -> pd.DataFrame:
    """Per rate and value of `others`: the measured and the predicted winner.

    Columns: the `others`, `rate`, `rate_bits`, `measured_winner`,
    `predicted_winner` (a strategy name, "" where no strategy has a figure),
    `agree`, `worst_error` (the largest |prediction_error| among the strategies
    at that rate) and `measured_margin` (the measured runner-up's step over the
    winner's, less 1; NaN with fewer than two figures): a disagreement where the
    margin is below the errors says the model cannot tell the two apart there, not
    that it picks wrong. Rows go from the fastest rate to the slowest.
    """
    data = _with_bits(frame, dim)
    rows = []
    for keys, group in data.groupby(others + [dim], sort=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        measured = group.dropna(subset=["step_time"])
        predicted = group.dropna(subset=["predicted_step_time"])
        row = dict(zip(others + ["rate"], keys))
        row["rate_bits"] = float(group["rate_bits"].iloc[0])
        # a strategy not measured at this rate (pending, failed) leaves no winner: the
        # fastest of the others would read as one
        row["not_measured"] = ", ".join(sorted(set(group["strategy"].astype(str))
                                               - set(measured["strategy"].astype(str))))
        row["measured_winner"] = (str(measured.loc[measured["step_time"].idxmin(), "strategy"])
                                  if not measured.empty and not row["not_measured"] else "")
        row["predicted_winner"] = (
            str(predicted.loc[predicted["predicted_step_time"].idxmin(), "strategy"])
            if not predicted.empty else "")
        row["agree"] = bool(row["measured_winner"]) and \
            row["measured_winner"] == row["predicted_winner"]
        times = sorted(measured["step_time"])
        row["measured_margin"] = times[1] / times[0] - 1 if len(times) > 1 else float("nan")
        errors = (group["predicted_step_time"] / group["step_time"] - 1).abs().dropna()
        row["worst_error"] = float(errors.max()) if not errors.empty else float("nan")
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    return table.sort_values(others + ["rate_bits"], ascending=[True] * len(others) + [False],
                             kind="stable").reset_index(drop=True)


def flips(winners: pd.DataFrame, column: str) -> list[tuple[str, str, str, str]]:
    """Where `column`'s winner changes between neighbouring rates (fast to slow) of
    one row group: ``(faster rate, its winner, slower rate, its winner)``."""
    out = []
    previous = None
    for _, row in winners.iterrows():
        if previous is not None and row[column] and previous[column] and \
                row[column] != previous[column]:
            out.append((str(previous["rate"]), previous[column], str(row["rate"]), row[column]))
        previous = row
    return out


def _other_dims(sweep: StoreView, dim: str) -> list[str]:
    return [d for d in sweep.dims if d not in ("strategy", dim)]


def link_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Step time against link rate: measured (solid) and predicted (dashed) per
    strategy, one panel per value of the other dims (workers, network)."""
    dim = link_dim(sweep)
    if dim is None:
        return False
    data = _with_bits(frame[frame["step_time"].notna()], dim)
    if data.empty:
        return False
    others = _other_dims(sweep, dim)
    panels = list(data.groupby(others, sort=False)) if others else [((), data)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (keys, panel) in zip(axes[0], panels):
        keys = keys if isinstance(keys, tuple) else (keys,)
        for index, (strategy, lines) in enumerate(panel.groupby("strategy", sort=False)):
            lines = lines.sort_values("rate_bits")
            color = COLORS[index % len(COLORS)]
            ax.plot(lines["rate_bits"], lines["step_time"], marker="o", color=color,
                    label=f"{strategy} measured")
            if lines["predicted_step_time"].notna().any():
                ax.plot(lines["rate_bits"], lines["predicted_step_time"], linestyle="--",
                        marker="x", color=color, label=f"{strategy} predicted")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (bit/s, each worker's link, both ways)")
        ax.set_ylabel("step time (s, median)")
        ax.set_title(", ".join(f"{d} {k}" for d, k in zip(others, keys)) or "all points")
        ax.grid(alpha=0.3, which="both")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("step time against link rate")
    save_figure(fig, path)
    return True


def links_section(sweep: StoreView, frame: pd.DataFrame) -> list[str]:
    """report.md's table of winners per rate, and the flips measured and predicted."""
    dim = link_dim(sweep)
    if dim is None or frame["step_time"].isna().all():
        return []
    others = _other_dims(sweep, dim)
    winners = link_winners(frame, dim, others)
    columns = others + ["rate", "measured winner", "by", "predicted winner", "worst error"]
    table = []
    for _, row in winners.iterrows():
        error = f"{row['worst_error']:.0%}" if np.isfinite(row["worst_error"]) else "-"
        margin = f"{row['measured_margin']:.0%}" if np.isfinite(row["measured_margin"]) else "-"
        winner = row["measured_winner"] or (f"- ({row['not_measured']} not measured)"
                                            if row["not_measured"] else "-")
        table.append([str(row[d]) for d in others] + [
            str(row["rate"]), winner, margin,
            row["predicted_winner"] or "-", error])
    lines = ["## Link rate: which strategy wins", "",
             "Per rate, the strategy with the shortest measured step, by how much the "
             "runner-up's step is longer, and the one the model predicts shortest; the "
             "worst error is the largest |predicted / measured - 1| among the strategies "
             "at that rate. Where the margin is below the errors, a flip measured and "
             "predicted at different rates is within the model's error.", "",
             *markdown_rows(columns, table)]
    lines.append("")
    groups = list(winners.groupby(others, sort=False)) if others else [((), winners)]
    for keys, group in groups:
        keys = keys if isinstance(keys, tuple) else (keys,)
        where = ", ".join(f"{d} {k}" for d, k in zip(others, keys)) or "all points"
        for column, name in (("measured_winner", "measured"), ("predicted_winner", "predicted")):
            found = flips(group, column)
            text = "; ".join(f"{a} at {ra} -> {b} at {rb}" for ra, a, rb, b in found) or \
                "no flip"
            unknown = [str(r) for r, w in zip(group["rate"], group[column]) if not w]
            if unknown:  # a flip may lie at a rate with no winner
                text += f" (no winner at {', '.join(unknown)}: not every strategy measured)"
            lines.append(f"- {where}, {name}: {text}")
    return lines + [""]
