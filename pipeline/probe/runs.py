"""Calibration runs: the engine's own steps, timed at chosen shard sizes.

A synthetic timing loop underestimates what a shard costs inside training (fresh
allocations, other workers' traffic, the denormals of real data), so the probe
runs the engine itself, steps submitted ahead as the training loop does (warm-up
steps one per task, the measured ones in one task, as runs hold several steps per
task: `PlanEngines.run`), for a few steps per *plan* (how many kernels of each
layer each worker holds, worker 0 the master) and reads every constant the model
needs from the receipts: per worker and layer the
forward, backward and input-gradient seconds at each kernel count; per workspace
access its seconds and bytes; the dense head; the dataset read; the gap between a
worker's queued step tasks; and how long a waiting reader takes to notice a
slot's ready marker. Beside the receipts, the probing process's own CPU over each
collect of a round (the client, and an embedded cluster's scheduler), which on a
machine whose cores the workers fill is taken from them.

Plans: the even split over the first ``P`` workers for ``P = 1..n`` (what
``single`` and ``kernel`` run), plus, where a step is cheap, splits where one
worker holds three quarters or all but one quantum of each layer (and the same
turned round), so that the shard tables span the counts another split may use.
Every plan covers each layer: a layer's input is every shard's output. And one
*replica plan* per replica step (`ReplicaPlan`): every worker a whole replica on its
even share of the batch, all at once, as ``hybrid`` runs it (its conv trunk's ops) and
as ``data`` runs it (the whole replica's step).

Rounds: every plan runs a few steps, then every plan again (`ROUNDS`), each plan's
engine kept between its rounds, so that each size is timed at moments seconds
apart; plans holding a size the rounds did not settle, or one that breaks "time
grows with kernels", run further rounds (`RETIMES`; pipeline/probe/rounds.py,
robust.py). What the runs measured is read off their receipts in
pipeline/probe/readings.py.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.engine.checkpointing import prepare_checkpoints
from pipeline.engine.heap import heap_frozen
from pipeline.cluster.workers import ClusterWorker, all_local
from pipeline.config.network_config import ConvLayerConfig, NetworkConfig
from pipeline.config.run_config import DataConfig, RunConfig, TrainConfig, WorkspaceConfig
from pipeline.placement.split import Placement, rough_seconds, split_even
from pipeline.engine.step_engine import RunPlan, StepEngine
from storage.datasets import open_dataset_info
from tasks.data_ops import DATA_SIDE
from tasks.hybrid_ops import HYBRID_SIDE
from tasks.kernel_ops import KERNEL_SIDE
from tasks.layout import layout_from_counts
from tasks.receipts import Receipt
from tasks.replica_layout import DataLayout, HybridLayout, dense_widths, split_counts
from tasks.specs import Arithmetic, NetworkSpec, batch_norm_rows
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
    """Every worker a whole replica on its even share of the batch, all at once: what
    no kernel plan times (whole layers there run on worker 0 alone, at the whole
    batch). ``whole``: as the ``data`` step runs it, the whole replica in one op (its
    replica-step); else as the ``hybrid`` step (scheme a), whose trunk ops time the
    conv trunk alone.

    Why both: the same trunk runs a few percent faster inside a ``data`` replica's one
    autograd pass than as ``hybrid``'s separate trunk ops (compute per step on the
    small network at 2 workers: 24.8-25.0 ms in ``data``'s runs, 25.4-25.8 in
    ``hybrid``'s), so each strategy's replica is timed as it runs."""

    shares: list[int]
    whole: bool = False

    @property
    def workers(self) -> int:
        return len(self.shares)


Plan = ProbePlan | ReplicaPlan


def replica_plan(network: NetworkSpec, batch: int, n: int, batch_norm: str = "sync",
                 whole: bool = False) -> ReplicaPlan | None:
    """The replica plan over ``n`` workers (``whole``: `ReplicaPlan.whole`), or None
    where hybrid's trunk ops cannot split the network (a dense layer narrower than ``n``) or the batch (fewer rows than ``n``;
    with ``batch_norm: local``, fewer than `batch_norm_rows` a replica: each replica's
    batch norm would see one value per channel, which PyTorch refuses, and the run
    itself never gives a replica so few, `pipeline.placement.split.merge_short_shares`)."""
    least = batch_norm_rows(network) if batch_norm == "local" else 1
    narrow = not whole and min(out for _in, out in dense_widths(network)) < n
    if n < 1 or batch < least * n or narrow:
        return None
    return ReplicaPlan(split_counts(batch, n), whole)


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
#: Rounds of the replica plan (under `ROUNDS_BELOW_S`): two rounds of three steps read
#: the small network's trunk 9 % off its runs' on one probe of the Intel Xeon.
REPLICA_ROUNDS = 4
#: Passes that time again the plans holding an unsettled or inconsistent size.
RETIMES = 1
#: The calibration runs' step budget (their config's ``train.steps``; never reached).
PROBE_STEPS = 1000


def plan_rounds(seconds: float, replica: bool = False) -> int:
    """Rounds a plan of about ``seconds`` a step gets before any timing again: the
    replica plan `REPLICA_ROUNDS`, since its trunk is all of a replica's conv time in
    the model, where a kernel plan's size is one point of a table of several."""
    if seconds >= ROUNDS_BELOW_S:
        return 1
    return REPLICA_ROUNDS if replica else ROUNDS


