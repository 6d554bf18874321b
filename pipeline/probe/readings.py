"""Reading calibration runs' receipts: the compute and workspace constants the model
needs.

Per worker, the shard timings (one robust figure per layer, kernel count and
workers running: pipeline/probe/robust.py) and the replica plans' conv trunk, whole
replica step and update; the workspace's per-access cost and its spread; the dense
head; the dataset read. The orchestration costs (the gaps between tasks and steps,
the ready markers) are read in pipeline/probe/dask_readings.py.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Sequence

import numpy as np

from pipeline.probe.tables import mark_outliers
from pipeline.probe.timings import ShardTiming, TrunkTiming
from pipeline.probe.robust import Estimate, estimate
from pipeline.probe.runs import PlanRun, ProbePlan, ReplicaPlan
from tasks.layout import CONV_BACKWARD, CONV_FORWARD, DENSE_HEAD
from tasks.receipts import OpEvent, Receipt
from tasks.replica_layout import (DENSE_BACKWARD, DENSE_FORWARD, GRAD_UPDATE, REPLICA_STEP,
                                  TRUNK_BACKWARD, TRUNK_FORWARD)


def _busy(event: OpEvent) -> float:
    return sum(p.seconds for p in event.phases if p.kind in ("compute", "emulated"))


def _stretches(event: OpEvent) -> list[float]:
    """An op's compute (and emulated) seconds between its waits for a peer: the
    stretches a timeline's meetings cut it into. A kernel shard's op is one (it waits
    for its inputs, then computes); a replica's trunk meets its peers at every
    synchronised batch norm, forward and backward."""
    stretches = [0.0]
    for phase in event.phases:
        if phase.kind == "wait":
            stretches.append(0.0)
        elif phase.kind in ("compute", "emulated"):
            stretches[-1] += phase.seconds
    return stretches


def _first_part(event: OpEvent) -> float:
    """A backward's compute before its last compute phase (the input-gradient part)."""
    computes = [i for i, p in enumerate(event.phases) if p.kind == "compute"]
    cut = computes[-1] if computes else len(event.phases)
    return sum(p.seconds for p in event.phases[:cut] if p.kind in ("compute", "emulated"))


def steady_receipts(run: PlanRun) -> list[Receipt]:
    """A run's measured receipts without its task's first step where the task held
    three or more: that step pays the task's start on the worker's core (its compute
    1.1-1.5x the next steps' in the small network's runs, Intel Xeon), which the model
    prices apart (`DaskProbe.task`, the client's CPU per task) and a run's median step
    carries none of from three steps a task on (docs/model.md, "Dask"). In a median of
    three it left the larger of the other two: 1-3 % over the runs' median steps."""
    steps = sorted({r.step for r in run.receipts})
    if len(steps) < 3:
        return list(run.receipts)
    return [r for r in run.receipts if r.step != steps[0]]


Cell = tuple[str, int, int, int]  # worker, layer, kernels, workers running

#: One measured step of a cell: forward, backward, input-gradient and dataset-read
#: seconds (the batch read before the first layer's forward; None where none was).
StepTimes = tuple[float, float, float, float | None]


def _dataset_read(event: OpEvent) -> float | None:
    """Seconds an op spent reading the batch (its ``dataset`` phases; None: none)."""
    reads = [p.seconds for p in event.phases if p.kind == "dataset"]
    return sum(reads) if reads else None


def _read_figure(rounds: list[list[float | None]]) -> float | None:
    """The batch reads' figure over the rounds, as the passes' (None: never read)."""
    kept = [[s for s in r if s is not None] for r in rounds]
    kept = [r for r in kept if r]
    return estimate(kept).value if kept else None


