"""Where a step's time goes: compute, exchange, dataset, wait and client (pure).

A step's wall time (completion to completion, as the client sees it) is split along
one worker's timeline, the *critical* worker: the one whose task accounted for the
most time in that step (its own work plus its waits for peers). Its phases give

- ``compute``: the device's work, the emulated slow-down included (conv shards,
  the replica, the dense head on the master);
- ``exchange``: its workspace reads and writes (the slots other workers read);
- ``dataset``: reading its rows of the batch from the dataset store;
- ``wait``: blocked until a peer's slot was ready (imbalance, a peer's dispatch);
- ``client``: the rest of the step, which no phase of the worker covers: the
  client's and the scheduler's work per step, handing the task to the worker, and
  Python between the worker's ops.

Why the critical worker and not each part's maximum over workers (the summary's
``compute_time`` and ``storage_time`` are those): maxima from different workers do
not add up to the step, and a plot of how cost grows needs parts that do. Where the
accounted phases exceed the wall time (steps in flight overlap a little), the parts
are scaled down to it, so they always add up to the step time exactly.

The model's breakdown (`pipeline.costmodel.Prediction.breakdown`) is mapped onto
the same names by `predicted_parts`: it has no dataset or wait part of its own
(reads wait inside its I/O on the critical path) and its Dask overhead is the
client's part.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

import numpy as np
import xarray as xr

from tasks.receipts import Receipt

#: The parts of a step, in the order plots stack them.
PARTS = ("compute", "exchange", "dataset", "wait", "client")
#: Receipt phase kinds (tasks/receipts.py) behind each part a worker accounts for.
PHASE_PARTS = {"compute": ("compute", "emulated"), "exchange": ("read", "write"),
               "dataset": ("dataset",), "wait": ("wait",)}
#: The record's per-worker variables (pipeline/records.py) behind the same parts.
RECORD_PARTS = {"compute": ("compute_time",), "exchange": ("read_time", "write_time"),
                "dataset": ("dataset_time",), "wait": ("exchange_wait_time",)}
#: The model's critical-path parts (costmodel `Prediction.breakdown`) behind each part.
MODEL_PARTS = {"compute": ("compute_critical", "master"),
               "exchange": ("communication", "storage"), "dataset": (), "wait": (),
               "client": ("overhead",)}


def phase_seconds(receipts: Iterable[Receipt]) -> dict[str, dict[str, float]]:
    """Seconds of each phase kind per worker, summed over the receipts (one step's)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for receipt in receipts:
        for event in receipt.events:
            for phase in event.phases:
                out[receipt.worker][phase.kind] += phase.seconds
    return {worker: dict(kinds) for worker, kinds in out.items()}


def split_step(step_time: float, phases: Mapping[str, Mapping[str, float]]
               ) -> dict[str, float]:
    """The step's parts (`PARTS`, seconds) from its wall time and each worker's phase
    seconds (`phase_seconds`): the critical worker's phases, the rest as ``client``;
    they add up to `step_time`."""
    if not phases:
        return {**{part: 0.0 for part in PARTS}, "client": max(step_time, 0.0)}
    per_worker = [{part: sum(kinds.get(kind, 0.0) for kind in PHASE_PARTS[part])
                   for part in PHASE_PARTS} for kinds in phases.values()]
    return _with_client(step_time, max(per_worker, key=lambda p: sum(p.values())))


def _with_client(step_time: float, accounted: dict[str, float]) -> dict[str, float]:
    total = sum(accounted.values())
    step_time = max(step_time, 0.0)
    scale = step_time / total if total > step_time else 1.0
    parts = {part: seconds * scale for part, seconds in accounted.items()}
    parts["client"] = step_time - sum(parts.values())
    return {part: max(parts[part], 0.0) for part in PARTS}


def record_parts(record: xr.Dataset, warmup_steps: int) -> dict[str, float]:
    """Each part's median over the record's measured steps (after `warmup_steps`), from
    its per-step, per-worker phase times. Medians of parts need not add up to the
    median step exactly; each step's parts do."""
    steps = record.sizes.get("step", 0)
    tail = record.isel(step=slice(warmup_steps, None)) if steps > warmup_steps else record
    if not tail.sizes.get("step", 0):
        return {part: float("nan") for part in PARTS}
    accounted = {part: sum(np.asarray(tail[name].values, dtype=float) for name in names)
                 for part, names in RECORD_PARTS.items()}  # (step, worker) each
    critical = np.argmax(sum(accounted.values()), axis=1)
    rows = [_with_client(float(wall), {part: float(values[s, critical[s]])
                                       for part, values in accounted.items()})
            for s, wall in enumerate(np.asarray(tail.step_time.values, dtype=float))]
    return {part: float(np.median([row[part] for row in rows])) for part in PARTS}


def predicted_parts(breakdown: Mapping[str, object] | None) -> dict[str, float]:
    """The model's critical-path breakdown under the names of `PARTS` (NaN without
    one)."""
    if not breakdown:
        return {part: float("nan") for part in PARTS}
    return {part: float(sum(float(breakdown.get(key, 0.0) or 0.0)  # type: ignore[arg-type]
                            for key in keys))
            for part, keys in MODEL_PARTS.items()}