@dataclass
class TaskCpu:
    """This process's CPU over one collect of a calibration round: from the last
    collect's return (or the round's start) to this one's, the tasks per worker it
    submitted, the one task per worker it collected and that task's steps
    (pipeline/probe/client_cpu.py fits the client's CPU per task from these)."""

    workers: int
    submitted: int  # tasks per worker submitted in the interval
    steps: int  # steps of the task per worker collected at its end
    wall_s: float
    cpu_s: float


@dataclass
class PlanRun:
    """One plan's receipts (warm-up steps excluded: ``warmup_receipts``), the workers
    it ran on, and the round it was timed in; this process's CPU over each of the
    round's collects (`TaskCpu`, warm-up tasks included); and each worker's gap between
    its last warm-up task and the measured one queued behind it."""

    plan: Plan
    workers: list[str]
    receipts: list[Receipt]
    round: int = 0
    task_cpu: list[TaskCpu] = field(default_factory=list)
    task_gaps: list[float] = field(default_factory=list)
    warmup_receipts: list[Receipt] = field(default_factory=list)


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
    """Even splits over 1..n workers, then tilted splits if a step is cheap.

    Where a layer has fewer channel quanta than workers (a narrow network: resnet20 at
    width 1/4 has 4-kernel layers), the even split leaves some workers without it; its
    rotations give each worker every layer in turn, so that every worker's table has
    every layer."""
    plans = []
    for p in range(1, n + 1):
        even = [split_even(layer.kernels, p, q) for layer, q in zip(network.conv, quanta)]
        plans.append(ProbePlan(even))
        if any(0 in row for row in even):
            plans += [ProbePlan([row[-turn:] + row[:-turn] for row in even])
                      for turn in range(1, p)]
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
                 workspace: str | None = None, quantum: int = 1, seed: int = 0,
                 batch_norm: str = "sync") -> RunConfig:
    """A run config for calibration runs of ``network`` (weights and the batches' order
    from `seed`; the replicas' batch norm `batch_norm`, as the run's).

    `quantum` chunks the (throwaway) checkpoint: every plan's shards must own whole
    chunks of it.
    """
    conv = [ConvLayerConfig(layer.kernels, layer.kernel_size, layer.padding, layer.pool)
            for layer in network.conv]
    return RunConfig(
        name=f"probe-{uuid.uuid4().hex[:6]}", strategy="kernel", placement="even",
        network=NetworkConfig(conv=conv, hidden=list(network.hidden), classes=network.classes,
                              dtype=network.dtype),
        data=DataConfig(path=dataset),
        train=TrainConfig(steps=steps, batch=batch, lr=1e-3, warmup_steps=1, eval_samples=0,
                          seed=seed, batch_norm=batch_norm),
        workspace=WorkspaceConfig(path=workspace, channel_quantum=quantum), output=output,
        progress=False)


