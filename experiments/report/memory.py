"""The memory figure: the most memory a worker held, against workers and batch, per
strategy, beside plain PyTorch's (`reference`).

Why its own figure: memory is the other resource that makes devices unequal (the
seed paper names it beside speed), and whether splitting a network shrinks what each
device must hold is a claim of the method, separate from its speed. What is plotted
is each point's fullest worker (`memory_working`: its peak resident memory less a
bare process's, experiments/sweep/store_layout.py), the median over repeats.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.report.figure_files import legend_beside, save_figure  # noqa: E402
from experiments.report.figures import in_one_process  # noqa: E402
from experiments.report.gaps import (mark_missing, place_missing, with_missing,  # noqa: E402
                                    worker_counts)
from experiments.report.view import COLORS, StoreView, slice_of_others  # noqa: E402


def memory_figure(sweep: StoreView, frame: pd.DataFrame, path: str) -> bool:
    """Working memory per worker (the fullest) against workers (their summed relative
    speed, as speedup.png's) and against batch, one line per strategy; `reference`
    dashed, at its threads.
    Drawn where the store has memory figures and a workers or batch axis."""
    if "memory_working" not in frame or frame["memory_working"].isna().all():
        return False
    panels = [(dim, label) for dim, label in ((sweep.worker_dim, "workers"),
                                              (sweep.batch_dim, "batch size")) if dim]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels) + 1.5, 4.4),
                             squeeze=False)
    strategies = list(dict.fromkeys(frame["strategy"]))
    colors = {s: COLORS[i % len(COLORS)] for i, s in enumerate(strategies)}
    for ax, (dim, label) in zip(axes[0], panels):
        keep = ["strategy", dim]
        data, fixed = slice_of_others(sweep, frame, keep)
        data = with_missing(data, "memory_working").copy()
        workers = label == "workers"  # the same dim where the batch is zipped with them
        # the workers the point was given, by summed relative speed (speedup.png's x: an
        # unequal pair at 1.5, reference at its threads), not those a repeat's placement
        # used (a pair's repeats, one leaving a worker out, drew it at their median)
        data["x"] = (pd.to_numeric(data["capacity"], errors="coerce") if workers
                     else sweep.batch_sizes(data))
        data = place_missing(data, "x", dim, worker_counts(sweep.ds, dim))
        for strategy, rows in data.groupby("strategy", sort=False):
            rows = rows.sort_values("x")
            mb = rows["memory_working"] / 1e6
            alone = in_one_process(str(strategy))  # plain PyTorch, no workers
            mark_missing(ax, rows, "x", "black" if alone else colors[strategy])
            if mb.isna().all():
                continue
            ax.plot(rows["x"], mb, marker="o", color="black" if alone else colors[strategy],
                    linestyle="--" if alone else "-",
                    label="reference (plain PyTorch)" if alone else strategy)
        ax.set_xlabel("workers (summed relative speed if unequal; reference: threads)"
                      if workers else sweep.batch_label())
        ax.set_ylabel("working memory of the fullest worker (MB)")
        ax.set_title(f"memory against {label}" + (f" ({fixed})" if fixed else ""),
                     fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    legend_beside(fig, axes[0])
    fig.suptitle(f"{sweep.ds.attrs.get('sweep_name', '')}: memory per worker (peak resident "
                 "less a bare process's, median over repeats)")
    save_figure(fig, path)
    return True
