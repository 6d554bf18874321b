"""The breakdown figure: where a step's time goes, per strategy and worker set.

Stacked bars of a step's parts (`breakdown_parts`: along each step's critical
worker, pipeline/records/step_breakdown.py, where the store has them), each part
its own median over the measured steps, and beside them a bar of the median step
measured: the parts' medians need not add up to it, and the figure says so.

Why its own module: the stacked parts and what they may be read as (which store
has which parts, what they add up to) are this figure's alone.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.report.figure_files import save_figure  # noqa: E402
from experiments.report.gaps import with_missing  # noqa: E402
from experiments.report.growth import COMPONENT_COLORS  # noqa: E402
from experiments.report.view import StoreView, slice_of_others  # noqa: E402
from pipeline.records.step_breakdown import COMPONENTS  # noqa: E402

#: A store's per-step figures of the busiest worker (stores before `CRITICAL`).
BREAKDOWN = [("compute_time", "compute", "#4c72b0"), ("storage_time", "exchange", "#dd8452"),
             ("master_time", "master", "#55a868"), ("wait_time", "wait", "#c44e52")]
#: The step's parts along its critical worker (pipeline/records/step_breakdown.py).
CRITICAL = [(f"critical_{part}", part, COMPONENT_COLORS[part]) for part in COMPONENTS]
#: The legend entry of the measured step's bar in `breakdown_figure`.
STEP_BAR = "measured step (median)"


def breakdown_parts(frame: pd.DataFrame) -> list[tuple[str, str, str]]:
    """The stacked parts of `breakdown_figure`: (column, label, colour). The step's
    parts along each step's critical worker (`CRITICAL`: per step they add up to its
    wall time) where the store has them; else, in a store written before them, the
    busiest worker's compute (the dense head included), exchange and wait (`BREAKDOWN`
    less the dense head, which compute already holds)."""
    if "critical_compute" in frame and frame["critical_compute"].notna().any():
        return CRITICAL
    return [part for part in BREAKDOWN if part[0] != "master_time"]


def breakdown_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Stacked per-step parts (`breakdown_parts`) per strategy and workers, each its
    median over the measured steps, and beside them the median step measured: the
    parts' medians need not add up to it, and the figure says so."""
    keep = [d for d in ("strategy", sweep.worker_dim) if d]
    data, fixed = slice_of_others(sweep, frame, keep)
    data = with_missing(data, "step_time")
    if data["step_time"].isna().all():
        return False
    labels = [" / ".join(str(row[d]) for d in keep) or "all" for _, row in data.iterrows()]
    fig, ax = plt.subplots(figsize=(max(5.5, 1.1 * len(data) + 2), 4.9))
    x = np.arange(len(data))
    bottom = np.zeros(len(data))
    parts = breakdown_parts(data)
    for name, label, color in parts:
        values = np.nan_to_num(data[name].to_numpy(dtype=float))
        ax.bar(x - 0.18, values, bottom=bottom, color=color, label=label, width=0.36)
        bottom += values
    ax.bar(x + 0.2, np.nan_to_num(data["step_time"].to_numpy(dtype=float)), width=0.3,
           color="0.85", edgecolor="black", hatch="//", label=STEP_BAR)
    for position, state in zip(x, data["missing"]):  # a point with no bar says why
        if state:
            ax.text(position, 0, f" {state}", rotation=90, ha="center", va="bottom",
                    fontsize=9, color="#c44e52")
    ax.set_xticks(x, labels, rotation=30 if len(data) > 4 else 0, ha="right" if len(data) > 4
                  else "center")
    ax.set_ylabel("seconds per step (medians over measured steps)")
    ax.set_xlabel(" / ".join(keep))
    ax.set_title("where a step's time goes" + (f" ({fixed})" if fixed else ""))
    where = ("along each step's critical worker" if parts is CRITICAL
             else "the busiest worker's (compute includes the dense head)")
    fig.text(0.01, -0.02, f"Each part is its own median over the measured steps, {where}; "
             "the medians need not add up to the median step, drawn beside (hatched).",
             fontsize=8, ha="left", va="top", wrap=True)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)
    return True
