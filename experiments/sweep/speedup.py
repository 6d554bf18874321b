"""Speedup and efficiency: one baseline per grid, at the same other coordinates.

A measured sweep's `speedup` divides the baseline's step time by each point's; its
`efficiency` divides that by the capacity the point was given relative to the
baseline's. `speedup_reference` says where the baseline lies in a sweep's grid
(it is stored in the store's attrs when the template is written), and
`compute_speedup` derives both figures over the whole grid from what is done
(`ResultStore.refresh_derived` calls it after every point).

Why recomputed over the grid rather than per point: a baseline point may finish
after the points it is the baseline of, and repeats of the baseline move its
median, so every point's figures depend on the whole grid.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from experiments.sweep.config import Sweep
from experiments.sweep.points import fewest_workers

#: Fields that may move with `cluster.workers` while speedup still compares the same
#: work: the cluster's own (how the workers are given) and the batch (speedup counts
#: samples a second, so a batch that grows with the workers is weak scaling).
SAME_WORK_PREFIXES = ("cluster.", "train.batch")


def speedup_caveat(sweep: Sweep) -> str | None:
    """One line where the workers' axis is zipped with a field that changes the work
    itself (a network's kernels, the dataset, the steps): speedup and efficiency then
    divide step times of different work, which nothing else in the store says."""
    workers = sweep.axis_with_field("cluster.workers")
    if workers is None:
        return None
    others = [field for field in workers.fields if not field.startswith(SAME_WORK_PREFIXES)]
    if not others:
        return None
    return (f"warning: {', '.join(others)} change(s) with cluster.workers ({workers.where}): "
            "speedup and efficiency compare steps of different work, not the same work "
            "on more workers")


def missing_baseline_note(sweep: Sweep) -> str | None:
    """One line where the sweep's strategy axis lacks the speedup's baseline strategy:
    the store's `speedup` and `efficiency` will then be empty, which the report says,
    but the sweep did not."""
    reference = speedup_reference(sweep)
    if reference["available"] or reference["dim"] is None:  # no strategy axis: no speedup
        return None  # is asked of it (a grid of one strategy over batch, say)
    return (f"note: no speedup or efficiency: speedup_baseline is "
            f"{sweep.config.speedup_baseline}, which no point runs (set speedup_baseline "
            "to a strategy the sweep runs, or add it to the strategies)")


def speedup_reference(sweep: Sweep) -> dict[str, Any]:
    """Where the baseline of `speedup` lies: the baseline strategy's position along the
    strategy dim, and the fewest workers' position along the workers dim (if any)."""
    baseline = sweep.config.speedup_baseline
    axis = sweep.axis_with_field("strategy")
    workers = sweep.axis_with_field("cluster.workers")
    fewest: dict[str, Any] = {"workers_dim": None, "workers_index": None}
    if workers is not None:
        fewest = {"workers_dim": workers.dim, "workers_index": fewest_workers(workers)}
    if axis is None:
        base_strategy = sweep.base.get("strategy", "kernel")
        return {"strategy": baseline, "dim": None, "index": None,
                "available": base_strategy == baseline, **fewest}
    positions = [i for i in range(len(axis)) if axis.value_of(i, "strategy") == baseline]
    return {"strategy": baseline, "dim": axis.dim,
            "index": positions[0] if positions else None, "available": bool(positions),
            **fewest}


def compute_speedup(step_time: np.ndarray, capacity: np.ndarray, axis: int | None,
                    index: int | None, available: bool, workers_axis: int | None = None,
                    workers_index: int | None = None, batch: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Speedup and efficiency against one baseline per grid, at the same other coordinates.

    `step_time`, `capacity` and `batch` (each point's samples per step; None: the
    same everywhere) have the axes then the repeat last. The baseline is position
    `index` along `axis` (the strategy's dim) and position `workers_index` along
    `workers_axis` (the fewest workers), reduced to its median over repeats, so each
    repeat of a point is compared with one stable baseline. With no strategy dim the
    whole grid is the baseline strategy (if `available`). Speedup is the samples a
    second against the baseline's: at the same batch, its step time over the point's;
    where the batch moves with the workers (weak scaling, a zip group), a step of
    twice the samples in the baseline's time is a speedup of 2, not 1.
    """
    nan = np.full(step_time.shape, np.nan)
    if not available:
        return nan, nan.copy()
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        work = np.ones(step_time.shape) if batch is None else batch
        picked_time, picked_capacity, picked_work = step_time, capacity, work
        for along, position in ((axis, index), (workers_axis, workers_index)):
            if along is not None and position is not None:
                picked_time = np.take(picked_time, [position], axis=along)
                picked_capacity = np.take(picked_capacity, [position], axis=along)
                picked_work = np.take(picked_work, [position], axis=along)
        base_time = np.nanmedian(picked_time, axis=-1, keepdims=True)
        base_capacity = np.nanmedian(picked_capacity, axis=-1, keepdims=True)
        base_work = np.nanmedian(picked_work, axis=-1, keepdims=True)
        speedup = base_time / step_time * (work / base_work)
        efficiency = speedup / (capacity / base_capacity)
    return speedup, efficiency
