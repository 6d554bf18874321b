"""Calibration runs: the engine's own steps, timed at chosen shard sizes.

A synthetic timing loop underestimates what a shard costs inside training (fresh
allocations, other workers' traffic, the denormals of real data), so the probe
runs the engine itself, through the training loop, for a few steps per *plan*
(how many kernels of each layer each worker holds, worker 0 the master) and reads
every constant the model needs from the receipts: per worker and layer the
forward, backward and input-gradient seconds at each kernel count; per workspace
access its seconds and bytes; the dense head; the dataset read; the gap between a
worker's queued step tasks; and how long a waiting reader takes to notice a
slot's ready marker.

Plans: the even split over the first ``P`` workers for ``P = 1..n`` (what
``single`` and ``kernel`` run), plus, where a step is cheap, splits where one
worker holds three quarters or all but one quantum of each layer (and the same
turned round), so that the shard tables span the counts another split may use.
Every plan covers each layer: a layer's input is every shard's output.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
import uuid
from collections import defaultdict
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.checkpointing import prepare_checkpoints
from pipeline.cluster import ClusterWorker, all_local
from pipeline.config import (ConvLayerConfig, DataConfig, NetworkConfig, RunConfig, TrainConfig,
                             WorkspaceConfig)
from pipeline.loop import train_loop
from pipeline.placement import Placement, rough_seconds, split_even
from pipeline.records import RunRecorder
from pipeline.engine import RunPlan, StepEngine
from storage.datasets import open_dataset_info
from tasks.kernel_ops import KERNEL_SIDE
from tasks.layout import CONV_BACKWARD, CONV_FORWARD, DENSE_HEAD, layout_from_counts
from tasks.receipts import OpEvent, Receipt
from tasks.specs import Arithmetic, NetworkSpec
from tasks.worker_state import configure_process

@dataclasses.dataclass
class ProbePlan:
    """Kernels per layer (rows) and worker (columns) of one calibration run."""

    counts: list[list[int]]

    @property
    def workers(self) -> int:
        return len(self.counts[0])


def plan_steps(seconds: float) -> tuple[int, int]:
    """Steps to run a plan for and how many of them are warm-up: the first steps of a
    run are slower (allocations settle), so cheap plans get two warm-ups and three
    measured steps; a plan of seconds per step, one warm-up and one or two."""
    if seconds < 1.0:
        return 5, 2
    return (3, 1) if seconds < 6.0 else (2, 1)


@dataclasses.dataclass
class PlanRun:
    """One plan's receipts (warm-up steps excluded) and the workers it ran on."""

    plan: ProbePlan
    workers: list[str]
    receipts: list[Receipt]


def plan_seconds(network: NetworkSpec, batch: int, plan: ProbePlan) -> float:
    """Rough seconds of one step of ``plan`` (its slowest worker)."""
    return max(sum(rough_seconds(layer, batch, row[w])
                   for layer, row in zip(network.conv, plan.counts))
               for w in range(plan.workers))


def plans_for(network: NetworkSpec, batch: int, quanta: Sequence[int], n: int,
              budget_s: float = 1.0) -> list[ProbePlan]:
    """Even splits over 1..n workers, then tilted splits if a step is cheap."""
    plans = []
    for p in range(1, n + 1):
        if all(math.ceil(layer.kernels / q) >= p for layer, q in zip(network.conv, quanta)):
            plans.append(ProbePlan([split_even(layer.kernels, p, q)
                               for layer, q in zip(network.conv, quanta)]))
    if n >= 2:  # one worker holds most of each layer: where uneven splits land
        for fraction in (0.75, 1.0):
            tilted = _tilted(network, quanta, n, fraction)
            for rotation in range(min(n, 2)) if tilted else ():
                plan = ProbePlan([row[-rotation:] + row[:-rotation] if rotation else row
                             for row in tilted])
                if plan_seconds(network, batch, plan) < budget_s and plan not in plans:
                    plans.append(plan)
    for plan in plans:
        assert all(sum(row) == layer.kernels for row, layer in zip(plan.counts, network.conv))
    return plans


