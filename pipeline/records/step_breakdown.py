"""Where a step's time goes, its *critical breakdown*: compute, exchange, dataset,
wait and client (pure).

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

Why the critical worker and not each component's maximum over workers (the summary's
``compute_time`` and ``storage_time`` are those): maxima from different workers do
not add up to the step, and a plot of how cost grows needs components that do. Where the
accounted phases exceed the wall time (steps in flight overlap a little), the components
are scaled down to it, so they always add up to the step time exactly.

A run's summary keeps the medians (``critical_breakdown``, and a closing line); sweep
stores keep them per point (``critical_<component>``).

The model's breakdown (`pipeline.costmodel.Prediction.breakdown`) is mapped onto
the same names by `model_breakdown`: it has no dataset component of its own (reads
wait inside its I/O on the critical path), its wait is the client's share of the
cores (``contention``: the step waits for a worker the client displaced), and its
Dask overhead is the client's component.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

import numpy as np
import xarray as xr

from pipeline.records.starts import measured
from tasks.receipts import Receipt

#: The components of a step, in the order plots stack them.
COMPONENTS = ("compute", "exchange", "dataset", "wait", "client")
#: Receipt phase kinds (tasks/receipts.py) behind each component a worker accounts for.
PHASE_COMPONENTS = {"compute": ("compute", "emulated"), "exchange": ("read", "write"),
               "dataset": ("dataset",), "wait": ("wait",)}
#: The record's per-worker variables (pipeline/records/record.py) behind the same components.
RECORD_COMPONENTS = {"compute": ("compute_time",), "exchange": ("read_time", "write_time"),
                "dataset": ("dataset_time",), "wait": ("exchange_wait_time",)}
#: The model's critical-path parts (costmodel `Prediction.breakdown`) behind each one.
MODEL_COMPONENTS = {"compute": ("compute_critical", "master"),
               "exchange": ("communication", "storage"), "dataset": (), "wait": ("contention",),
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
    """The step's components (`COMPONENTS`, seconds) from its wall time and each
    worker's phase seconds (`phase_seconds`): the critical worker's phases, the rest as
    ``client``; they add up to `step_time`."""
    if not phases:
        return {**{name: 0.0 for name in COMPONENTS}, "client": max(step_time, 0.0)}
    per_worker = [{name: sum(kinds.get(kind, 0.0) for kind in PHASE_COMPONENTS[name])
                   for name in PHASE_COMPONENTS} for kinds in phases.values()]
    return _with_client(step_time, max(per_worker, key=lambda p: sum(p.values())))


def _with_client(step_time: float, accounted: dict[str, float]) -> dict[str, float]:
    total = sum(accounted.values())
    step_time = max(step_time, 0.0)
    scale = step_time / total if total > step_time else 1.0
    out = {name: seconds * scale for name, seconds in accounted.items()}
    out["client"] = step_time - sum(out.values())
    return {name: max(out[name], 0.0) for name in COMPONENTS}


def record_breakdown(record: xr.Dataset, warmup_steps: int) -> dict[str, float]:
    """Each component's median over the record's measured steps (after
    each start's first `warmup_steps`: `pipeline.records.starts.measured`), from its
    per-step, per-worker phase times. The medians need not add up to the median step
    exactly; each step's components do."""
    tail = measured(record, warmup_steps)
    if not tail.sizes.get("step", 0):
        return {name: float("nan") for name in COMPONENTS}
    accounted = {name: sum(np.asarray(tail[v].values, dtype=float) for v in variables)
                 for name, variables in RECORD_COMPONENTS.items()}  # (step, worker) each
    critical = np.argmax(sum(accounted.values()), axis=1)
    rows = [_with_client(float(wall), {name: float(values[s, critical[s]])
                                       for name, values in accounted.items()})
            for s, wall in enumerate(np.asarray(tail.step_time.values, dtype=float))]
    return {name: float(np.median([row[name] for row in rows])) for name in COMPONENTS}


def model_breakdown(breakdown: Mapping[str, object] | None) -> dict[str, float]:
    """The model's critical-path breakdown under the names of `COMPONENTS` (NaN without
    one)."""
    if not breakdown:
        return {name: float("nan") for name in COMPONENTS}
    return {name: float(sum(float(breakdown.get(key, 0.0) or 0.0)  # type: ignore[arg-type]
                            for key in keys))
            for name, keys in MODEL_COMPONENTS.items()}


def compute_error(predicted: Mapping[str, object] | None,
                  measured_compute: float | None) -> float | None:
    """The model's compute on the critical path against the run's busiest worker's
    (the summary's ``compute_time_median``: per step the most any worker computed,
    median over the steps): ``predicted / measured - 1``; None without both.

    Why beside the step's error: the model's compute is the probe's timings of the
    same shards replayed, so where the two errors agree, the miss is how fast the
    machine ran the arithmetic now against when it was probed (this project's 2-core
    machines moved by 1.5x within an hour, and a probe is cached for days), not the
    model's exchange, waits or overheads (docs/model.md). Why the busiest worker and
    not the critical breakdown's: the critical worker is the one that accounted for
    the most time, its waits included, and under ``kernel`` that is often a worker
    that waited for the master's dense head, whose compute is the model's (conv and
    head) less the head (vgg11's ``kernel``/2 read +84 % against it, -4 % against the
    busiest)."""
    model = model_breakdown(predicted)["compute"]
    run = float("nan") if measured_compute is None else float(measured_compute)
    if not (np.isfinite(model) and np.isfinite(run)) or model <= 0 or run <= 0:
        return None
    return model / run - 1.0