class PlanEngines:
    """The calibration runs' engines: one per plan, started at its first round and kept
    until the probe ends, so that a later round of a plan is a few more steps of the
    same run (one warm-up step, no new setup or checkpoint) a few seconds after the
    last. Steps go ahead ``train.inflight`` at a time, as in the training loop.

    Each plan orders the batches by a seed of its own. A worker keeps the dataset's
    files open from plan to plan, so with one order for all, every plan after the
    first read rows its page cache held: behind links the probe's batch reads took 5-10
    ms where a run's first pass over them took 16-20 ms (docs/benchmarks.md). The
    plans share one initial checkpoint (every plan's chunks are whole multiples of
    `quantum`, and no calibration run writes one): writing it took 3-5 s a plan for
    resnet20's 21 layers and their batch norms."""

    def __init__(self, client: Any, offered: Sequence[ClusterWorker], network: NetworkSpec,
                 batch: int, dataset: str, plans: Sequence[Plan],
                 workspace_dir: str | None = None, output_root: str | None = None,
                 batch_norm: str = "sync") -> None:
        self.client, self.offered, self.network, self.batch = client, list(offered), network, batch
        self.batch_norm = batch_norm  # the replica plan's, as the run's replicas
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
            # a seed of its own: each plan reads other rows than the plans before it
            # read (`PlanEngines` doc)
            config = probe_config(self.network, self.batch, self.dataset, self.base, PROBE_STEPS,
                                  self.workspace_dir, self.quantum, seed=len(self.engines) + 1,
                                  batch_norm=self.batch_norm)
            if not self.engines:  # one initial checkpoint for every plan (`PlanEngines` doc)
                prepare_checkpoints(config, self.network)
            workers = self.offered[:plan.workers]
            names = [w.name for w in workers]
            arithmetic = Arithmetic(config.optimizer_spec())
            if isinstance(plan, ReplicaPlan) and plan.whole:
                run_plan = RunPlan(workers, DataLayout(tuple(names), tuple(plan.shares),
                                                       batch_norm=self.batch_norm),
                                   Placement("even", [list(plan.shares)]), DATA_SIDE,
                                   arithmetic)
            elif isinstance(plan, ReplicaPlan):
                neurons = tuple(tuple(split_counts(out, plan.workers))
                                for _in, out in dense_widths(self.network))
                layout = HybridLayout(tuple(names), tuple(plan.shares), neurons, "a", "full",
                                      batch_norm=self.batch_norm)
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
        round) one per task, submitted ahead as the training loop does, then its
        measured steps as one task per worker, queued behind them.

        Why one task for the measured steps: runs put several steps in a task
        (``train.steps_per_task``), and a worker's share of the Dask work per task
        (receiving it, reporting it) runs on the core its ops run on. Timed one step
        per task, a 20 ms replica trunk took a quarter longer than in the runs it
        predicts (docs/benchmarks.md). The per-task costs are measured on their own:
        the gap before the measured task (`PlanRun.task_gaps`), and this process's CPU
        over each collect (`PlanRun.task_cpu`): the warm-ups' one step a task against
        the measured task's several, so that its CPU per task and per second come
        apart (pipeline/probe/client_cpu.py)."""
        engine, names, first = self._engine(plan)
        steps, warmup = plan_steps(plan_seconds(self.network, self.batch, plan))
        if first:
            steps, warmup = steps - warmup + 1, 1
        tasks = [(step, 1) for step in range(first, first + warmup)]
        tasks.append((first + warmup, steps - warmup))
        ahead = engine.config.train.inflight
        submitted, results, task_cpu = 0, [], []
        with heap_frozen():  # as the training loop's steps run
            cpu, wall = time.process_time(), time.perf_counter()
            for index, (start, count) in enumerate(tasks):
                sent = submitted
                while submitted < min(index + ahead, len(tasks)):
                    engine.submit(*tasks[submitted])
                    submitted += 1
                results.append(engine.collect(start))
                now_cpu, now_wall = time.process_time(), time.perf_counter()
                task_cpu.append(TaskCpu(plan.workers, submitted - sent, count,
                                        now_wall - wall, now_cpu - cpu))
                cpu, wall = now_cpu, now_wall
        for step_results in results:
            for result in step_results:
                if not np.isfinite(result.loss):
                    raise FloatingPointError(f"a calibration run diverged at step {result.step}")
        warm_end = {r.worker: r.end for r in results[-2][-1].receipts}
        gaps = [r.start - warm_end[r.worker] for r in results[-1][0].receipts
                if r.worker in warm_end]
        self.engines[id(plan)] = (engine, names, first + steps)
        receipts = [r for result in results[-1] for r in result.receipts]
        warmup = [r for task in results[:-1] for result in task for r in result.receipts]
        return PlanRun(plan, names, receipts, round_index, task_cpu, gaps, warmup)


def _output_root(offered: Sequence[ClusterWorker]) -> str | None:
    """Where the probe's checkpoint goes: a temporary directory if every worker is local."""
    if all_local(list(offered)):
        return None
    root = os.path.join(os.getcwd(), "runs")
    os.makedirs(root, exist_ok=True)
    return root
