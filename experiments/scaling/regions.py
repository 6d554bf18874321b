"""Where a strategy wins, as tables: the device count at which kernel (model)
parallelism overtakes data parallelism, and the device counts where the hybrid is
the fastest strategy, per network, batch, device kind (whatever else is swept) and
link bandwidth.

Why tables beside the maps: a map shows a region's shape, a table gives its edge as
a number to quote. Both read the same predicted times and the same rule for ties
(:mod:`experiments.scaling.view`).
"""

from __future__ import annotations

import numpy as np

from experiments.scaling.view import TIE, ScalingView, winners

__all__ = ["first_overtaking", "count_ranges", "crossover_table", "hybrid_region_table",
           "point_table", "POINT_TABLE_MOST"]

#: Grids of at most this many points get a row per point in report.md (a single
#: point, or a few: the maps and region tables may not apply, the numbers still do).
POINT_TABLE_MOST = 64

#: The strategies the crossover compares: the one that overtakes, the one overtaken.
OVERTAKES = ("kernel", "data")
#: The strategy whose winning region the second table gives.
REGION_OF = "hybrid"


def first_overtaking(challenger: np.ndarray, holder: np.ndarray, counts: list[int]) -> str:
    """The fewest devices (two or more: on one, every strategy trains the same step) at
    which `challenger`'s step is shorter than `holder`'s, both predicted (NaN: not);
    "none" where it never is; "-" where they never both are."""
    both = np.isfinite(challenger) & np.isfinite(holder) & (np.asarray(counts) > 1)
    if not both.any():
        return "-"
    faster = both & (challenger < holder * (1 - TIE))
    return str(counts[int(np.argmax(faster))]) if faster.any() else "none"


def count_ranges(counts: list[int], chosen: np.ndarray) -> str:
    """The chosen device counts as runs of neighbours in the grid ("4-256, 4096");
    "none" where none is chosen."""
    runs: list[list[int]] = []
    previous = False
    for count, on in zip(counts, chosen):
        if on and previous:
            runs[-1].append(count)
        elif on:
            runs.append([count])
        previous = bool(on)
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "none"


def _settings_table(view: ScalingView, cell) -> list[str] | None:
    """Markdown rows: one per setting of the dims other than strategy, devices and link
    bandwidth; a column per link bandwidth; `cell(times, strategies, counts)` fills a
    cell from the times of every strategy (strategy x devices)."""
    sdim, xdim, bdim = view.strategy_dim, view.workers_dim, view.bandwidth_dim
    if sdim is None or xdim is None or not view.plain_counts(xdim).all():
        return None
    times = view.times()
    strategies = view.labels(sdim)
    counts = view.device_counts(xdim)
    others = [d for d in view.dims if d not in (sdim, xdim, bdim)]
    links = view.labels(bdim) if bdim else [_label_of(view.base_point(), "hardware.link.gbps")]
    columns = [view.header(d) for d in others] + [f"{link} Gb/s" for link in links]
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join(["---"] * len(others) + ["--:"] * len(links)) + "|"]
    for position in np.ndindex(*(view.ds.sizes[d] for d in others)):
        pick = dict(zip(others, position))
        cells = []
        for li in range(len(links)):
            at = {**pick, bdim: li} if bdim else pick
            cells.append(cell(times.isel(at).transpose(sdim, xdim).values, strategies,
                              counts))
        labels = [view.labels(d)[i] for d, i in zip(others, position)]
        lines.append("| " + " | ".join(labels + cells) + " |")
    return lines


def _label_of(point: dict, field: str) -> str:
    """A field's value in the base point, as an axis labels it ("?" where it has none)."""
    value: object = point
    for key in field.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "?" if value is None else str(value)


def crossover_table(view: ScalingView) -> list[str] | None:
    """Markdown: where kernel overtakes data, or None where the store lacks either."""
    sdim = view.strategy_dim
    if sdim is None or not set(OVERTAKES) <= set(view.labels(sdim)):
        return None

    def cell(t: np.ndarray, strategies: list[str], counts: list[int]) -> str:
        challenger, holder = (t[strategies.index(s)] for s in OVERTAKES)
        return first_overtaking(challenger, holder, counts)

    return _settings_table(view, cell)


def point_table(view: ScalingView) -> list[str] | None:
    """Markdown: every point's prediction (or why it has none), for small grids."""
    ds = view.ds.isel(repeat=0)
    if ds.status.size > POINT_TABLE_MOST:
        return None
    dims = view.dims
    columns = [view.header(d) for d in dims] + [
        "step (s)", "samples/s", "speedup", "efficiency", "peak memory (GB)",
        "no prediction: why"]
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join(["---"] * len(dims) + ["--:"] * 5 + ["---"]) + "|"]
    for position in np.ndindex(*(ds.sizes[d] for d in dims)):
        point = ds.isel(dict(zip(dims, position)))
        figures = [_figure(point[name].item(), scale) for name, scale in (
            ("predicted_step_time", 1), ("throughput", 1), ("speedup", 1),
            ("efficiency", 1), ("peak_memory", 1e-9))]
        labels = [view.labels(d)[i] for d, i in zip(dims, position)]
        why = str(point.failure.item()).replace("|", "/")
        lines.append("| " + " | ".join(labels + figures + [why]) + " |")
    return lines


def _figure(value: float, scale: float) -> str:
    return f"{value * scale:.4g}" if np.isfinite(value) else "-"


def hybrid_region_table(view: ScalingView) -> list[str] | None:
    """Markdown: the device counts where the hybrid is fastest, or None without it."""
    sdim = view.strategy_dim
    if sdim is None or REGION_OF not in view.labels(sdim):
        return None

    def cell(t: np.ndarray, strategies: list[str], counts: list[int]) -> str:
        if not np.isfinite(t[strategies.index(REGION_OF)]).any():
            return "-"  # never feasible here, as the crossover table says it
        return count_ranges(counts, winners(t) == strategies.index(REGION_OF))

    return _settings_table(view, cell)