def _tilted(network: NetworkSpec, quanta: Sequence[int], n: int, fraction: float
            ) -> list[list[int]]:
    """Counts where the first worker holds ``fraction`` of each layer's quanta (at most
    all but one per other worker) and the others share the rest; [] if impossible."""
    rows = []
    for layer, q in zip(network.conv, quanta):
        units = layer.kernels // q
        big = min(max(1, int(fraction * units)), units - (n - 1))
        rest = units - big
        if big < 1 or rest < n - 1:
            return []
        rows.append([big * q] + [max(1, rest // (n - 1)) * q] * (n - 1))
        rows[-1][-1] += layer.kernels - sum(rows[-1])  # the remainder to the last
    return rows


def probe_config(network: NetworkSpec, batch: int, dataset: str, output: str, steps: int,
                 workspace: str | None = None, quantum: int = 1) -> RunConfig:
    """A run config for calibration runs of ``network`` (weights from a fresh seed).

    `quantum` chunks the (throwaway) checkpoint: every plan's shards must own whole
    chunks of it.
    """
    conv = [ConvLayerConfig(layer.kernels, layer.kernel_size, layer.padding, layer.pool)
            for layer in network.conv]
    return RunConfig(
        name=f"probe-{uuid.uuid4().hex[:6]}", strategy="kernel", placement="even",
        network=NetworkConfig(conv, list(network.hidden), network.classes, network.dtype),
        data=DataConfig(path=dataset),
        train=TrainConfig(steps=steps, batch=batch, lr=1e-3, warmup_steps=1, eval_samples=0),
        workspace=WorkspaceConfig(path=workspace, channel_quantum=quantum), output=output,
        progress=False)


def run_plans(client: Any, offered: Sequence[ClusterWorker], network: NetworkSpec, batch: int,
              dataset: str, plans: Sequence[ProbePlan], workspace_dir: str | None = None,
              output_root: str | None = None) -> list[PlanRun]:
    """Train every plan for a few steps (the first warm-up) through the training loop;
    their checkpoints go under `output_root` (default: see `_output_root`)."""
    base = tempfile.mkdtemp(prefix="probe-", dir=output_root or _output_root(offered))
    samples = open_dataset_info(dataset).train_samples
    threads = torch.get_num_threads()
    configure_process(1)  # as run_training: the client must not fight the workers
    quantum = math.gcd(*(k for plan in plans for row in plan.counts for k in row))
    runs = []
    try:
        for plan in plans:
            steps, warmup = plan_steps(plan_seconds(network, batch, plan))
            config = probe_config(network, batch, dataset, base, steps, workspace_dir, quantum)
            prepare_checkpoints(config, network)
            workers = list(offered[:plan.workers])
            layout = layout_from_counts([w.name for w in workers], plan.counts, master=0)
            run_plan = RunPlan(workers, layout, Placement("even", plan.counts), KERNEL_SIDE,
                               Arithmetic(config.optimizer_spec()))
            engine = StepEngine(client, config, network, run_plan, samples)
            recorder = RunRecorder([w.name for w in workers], [w.label for w in workers],
                                   [w.emulated_speed for w in workers])
            try:
                engine.start(0)
                train_loop(config, engine, recorder, [], 0, samples)
            finally:
                engine.close()
            runs.append(PlanRun(plan, [w.name for w in workers],
                                [r for r in recorder.receipts if r.step >= warmup]))
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(base, ignore_errors=True)
    return runs


def _output_root(offered: Sequence[ClusterWorker]) -> str | None:
    """Where the probe's checkpoint goes: a temporary directory if every worker is local."""
    if all_local(list(offered)):
        return None
    root = os.path.join(os.getcwd(), "runs")
    os.makedirs(root, exist_ok=True)
    return root


# Reading the receipts ------------------------------------------------------------------


def _busy(event: OpEvent) -> float:
    return sum(p.seconds for p in event.phases if p.kind in ("compute", "emulated"))


def _first_part(event: OpEvent) -> float:
    """A backward's compute before its last compute phase (the input-gradient part)."""
    computes = [i for i, p in enumerate(event.phases) if p.kind == "compute"]
    cut = computes[-1] if computes else len(event.phases)
    return sum(p.seconds for p in event.phases[:cut] if p.kind in ("compute", "emulated"))


def shard_timings(runs: Sequence[PlanRun]) -> dict[str, list[tuple[int, int, int, float, float,
                                                                   float]]]:
    """Per worker: ``(layer, kernels, active, forward_s, backward_s, input_grad_s)`` medians."""
    cells: dict[tuple[str, int, int, int], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list))
    for run in runs:
        for receipt in run.receipts:
            column = run.workers.index(receipt.worker)
            for event in receipt.events:
                if event.name not in (CONV_FORWARD, CONV_BACKWARD):
                    continue
                k = run.plan.counts[event.layer][column]
                cell = cells[(receipt.worker, event.layer, k, len(run.workers))]
                cell[event.name].append(_busy(event))
                if event.name == CONV_BACKWARD:
                    cell["input"].append(_first_part(event))
    out: dict[str, list[tuple[int, int, int, float, float, float]]] = {}
    for (worker, layer, k, active), cell in sorted(cells.items()):
        if cell[CONV_FORWARD] and cell[CONV_BACKWARD]:
            out.setdefault(worker, []).append((
                layer, k, active, float(np.median(cell[CONV_FORWARD])),
                float(np.median(cell[CONV_BACKWARD])), float(np.median(cell["input"]))))
    return out


def store_fit(runs: Sequence[PlanRun], kind: str) -> tuple[float, float]:
    """``(latency, bandwidth)`` of workspace accesses of `kind` ("read" or "write"):
    ``seconds = latency + bytes / bandwidth`` fitted to every access (non-negative)."""
    rows = np.array([(p.nbytes, p.seconds) for run in runs for r in run.receipts
                     for e in r.events for p in e.phases if p.kind == kind], float)
    if not len(rows):
        return 0.0, math.inf
    design = np.stack([np.ones(len(rows)), rows[:, 0]], axis=1)
    latency, per_byte = nonneg_fit(design, rows[:, 1])
    if per_byte <= 0:  # all accesses alike: charge their median time per byte
        return float(latency), float(np.median(rows[:, 0] / np.maximum(rows[:, 1], 1e-9)))
    return float(latency), float(1.0 / per_byte)


def nonneg_fit(rows: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (dropping negative ones, refitting)."""
    keep = list(range(rows.shape[1]))
    coef = np.zeros(rows.shape[1])
    while keep:
        solution, *_ = np.linalg.lstsq(rows[:, keep], t, rcond=None)
        if (solution >= 0).all():
            coef[keep] = solution
            return coef
        keep.pop(int(np.argmin(solution)))
    return coef


def dataset_read_s(runs: Sequence[PlanRun]) -> float | None:
    """Median seconds of the batch read of the first layer's forward."""
    times = [p.seconds for run in runs for r in run.receipts for e in r.events
             if e.name == CONV_FORWARD and e.layer == 0 for p in e.phases if p.kind == "dataset"]
    return float(np.median(times)) if times else None


def dense_s(runs: Sequence[PlanRun]) -> float:
    """Median seconds of the dense head's compute on the master (worker 0)."""
    return float(np.median([_busy(e) for run in runs for r in run.receipts for e in r.events
                            if e.name == DENSE_HEAD]))


def task_gap_s(runs: Sequence[PlanRun]) -> float:
    """Median gap between a worker's step task and its next (already queued) one."""
    gaps = []
    for run in runs:
        by_worker: dict[str, list[Receipt]] = defaultdict(list)
        for receipt in run.receipts:
            by_worker[receipt.worker].append(receipt)
        for receipts in by_worker.values():
            receipts.sort(key=lambda r: r.step)
            gaps += [b.start - a.end for a, b in zip(receipts, receipts[1:])
                     if b.step == a.step + 1]
    return max(float(np.median(gaps)), 0.0) if gaps else 0.0


def sync_s(runs: Sequence[PlanRun]) -> float:
    """Median delay from a slot's write to a reader that was waiting for it noticing."""
    lags = []
    for run in runs:
        written = {(r.step, p.slot): p.end for r in run.receipts for e in r.events
                   for p in e.phases if p.kind == "write"}
        for r in run.receipts:
            for e in r.events:
                for p in e.phases:
                    end = written.get((r.step, p.slot))
                    if p.kind == "wait" and end is not None and p.start < end < p.end:
                        lags.append(p.end - end)
    return float(np.median(lags)) if lags else 0.0
