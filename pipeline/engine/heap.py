"""The process that drives the steps (a run's client, the probe's) keeps the garbage
collector's full collections off its steps: `heap_frozen` around the step loop."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

from tasks.worker_state import freeze_heap


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """The objects alive when the steps start (torch's, Dask's, xarray's, the run's
    set-up) kept out of the garbage collector's full collections while they run
    (`gc.freeze`), and handed back to it after (`gc.unfreeze`: a sweep's process runs
    many runs, and what they leave must stay collectable).

    A full collection walks every object in the process: in a run's client, about
    340,000, 0.18 s here, inside whichever step's collect triggered it (the small
    network on 2 workers, 400 steps: one step took 0.25 s against a median of 0.022,
    and the mean step was 5-8 % longer than with the heap frozen;
    docs/measurements/prediction-error-2026-12-01-amd-heap-frozen.txt). Frozen, a
    collection walks only what the steps make. As a worker's heap (`freeze_heap`),
    only the young generations are collected first (cheap): the old ones' garbage
    waits for the first full collection after."""
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()