def shard_samples(runs: Sequence[PlanRun]) -> dict[Cell, dict[int, list[StepTimes]]]:
    """Per cell and round, every measured step's `StepTimes` of that worker's shard of
    that layer."""
    cells: dict[Cell, dict[int, list[StepTimes]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        if not isinstance(run.plan, ProbePlan):
            continue
        for receipt in steady_receipts(run):
            column = run.workers.index(receipt.worker)
            events: dict[int, dict[str, OpEvent]] = defaultdict(dict)
            for event in receipt.events:
                if event.name in (CONV_FORWARD, CONV_BACKWARD):
                    events[event.layer][event.name] = event
            for layer, ops in events.items():
                k = run.plan.counts[layer][column]
                if k and CONV_FORWARD in ops and CONV_BACKWARD in ops:
                    forward, backward = ops[CONV_FORWARD], ops[CONV_BACKWARD]
                    cells[(receipt.worker, layer, k, len(run.workers))][run.round].append(
                        (_busy(forward), _busy(backward), _first_part(backward),
                         _dataset_read(forward)))
    return cells


def shard_timings(runs: Sequence[PlanRun]) -> dict[str, list[ShardTiming]]:
    """Per worker, one robust figure per (layer, kernels, workers running): each pass
    the median of its rounds' medians, the spread of forward + backward, whether the
    rounds settled it, and whether it breaks "time grows with kernels" (pipeline/probe/
    robust.py); for the first layer also its batch read, figured the same way."""
    out: dict[str, list[ShardTiming]] = {}
    for (worker, layer, k, active), by_round in sorted(shard_samples(runs).items()):
        rounds = [by_round[r] for r in sorted(by_round)]
        f, b, i = (estimate([[step[n] for step in r] for r in rounds]) for n in range(3))
        total = estimate([[step[0] + step[1] for step in r] for r in rounds])
        both = f.value + b.value
        out.setdefault(worker, []).append(ShardTiming(
            layer, k, active, f.value, b.value, i.value, total.rounds, total.samples,
            min(total.low, both), max(total.high, both), total.settled,
            dataset_s=_read_figure([[step[3] for step in r] for r in rounds])))
    return {worker: mark_outliers(timings) for worker, timings in out.items()}


#: One replica's step as the replica plan timed it, per row: compute figures, then its
#: batch read (None: it read none).
RowSample = tuple[tuple[float, ...], float | None]


def _replica_rounds(runs: Sequence[PlanRun], whole: bool, read: Callable[[Receipt], tuple[
        tuple[float, ...], OpEvent] | None], alike: Sequence[Sequence[str]],
        per_row: bool = True) -> dict[str, tuple[int, int, list[list[RowSample]]]]:
    """Per worker, the rows it ran in the replica plan (`whole`: the one timing a whole
    replica-step, `ReplicaPlan.whole`; else the trunk ops'), the workers running,
    and its steps by round, each step `read` off its receipt (compute figures and the
    op holding the batch read; None: the receipt lacks the ops). `per_row`: the
    figures grow with the rows (a trunk's); else they do not (an update's), and alike
    workers' steps pool as they are.

    Workers in one group of `alike` (the same hardware as far as the probe can tell:
    `alike_workers`) are figured together, every step per row of all of them, each
    then at its own rows: such workers differ only by which of them the host's
    scheduler ran, and a model taking each its own few steps would wait for whichever
    read slowest (two alike workers' trunks read 15 % apart where their runs' steps
    were 2 % apart)."""
    samples: dict[tuple[str, int], dict[int, list[RowSample]]] = \
        defaultdict(lambda: defaultdict(list))  # (worker, workers running) -> round -> per row
    rows_of: dict[tuple[str, int], int] = {}
    for run in runs:
        if not isinstance(run.plan, ReplicaPlan) or run.plan.whole != whole:
            continue
        for receipt in steady_receipts(run):
            rows, figures = run.plan.shares[run.workers.index(receipt.worker)], read(receipt)
            if rows and figures is not None:
                values, reader = figures
                batch_read = _dataset_read(reader)
                key = (receipt.worker, run.plan.workers)
                rows_of[key] = rows
                scale = rows if per_row else 1  # undone below, after pooling
                samples[key][run.round].append(
                    (tuple(v / scale for v in values),
                     None if batch_read is None else batch_read / rows))
    group_of = {name: tuple(group) for group in alike for name in group}
    out = {}
    for (worker, active), rows in rows_of.items():
        peers = [name for name in group_of.get(worker, (worker,)) if (name, active) in samples]
        by_round: dict[int, list[RowSample]] = defaultdict(list)
        for name in peers:
            for r, steps in samples[(name, active)].items():
                by_round[r] += steps
        scale = rows if per_row else 1
        out[worker] = (rows, active, [[(tuple(v * scale for v in values),
                                        None if d is None else d * rows)
                                       for values, d in by_round[r]] for r in sorted(by_round)])
    return out


def _trunk_ops(receipt: Receipt) -> tuple[tuple[float, ...], OpEvent] | None:
    """A hybrid replica's trunk-forward and trunk-backward compute."""
    ops = {e.name: e for e in receipt.events if e.name in (TRUNK_FORWARD, TRUNK_BACKWARD)}
    if len(ops) < 2:
        return None
    return (_busy(ops[TRUNK_FORWARD]), _busy(ops[TRUNK_BACKWARD])), ops[TRUNK_FORWARD]


def _dense_ops(receipt: Receipt) -> tuple[tuple[float, ...], OpEvent] | None:
    """A hybrid replica's dense ops, every layer's forward and backward: their compute
    summed (None where the step ran none)."""
    ops = [e for e in receipt.events if e.name in (DENSE_FORWARD, DENSE_BACKWARD)]
    return ((sum(_busy(e) for e in ops),), ops[0]) if ops else None


def _one_op(name: str) -> Callable[[Receipt], tuple[tuple[float, ...], OpEvent] | None]:
    """A reader of one op's compute off a data replica's receipt: its ``replica-step``
    (forward and backward, its gradient's hand-on copies) or its ``grad-update`` (the
    summed ranges joined into one flat gradient, the SGD step over every parameter)."""
    def read(receipt: Receipt) -> tuple[tuple[float, ...], OpEvent] | None:
        ops = [e for e in receipt.events if e.name == name]
        return ((_busy(ops[0]),), ops[0]) if ops else None
    return read


def _figure_at(found: tuple[int, int, list[list[RowSample]]] | None, rows: int,
               active: int) -> float | None:
    """The median of the rounds' medians of a replica plan's figure, where that plan
    ran at the trunk's `rows` and `active` workers (None elsewhere)."""
    if found is None or found[:2] != (rows, active):
        return None
    return estimate([[values[0] for values, _ in r] for r in found[2]]).value


def trunk_timings(runs: Sequence[PlanRun], alike: Sequence[Sequence[str]] = ()
                  ) -> dict[str, TrunkTiming]:
    """Per worker, its replica's conv trunk from the hybrid replica plan's rounds: the
    trunk-forward's compute and the trunk-backward's (its backward and the gradient's
    flattening, as a replica-step has them), each the median of its rounds' medians;
    and from the data replica plan's rounds, where it ran, the whole replica-step's
    compute (`TrunkTiming.data_step_s`) and its update's (`TrunkTiming.update_s`);
    from the hybrid plan's rounds also its dense ops (`TrunkTiming.hybrid_head_s`:
    its neurons on the whole batch, which do not grow with its rows). Alike workers
    pool their steps (`_replica_rounds`)."""
    steps = _replica_rounds(runs, True, _one_op(REPLICA_STEP), alike)
    updates = _replica_rounds(runs, True, _one_op(GRAD_UPDATE), alike, per_row=False)
    heads = _replica_rounds(runs, False, _dense_ops, alike, per_row=False)
    out = {}
    for worker, (rows, active, rounds) in _replica_rounds(runs, False, _trunk_ops,
                                                          alike).items():
        f, b = (estimate([[values[n] for values, _ in r] for r in rounds]) for n in range(2))
        total = estimate([[values[0] + values[1] for values, _ in r] for r in rounds])
        both = f.value + b.value
        data_step = _figure_at(steps.get(worker), rows, active)
        update_s = _figure_at(updates.get(worker), rows, active)
        out[worker] = TrunkTiming(rows, active, f.value, b.value, total.rounds, total.samples,
                                  min(total.low, both), max(total.high, both), total.settled,
                                  dataset_s=_read_figure([[d for _, d in r] for r in rounds]),
                                  data_step_s=data_step, update_s=update_s,
                                  hybrid_head_s=_figure_at(heads.get(worker), rows, active))
    return out


#: A normal distribution's interquartile range, in standard deviations.
IQR_SIGMAS = 1.349


def iqr_sigma(values: Sequence[float]) -> float:
    """A spread in standard deviations from the interquartile range, as a normal's:
    robust to the odd step a hiccup stretched."""
    low, high = np.percentile(values, [25, 75])
    return float(high - low) / IQR_SIGMAS


#: The ops whose compute `relative_spreads` compares between workers.
_SPREAD_OPS = (CONV_FORWARD, CONV_BACKWARD, TRUNK_FORWARD, TRUNK_BACKWARD)


def relative_spreads(runs: Sequence[PlanRun]) -> dict[str, dict[int, float]]:
    """Per worker and number of workers running, how much its ops' compute varies
    from step to step against its peers' (the cost model's `DeviceSpec.spread`).

    Each stretch of an op between two meetings with its peers (`_stretches`), per
    worker, op, layer and stretch in one run, over its median in that run: the
    timeline gives each stretch its own deviation, so the spread is read at that
    grain (a ResNet-20 replica's trunk, 45 stretches a step, varied 3.1 % a step but
    7.1 % a stretch). At each step, the workers' figures for the same stretch less their mean,
    so that what moves every worker alike (the machine's drift, another tenant)
    drops out: it costs no wait. A worker's spread is the interquartile range of its
    residuals over 1.349 (a normal's, in standard deviations), scaled by
    ``1 / sqrt(1 - 1/n)`` for the mean's own share of ``n`` workers. Only runs of two
    or more workers count: alone, a worker waits for no one."""
    residuals: dict[tuple[str, int], list[float]] = defaultdict(list)
    for run in runs:
        if len(run.workers) < 2:
            continue
        seconds: dict[tuple[str, str, int, int], dict[int, float]] = defaultdict(dict)
        for receipt in run.receipts:
            for event in receipt.events:
                if event.name not in _SPREAD_OPS:
                    continue
                for index, busy in enumerate(_stretches(event)):
                    if busy > 0:
                        seconds[(receipt.worker, event.name, event.layer, index)][
                            receipt.step] = busy
        peers: dict[tuple[str, int, int, int], dict[str, float]] = defaultdict(dict)
        for (worker, op, layer, index), by_step in seconds.items():
            typical = float(np.median(list(by_step.values())))
            for step, value in by_step.items():
                peers[(op, layer, index, step)][worker] = value / typical
        for figures in peers.values():
            n = len(figures)
            if n < 2:
                continue
            mean = sum(figures.values()) / n
            for worker, figure in figures.items():
                residuals[(worker, len(run.workers))].append(
                    (figure - mean) / math.sqrt(1.0 - 1.0 / n))
    out: dict[str, dict[int, float]] = {}
    for (worker, active), values in sorted(residuals.items()):
        out.setdefault(worker, {})[active] = iqr_sigma(values)
    return out


def store_fit(runs: Sequence[PlanRun], kind: str) -> tuple[float, float]:
    """``(latency, bandwidth)`` of workspace accesses of `kind` ("read" or "write"):
    ``seconds = latency + bytes / bandwidth`` fitted (non-negative) to every access,
    each access's seconds taken as the median of the accesses of its size.

    Why the medians: the calibration runs repeat each access size many times, and
    on a busy host a few of them are preempted for 10-20 ms. Fitted as they came,
    those few set the constants: a ResNet-18 probe on a loaded 2-core machine fitted
    its writes at 24 MB/s, and the model charged its steps 42 ms of workspace I/O
    where they spent 6 ms (another probe's 4,320 writes: 214 us and 1.3 GB/s as they
    came, 111 us and 4.7 GB/s by the medians). How much accesses vary is the
    spread's to say (`access_spreads`), not the typical access's."""
    rows = np.array([(p.nbytes, p.seconds) for run in runs for r in run.receipts
                     for e in r.events for p in e.phases if p.kind == kind], float)
    if not len(rows):
        return 0.0, math.inf
    sizes, size_of, counts = np.unique(rows[:, 0], return_inverse=True, return_counts=True)
    medians = np.array([np.median(rows[size_of == i, 1]) for i in range(len(sizes))])
    weight = np.sqrt(counts)  # least squares over every access, each at its size's median
    design = np.stack([np.ones(len(sizes)), sizes], axis=1) * weight[:, None]
    latency, per_byte = nonneg_fit(design, medians * weight)
    if per_byte <= 0:  # all accesses alike: charge their median time per byte
        return float(latency), float(np.median(rows[:, 0] / np.maximum(rows[:, 1], 1e-9)))
    return float(latency), float(1.0 / per_byte)


#: Accesses `access_spreads` needs at one count of workers running for a figure.
MIN_ACCESSES = 8


def access_spreads(runs: Sequence[PlanRun], fits: dict[str, tuple[float, float]]
                   ) -> dict[int, float]:
    """Per number of workers running, how much one workspace access's seconds vary
    from access to access (the cost model's `StoreSpec.spread`).

    Each access's seconds over what its kind's fit (`store_fit`, ``fits[kind]``)
    gives for its bytes; at each step, over the median of that step's figures of the
    same kind, so that what moves every access of a step alike (the machine's drift)
    drops out. The spread is the interquartile range of the result over 1.349 (a
    normal's, in standard deviations). Counts whose runs made fewer than
    `MIN_ACCESSES` accesses get none."""
    figures: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        by_step: dict[tuple[int, str], list[float]] = defaultdict(list)
        for receipt in run.receipts:
            for event in receipt.events:
                for phase in event.phases:
                    if phase.kind in fits:
                        latency, bandwidth = fits[phase.kind]
                        fitted = latency + phase.nbytes / bandwidth
                        if fitted > 0:
                            by_step[(receipt.step, phase.kind)].append(phase.seconds / fitted)
        for values in by_step.values():
            typical = float(np.median(values))
            if typical > 0:
                figures[len(run.workers)] += [v / typical for v in values]
    return {active: iqr_sigma(values) for active, values in sorted(figures.items())
            if len(values) >= MIN_ACCESSES}


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
        by_round[run.round] += [_busy(e) for r in steady_receipts(run) for e in r.events
                                if e.name == DENSE_HEAD]
    return estimate([by_round[r] for r in sorted(by_round)])
