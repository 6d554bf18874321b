"""Calibration runs: the engine's own steps, timed at chosen shard sizes.

A synthetic timing loop underestimates what a shard costs inside training (fresh
allocations, other workers' traffic, the denormals of real data), so the probe
runs the engine itself, steps submitted ahead as the training loop does, for a few
steps per *plan* (how many kernels of each layer each worker holds, worker 0 the
master) and reads
every constant the model needs from the receipts: per worker and layer the
forward, backward and input-gradient seconds at each kernel count; per workspace
access its seconds and bytes; the dense head; the dataset read; the gap between a
worker's queued step tasks; and how long a waiting reader takes to notice a
slot's ready marker.

Plans: the even split over the first ``P`` workers for ``P = 1..n`` (what
``single`` and ``kernel`` run), plus, where a step is cheap, splits where one
worker holds three quarters or all but one quantum of each layer (and the same
turned round), so that the shard tables span the counts another split may use.
Every plan covers each layer: a layer's input is every shard's output. And one
*replica plan* (`ReplicaPlan`): every worker a whole replica on its even share of
the batch, all at once, the conv trunk that ``data`` and ``hybrid`` run.

Rounds: every plan runs a few steps, then every plan again (`ROUNDS`), each plan's
engine kept between its rounds, so that each size is timed at moments seconds
apart; plans holding a size the rounds did not settle, or one that breaks "time
grows with kernels", run further rounds (`RETIMES`; pipeline/probe/robust.py).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.checkpointing import prepare_checkpoints
from pipeline.cluster import ClusterWorker, all_local
from pipeline.config import (ConvLayerConfig, DataConfig, NetworkConfig, RunConfig, TrainConfig,
                             WorkspaceConfig)
from pipeline.placement import Placement, rough_seconds, split_even
from pipeline.engine import RunPlan, StepEngine
from pipeline.probe.results import ShardTiming, TrunkTiming, mark_outliers
from pipeline.probe.robust import Estimate, estimate
from storage.datasets import open_dataset_info
from tasks.hybrid_ops import HYBRID_SIDE
from tasks.kernel_ops import KERNEL_SIDE
from tasks.layout import CONV_BACKWARD, CONV_FORWARD, DENSE_HEAD, layout_from_counts
from tasks.receipts import OpEvent, Receipt
from tasks.replica_layout import (TRUNK_BACKWARD, TRUNK_FORWARD, HybridLayout, dense_widths,
                                  split_counts)
from tasks.specs import Arithmetic, NetworkSpec
from tasks.worker_state import configure_process

@dataclass
class ProbePlan:
    """Kernels per layer (rows) and worker (columns) of one calibration run."""

    counts: list[list[int]]

    @property
    def workers(self) -> int:
        return len(self.counts[0])


@dataclass
class ReplicaPlan:
    """Every worker a whole replica on its even share of the batch, all at once: the
    ``hybrid`` step (scheme a), whose conv trunk is what ``data`` and ``hybrid``
    replicas run and which no kernel plan times (whole layers there run on worker 0
    alone, at the whole batch)."""

    shares: list[int]

    @property
    def workers(self) -> int:
        return len(self.shares)


Plan = ProbePlan | ReplicaPlan


def replica_plan(network: NetworkSpec, batch: int, n: int) -> ReplicaPlan | None:
    """The replica plan over ``n`` workers, or None where hybrid cannot split the
    network (a dense layer narrower than ``n``) or the batch (fewer rows than ``n``)."""
    if n < 1 or batch < n or min(out for _in, out in dense_widths(network)) < n:
        return None
    return ReplicaPlan(split_counts(batch, n))


def plan_steps(seconds: float) -> tuple[int, int]:
    """Steps to run a plan for and how many of them are warm-up: the first steps of a
    run are slower (allocations settle), so cheap plans get two warm-ups and three
    measured steps; a plan of seconds per step, one warm-up and one or two."""
    if seconds < 1.0:
        return 5, 2
    return (3, 1) if seconds < 6.0 else (2, 1)


#: Rounds of every plan (timed one round after the other; pipeline/probe/robust.py),
#: for plans of less than `ROUNDS_BELOW_S` seconds a step; longer plans run once
#: (a hiccup of tens of milliseconds is lost in a step of seconds).
ROUNDS = 2
ROUNDS_BELOW_S = 6.0
#: Passes that time again the plans holding an unsettled or inconsistent size.
RETIMES = 1
#: The calibration runs' step budget (their config's ``train.steps``; never reached).
PROBE_STEPS = 1000


def plan_rounds(seconds: float) -> int:
    """Rounds a plan of about ``seconds`` a step gets before any timing again."""
    return ROUNDS if seconds < ROUNDS_BELOW_S else 1


@dataclass
class PlanRun:
    """One plan's receipts (warm-up steps excluded), the workers it ran on, and the
    round it was timed in."""

    plan: Plan
    workers: list[str]
    receipts: list[Receipt]
    round: int = 0


def plan_seconds(network: NetworkSpec, batch: int, plan: Plan) -> float:
    """Rough seconds of one step of ``plan`` (its slowest worker)."""
    if isinstance(plan, ReplicaPlan):
        return sum(rough_seconds(layer, max(plan.shares), layer.kernels)
                   for layer in network.conv)
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


class PlanEngines:
    """The calibration runs' engines: one per plan, started at its first round and kept
    until the probe ends, so that a later round of a plan is a few more steps of the
    same run (one warm-up step, no new setup or checkpoint) a few seconds after the
    last. Steps go ahead ``train.inflight`` at a time, as in the training loop."""

    def __init__(self, client: Any, offered: Sequence[ClusterWorker], network: NetworkSpec,
                 batch: int, dataset: str, plans: Sequence[Plan],
                 workspace_dir: str | None = None, output_root: str | None = None) -> None:
        self.client, self.offered, self.network, self.batch = client, list(offered), network, batch
        self.dataset, self.workspace_dir = dataset, workspace_dir
        self.output_root = output_root  # where checkpoints go (None: `_output_root`)
        self.samples = open_dataset_info(dataset).train_samples
        self.quantum = math.gcd(*(k for plan in plans if isinstance(plan, ProbePlan)
                                  for row in plan.counts for k in row)) or 1
        self.engines: dict[int, tuple[StepEngine, list[str], int]] = {}  # id(plan) -> ..., next step
        self.base = ""
        self.threads = 0

    def __enter__(self) -> "PlanEngines":
        self.base = tempfile.mkdtemp(prefix="probe-",
                                     dir=self.output_root or _output_root(self.offered))
        self.threads = torch.get_num_threads()
        configure_process(1)  # as run_training: the client must not fight the workers
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            for engine, _, _ in self.engines.values():
                engine.close()
        finally:
            self.engines = {}
            torch.set_num_threads(self.threads)
            shutil.rmtree(self.base, ignore_errors=True)

    def _engine(self, plan: Plan) -> tuple[StepEngine, list[str], int]:
        if id(plan) not in self.engines:
            config = probe_config(self.network, self.batch, self.dataset, self.base, PROBE_STEPS,
                                  self.workspace_dir, self.quantum)
            prepare_checkpoints(config, self.network)
            workers = self.offered[:plan.workers]
            names = [w.name for w in workers]
            arithmetic = Arithmetic(config.optimizer_spec())
            if isinstance(plan, ReplicaPlan):
                neurons = tuple(tuple(split_counts(out, plan.workers))
                                for _in, out in dense_widths(self.network))
                layout = HybridLayout(tuple(names), tuple(plan.shares), neurons, "a", "full")
                run_plan = RunPlan(workers, layout, Placement("even", [list(plan.shares)]),
                                   HYBRID_SIDE, arithmetic)
            else:
                layout = layout_from_counts(names, plan.counts, master=0)
                run_plan = RunPlan(workers, layout, Placement("even", plan.counts),
                                   KERNEL_SIDE, arithmetic)
            engine = StepEngine(self.client, config, self.network, run_plan, self.samples)
            self.engines[id(plan)] = (engine, [w.name for w in workers], 0)
            engine.start(0)
        return self.engines[id(plan)]

    def run(self, plan: Plan, round_index: int) -> PlanRun:
        """One round of ``plan``: its warm-up steps (`plan_steps`; one after the first
        round), then its measured steps."""
        engine, names, first = self._engine(plan)
        steps, warmup = plan_steps(plan_seconds(self.network, self.batch, plan))
        if first:
            steps, warmup = steps - warmup + 1, 1
        ahead = engine.config.train.inflight
        submitted, receipts = first, []
        for step in range(first, first + steps):
            while submitted < min(step + ahead, first + steps):
                engine.submit(submitted)
                submitted += 1
            result = engine.collect(step)
            if not np.isfinite(result.loss):
                raise FloatingPointError(f"a calibration run diverged at step {step}")
            if step >= first + warmup:
                receipts += result.receipts
        self.engines[id(plan)] = (engine, names, first + steps)
        return PlanRun(plan, names, receipts, round_index)


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


Cell = tuple[str, int, int, int]  # worker, layer, kernels, workers running


def shard_samples(runs: Sequence[PlanRun]) -> dict[Cell, dict[int, list[tuple[float, float,
                                                                              float]]]]:
    """Per cell and round, every measured step's ``(forward, backward, input_grad)``
    seconds of that worker's shard of that layer."""
    cells: dict[Cell, dict[int, list[tuple[float, float, float]]]] = defaultdict(
        lambda: defaultdict(list))
    for run in runs:
        if not isinstance(run.plan, ProbePlan):
            continue
        for receipt in run.receipts:
            column = run.workers.index(receipt.worker)
            events: dict[int, dict[str, OpEvent]] = defaultdict(dict)
            for event in receipt.events:
                if event.name in (CONV_FORWARD, CONV_BACKWARD):
                    events[event.layer][event.name] = event
            for layer, ops in events.items():
                k = run.plan.counts[layer][column]
                if k and CONV_FORWARD in ops and CONV_BACKWARD in ops:
                    backward = ops[CONV_BACKWARD]
                    cells[(receipt.worker, layer, k, len(run.workers))][run.round].append(
                        (_busy(ops[CONV_FORWARD]), _busy(backward), _first_part(backward)))
    return cells


