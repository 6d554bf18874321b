"""Reading calibration runs' receipts: the engine's orchestration costs.

The gap between a worker's step tasks and between its steps inside one task, how
long a waiting reader takes to notice a slot's ready marker, and the look at the
marker of a slot written before its reader came (`DaskProbe`'s figures; the compute
and workspace constants are read in pipeline/probe/readings.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np

from pipeline.probe.runs import PlanRun
from tasks.receipts import Phase, Receipt


def task_gap_s(runs: Sequence[PlanRun]) -> float:
    """Median gap between a worker's step task and its next, already queued one (each
    round's last warm-up task and its measured task: `PlanRun.task_gaps`)."""
    gaps = [gap for run in runs for gap in run.task_gaps]
    return max(float(np.median(gaps)), 0.0) if gaps else 0.0


def _measured_tasks(runs: Sequence[PlanRun]) -> list[list[Receipt]]:
    """Each run's measured steps per worker, in step order: a round's measured steps
    run in one task per worker (`PlanEngines.run`)."""
    tasks = []
    for run in runs:
        by_worker: dict[str, list[Receipt]] = defaultdict(list)
        for receipt in run.receipts:
            by_worker[receipt.worker].append(receipt)
        tasks += [sorted(receipts, key=lambda r: r.step) for receipts in by_worker.values()]
    return tasks


def step_gap_s(runs: Sequence[PlanRun]) -> float | None:
    """Median gap between a worker's consecutive measured steps: each gap is one between
    steps inside a task, where `task_gap_s` is the one between tasks (None: no plan
    measured two steps)."""
    gaps = [b.start - a.end for task in _measured_tasks(runs) for a, b in zip(task, task[1:])
            if b.step == a.step + 1]
    return max(float(np.median(gaps)), 0.0) if gaps else None


def task_start_s(runs: Sequence[PlanRun]) -> float | None:
    """Median of what the step that opens a task takes over the task's later steps: per
    run and worker, the measured task's first step less the median of its others
    (None: no plan measured two steps). The Dask work at a task's start (the last
    task's result taken in and reported, the next one taken up, on the worker's side
    and, where the workers fill the cores, the client's) slows that first step: 11 ms
    a task in the small network's runs on 2 workers of the AMD EPYC (docs/model.md)."""
    excess = [(task[0].end - task[0].start)
              - float(np.median([r.end - r.start for r in task[1:]]))
              for task in _measured_tasks(runs) if len(task) >= 2]
    return float(np.median(excess)) if excess else None


def _waits_for_writes(runs: Sequence[PlanRun]) -> list[tuple[Phase, float]]:
    """Every wait phase for a slot written in the same step, with that write's end."""
    found = []
    for run in runs:
        written = {(r.step, p.slot): p.end for r in run.receipts for e in r.events
                   for p in e.phases if p.kind == "write"}
        found += [(p, written[(r.step, p.slot)]) for r in run.receipts for e in r.events
                  for p in e.phases if p.kind == "wait" and (r.step, p.slot) in written]
    return found


def check_s(runs: Sequence[PlanRun]) -> float | None:
    """Median look at the marker of a slot written before its reader came (a wait
    phase that began after the slot's write ended): what every read of a written slot
    pays, where `sync_s` is what a waiting reader pays; None where no read found its
    slot written."""
    looks = [p.end - p.start for p, end in _waits_for_writes(runs) if end <= p.start]
    return float(np.median(looks)) if looks else None


def sync_s(runs: Sequence[PlanRun]) -> float:
    """Median delay from a slot's write to a reader that was waiting for it noticing."""
    lags = [p.end - end for p, end in _waits_for_writes(runs) if p.start < end < p.end]
    return float(np.median(lags)) if lags else 0.0
