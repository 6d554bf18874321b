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


def step_gap_s(runs: Sequence[PlanRun]) -> float | None:
    """Median gap between a worker's consecutive measured steps: a round's measured
    steps run in one task per worker (`PlanEngines.run`), so each gap is one between
    steps inside a task, where `task_gap_s` is the one between tasks (None: no plan
    measured two steps)."""
    gaps = []
    for run in runs:
        by_worker: dict[str, list[Receipt]] = defaultdict(list)
        for receipt in run.receipts:
            by_worker[receipt.worker].append(receipt)
        for receipts in by_worker.values():
            ordered = sorted(receipts, key=lambda r: r.step)
            gaps += [b.start - a.end for a, b in zip(ordered, ordered[1:])
                     if b.step == a.step + 1]
    return max(float(np.median(gaps)), 0.0) if gaps else None


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
