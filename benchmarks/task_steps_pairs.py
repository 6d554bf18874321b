"""Benchmark figures: what several steps per Dask task gain, pair by pair.

Reads a sweep store with a ``steps_per_task`` dim holding ``1`` and ``auto`` (made by
experiments/configs/task_steps.yaml, whose two settings of a strategy run one after
the other in every repeat) and prints, per strategy, the median over repeats of each
repeat's ratio auto / a task per step, with its spread, for the step time, the
critical path's wait and the client's CPU per step. Prints figures; not a test.

    CNN_PREDICT_PROBE=never python -m experiments.sweep experiments/configs/task_steps.yaml
    python -m benchmarks.task_steps_pairs results/task_steps.zarr
"""

from __future__ import annotations

import argparse
from statistics import median

import numpy as np
import xarray as xr

FIGURES = {"step_time": "step time", "critical_wait": "critical wait",
           "client_cpu_per_step": "client CPU per step"}


def pair_ratios(store: xr.Dataset, variable: str, strategy: str) -> list[float]:
    """Each repeat's auto / one-step-per-task ratio of `variable` (finite pairs only)."""
    point = store[variable].sel(strategy=strategy)
    auto = point.sel(steps_per_task="auto").values.astype(float)
    one = point.sel(steps_per_task="1").values.astype(float)
    return [a / b for a, b in zip(auto, one) if np.isfinite(a) and np.isfinite(b) and b > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store", help="the sweep's results (a .zarr directory)")
    store = xr.open_zarr(parser.parse_args().store)
    for strategy in store.strategy.values:
        one = store.step_time.sel(strategy=strategy, steps_per_task="1").values
        auto = store.step_time.sel(strategy=strategy, steps_per_task="auto").values
        print(f"{strategy}: step time, a task per step {np.nanmedian(one):.4f} s, auto "
              f"{np.nanmedian(auto):.4f} s (medians of {one.size} repeats)")
        for variable, label in FIGURES.items():
            ratios = pair_ratios(store, variable, str(strategy))
            if ratios:
                print(f"  {label:20s} auto / a task per step: {median(ratios):.3f} "
                      f"(spread {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs)")


if __name__ == "__main__":
    main()