def shard_timings(runs: Sequence[PlanRun]) -> dict[str, list[ShardTiming]]:
    """Per worker, one robust figure per (layer, kernels, workers running): each pass
    the median of its rounds' medians, the spread of forward + backward, whether the
    rounds settled it, and whether it breaks "time grows with kernels"
    (pipeline/probe/robust.py)."""
    out: dict[str, list[ShardTiming]] = {}
    for (worker, layer, k, active), by_round in sorted(shard_samples(runs).items()):
        rounds = [by_round[r] for r in sorted(by_round)]
        f, b, i = (estimate([[step[n] for step in r] for r in rounds]) for n in range(3))
        total = estimate([[step[0] + step[1] for step in r] for r in rounds])
        both = f.value + b.value
        out.setdefault(worker, []).append(ShardTiming(
            layer, k, active, f.value, b.value, i.value, total.rounds, total.samples,
            min(total.low, both), max(total.high, both), total.settled))
    return {worker: mark_outliers(timings) for worker, timings in out.items()}


def trunk_timings(runs: Sequence[PlanRun]) -> dict[str, TrunkTiming]:
    """Per worker, its replica's conv trunk from the replica plan's rounds: the
    trunk-forward's compute and the trunk-backward's (its backward and the gradient's
    flattening, as a replica-step has them), each the median of its rounds' medians."""
    cells: dict[tuple[str, int, int], dict[int, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list))
    for run in runs:
        if not isinstance(run.plan, ReplicaPlan):
            continue
        for receipt in run.receipts:
            ops = {e.name: _busy(e) for e in receipt.events
                   if e.name in (TRUNK_FORWARD, TRUNK_BACKWARD)}
            rows = run.plan.shares[run.workers.index(receipt.worker)]
            if rows and len(ops) == 2:
                cells[(receipt.worker, rows, run.plan.workers)][run.round].append(
                    (ops[TRUNK_FORWARD], ops[TRUNK_BACKWARD]))
    out = {}
    for (worker, rows, active), by_round in cells.items():
        rounds = [by_round[r] for r in sorted(by_round)]
        f, b = (estimate([[step[n] for step in r] for r in rounds]) for n in (0, 1))
        total = estimate([[step[0] + step[1] for step in r] for r in rounds])
        both = f.value + b.value
        out[worker] = TrunkTiming(rows, active, f.value, b.value, total.rounds, total.samples,
                                  min(total.low, both), max(total.high, both), total.settled)
    return out


def suspects(timings: dict[str, list[ShardTiming]],
             trunks: dict[str, TrunkTiming] | None = None) -> set[Cell]:
    """The cells to time again: not settled by their rounds, or inconsistent (a
    replica's trunk as layer -1, its rows as kernels)."""
    cells = {(worker, t.layer, t.kernels, t.active) for worker, mine in timings.items()
             for t in mine if not t.settled or t.outlier}
    return cells | {(worker, -1, t.rows, t.active) for worker, t in (trunks or {}).items()
                    if not t.settled}


def plans_holding(plans: Sequence[Plan], cells: set[Cell], names: Sequence[str]
                  ) -> list[Plan]:
    """The plans that time any of ``cells`` (``names``: the offered workers in order)."""
    out = []
    for plan in plans:
        for worker, layer, k, active in cells:
            column = names.index(worker) if worker in names else plan.workers
            if active != plan.workers or column >= plan.workers \
                    or (layer < 0) != isinstance(plan, ReplicaPlan):
                continue
            held = plan.shares[column] if isinstance(plan, ReplicaPlan) \
                else plan.counts[layer][column]
            if held == k:
                out.append(plan)
                break
    return out


def calibrate(client: Any, offered: Sequence[ClusterWorker], network: NetworkSpec, batch: int,
              dataset: str, plans: Sequence[Plan], workspace_dir: str | None = None,
              output_root: str | None = None) -> tuple[list[PlanRun], int]:
    """Every plan in rounds (`plan_rounds`, one round after the other), then up to
    `RETIMES` more rounds of the plans holding an unsettled or inconsistent size.
    Returns the runs and how many plan rounds were timing again."""
    names = [w.name for w in offered]
    rounds = [plan_rounds(plan_seconds(network, batch, plan)) for plan in plans]
    runs: list[PlanRun] = []
    again_runs = 0
    with PlanEngines(client, offered, network, batch, dataset, plans, workspace_dir,
                     output_root) as engines:
        for r in range(max(rounds, default=0)):
            runs += [engines.run(plan, r) for plan, n in zip(plans, rounds) if n > r]
        for extra in range(RETIMES):
            again = plans_holding(plans, suspects(shard_timings(runs), trunk_timings(runs)),
                                  names)
            if not again:
                break
            runs += [engines.run(plan, max(rounds) + extra) for plan in again]
            again_runs += len(again)
    return runs, again_runs


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


def dense_s(runs: Sequence[PlanRun]) -> Estimate:
    """The dense head's compute on the master (worker 0): its figure over the rounds."""
    by_round: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        by_round[run.round] += [_busy(e) for r in run.receipts for e in r.events
                                if e.name == DENSE_HEAD]
    return estimate([by_round[r] for r in sorted(by_round)])


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
