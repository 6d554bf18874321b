"""Choosing a run's split in one pass: even, calibrated on the workers, by the
model, or recorded.

The split is chosen here, before the engine exists, and handed to the strategy as a
`Placement`: kernels of every conv layer per worker (`choose_kernel_split`) or
samples of every batch per worker (`choose_batch_split`). The config is read once, at
the top of each; the measuring is pipeline/placement/calibrate.py's and the arithmetic of
splits pipeline/placement/split.py's (pure). `calibrated` times every layer's
forward+backward on every worker at two shard sizes, fits each shard's fixed cost and
cost per kernel, and takes the fastest predicted of the even, proportional, min-max
and single-device splits (`pipeline.placement.split.choose_calibrated`); workers measured far
from the share they get are measured again at that share. `model` asks the
performance model (pipeline/placement/model_placement.py); `recorded` reuses a split given in
the config or kept by an earlier run, so a run can be repeated exactly. Workers left
with no kernels (or no samples) in every layer leave the run.
"""

from __future__ import annotations

import json
import os

from distributed import Client

from pipeline.placement.capacity import capacities_explained, worker_capacities
from pipeline.placement.calibrate import (Points, alike_groups, calibrate, calibrate_replicas,
                                          first_sizes, per_unit, pool_points, shard_costs)
from pipeline.cluster.workers import ClusterWorker
from pipeline.config.run_config import RunConfig
from pipeline.costmodel.memory import element_bytes
from pipeline.placement.memory_fit import MemoryModel, move_to_fit, refuse_overflow, split_peaks
from pipeline.placement.model_placement import model_placement
from pipeline.placement.split import (Placement, PlacementError, SplitChoice, choose_calibrated,
                                      merge_short_shares, split_even)
from pipeline.placement.ties import check_tied, tie_counts
from pipeline.probe.tables import model_network
from pipeline.engine.runner import TaskRunner
from pipeline.engine.stalls import StallWatch
from pipeline.cluster.worker_limits import worker_constants
from pipeline.config.schema import ConfigError
from tasks.specs import NetworkSpec, batch_norm_rows

#: A worker whose chosen share is this many times off the sizes it was timed at is
#: timed again at its share (small shards run far below a device's rate).
REMEASURE_FACTOR = 2.0


def choose_kernel_split(client: Client, config: RunConfig, strategy: MemoryModel,
                        network: NetworkSpec, workers: list[ClusterWorker], run_id: str,
                        master: int | None = 0) -> Placement:
    """The kernel split over `workers` that `config.placement` asks for, kept within
    every worker's memory under `strategy`'s count (`fit_memory`; `master`: the index
    of the worker with the dense head, None where it is not among `workers`)."""
    placement = _kernel_split(client, config, network, workers, run_id)
    placement = fit_memory(client, config, strategy, network, workers, placement,
                           config.channel_quanta(network), master, network.tied_groups())
    check_tied(network, placement.counts)
    return placement


def _kernel_split(client: Client, config: RunConfig, network: NetworkSpec,
                  workers: list[ClusterWorker], run_id: str) -> Placement:
    quanta = config.channel_quanta(network)
    layers = network.conv
    if config.placement == "recorded":
        names = [w.name for w in workers]
        counts = check_recorded_split(config, network, "kernel_split",
                                      recorded_counts(config, names, "kernel_split"),
                                      len(workers))
        return Placement("recorded", counts)
    if config.placement == "even" or len(workers) == 1:
        counts = [split_even(s.kernels, len(workers), q) for s, q in zip(layers, quanta)]
        return Placement("even" if len(workers) > 1 else "single", counts)
    if config.placement == "model":
        counts, calibration, record = model_placement(client, config, network, workers)
        return Placement("model", counts, calibration, record)
    return calibrated_kernel_split(_runner(client, config, workers, run_id), network,
                                config.train.batch, quanta)


def _runner(client: Client, config: RunConfig, workers: list[ClusterWorker], run_id: str
            ) -> TaskRunner:
    """The calibration's tasks, stall-watched as the run's steps are
    (`cluster.stall_timeout`): a worker frozen while it calibrates is lost, not waited
    for."""
    return TaskRunner(client, workers, run_id, watch=StallWatch(config.cluster.stall_timeout))


def choose_batch_split(client: Client, config: RunConfig, strategy: MemoryModel,
                       network: NetworkSpec, workers: list[ClusterWorker], run_id: str
                       ) -> Placement:
    """Samples of each step's batch per worker (`data`, `hybrid`): even, calibrated
    (the same choice as kernels, a sample for a kernel) or recorded; kept within
    every worker's memory under `strategy`'s count (`fit_memory`). With
    ``train.batch_norm: local`` every replica gets no samples or at least
    `least_replica_rows` (`merge_short_shares`; a recorded split that breaks this is
    refused)."""
    least = least_replica_rows(config, network)
    placement = _batch_split(client, config, network, workers, run_id, least)
    return fit_memory(client, config, strategy, network, workers, placement, [1], None, [[0]],
                      least)


def least_replica_rows(config: RunConfig, network: NetworkSpec) -> int:
    """The fewest samples a replica with any may hold: `batch_norm_rows` where each
    replica normalises over its own rows (``train.batch_norm: local``), else 1 (sync
    batch norm normalises over the whole batch, whose size the config's check keeps
    large enough: `pipeline.preflight.check_batch_rows`)."""
    return batch_norm_rows(network) if config.train.batch_norm == "local" else 1


def with_rows_merged(placement: Placement, least: int, names: list[str]) -> Placement:
    """`placement` (one row: samples per worker `names`) with its short shares merged
    (`merge_short_shares`); where that moved any, the split before it is kept in the
    record (``batch_norm_merged``), which says why a worker left
    (`pipeline.records.summary.left_out_lines`)."""
    row = placement.counts[0]
    merged = merge_short_shares(row, least)
    if merged == row:
        return placement
    record = {"least_rows": least, "split_before": [row], "workers": list(names)}
    return Placement(placement.method, [merged], placement.calibration,
                     {**placement.choice, "batch_norm_merged": record})


def _batch_split(client: Client, config: RunConfig, network: NetworkSpec,
                 workers: list[ClusterWorker], run_id: str, least: int) -> Placement:
    batch = config.train.batch
    names = [w.name for w in workers]
    if config.placement == "recorded":
        counts = check_recorded_split(config, network, "batch_split",
                                      recorded_counts(config, names, "batch_split"),
                                      len(workers))
        short = [k for k in counts[0] if 0 < k < least]
        if short:
            raise ConfigError(f"split_from: {counts[0]} gives a replica {short[0]} sample(s), "
                              "but with train.batch_norm: local each replica's batch norm "
                              f"needs at least {least} (its input is 1x1): give each worker "
                              f"none or at least {least}, or use train.batch_norm: sync")
        return Placement("recorded", counts)
    if config.placement == "even" or len(workers) == 1:
        return with_rows_merged(Placement("even" if len(workers) > 1 else "single",
                                          [split_even(batch, len(workers), 1)]), least, names)
    points, kinds = calibrate_replicas(_runner(client, config, workers, run_id), network,
                                       batch)
    groups = alike_groups(workers, kinds)
    costs = shard_costs(pool_points(points, groups), names, 1)
    choice = choose_calibrated([batch], costs, [1], names)
    return with_rows_merged(Placement("calibrated", choice.counts, per_unit(costs, names),
                                      calibration_record(choice, names, points, groups)),
                            least, names)


def fit_memory(client: Client, config: RunConfig, strategy: MemoryModel,
               network: NetworkSpec, workers: list[ClusterWorker], placement: Placement,
               quanta: list[int], master: int | None, tied: list[list[int]],
               least_rows: int = 1) -> Placement:
    """`placement` if every worker's predicted peak (pipeline.costmodel.memory) is
    within its capacity (pipeline.placement.capacity); else the split with units moved to
    workers with room (`pipeline.placement.memory_fit.move_to_fit`; the rows of each
    group of `tied` move together). A recorded split is repeated exactly or refused;
    a split that fits nowhere is refused (`MemoryRefused`, one line). A share the
    moves leave under `least_rows` is merged (`merge_short_shares`; 1: none is). The capacities
    and predicted peaks go into the placement's record (``memory``); for a network
    the memory count does not price, a note saying the check was skipped."""
    if not strategy.memory_model:  # a strategy the memory count lacks
        return placement
    capacities = worker_capacities(client, config.cluster, workers)
    if all(c == float("inf") for c in capacities):
        return placement
    names = [w.name for w in workers]
    peaks = split_peaks(strategy, model_network(config, network), config.train.batch,
                        element_bytes(network.dtype), master,
                        [w.device.startswith("cuda") for w in workers],
                        worker_constants(client, config.cluster, workers))
    counts = placement.counts
    margin = config.cluster.memory_margin
    moved = 0
    if config.placement == "recorded":
        refuse_overflow(peaks(counts), capacities, names, margin, recorded=True)
    else:
        with capacities_explained(config.cluster):
            fit = move_to_fit(counts, quanta, capacities, peaks, names, tied, margin)
        counts, moved = fit.counts, fit.moved
        merged = [merge_short_shares(row, least_rows) for row in counts]
        if merged != counts:  # the moves left a replica too few rows
            counts = merged
            refuse_overflow(peaks(merged), capacities, names, margin)
    record = {"capacity": [None if c == float("inf") else c for c in capacities],
              "predicted_peak": peaks(counts), "margin": margin, "units_moved": moved,
              "split_before": placement.counts if moved else None}
    return Placement(placement.method, counts, placement.calibration,
                     {**placement.choice, "memory": record})


def calibrated_kernel_split(runner: TaskRunner, network: NetworkSpec, batch: int,
                            quanta: list[int]) -> Placement:
    """`placement: calibrated` for kernels: measure, choose, and where a worker's
    chosen share is far from what it was timed at, time it there and choose again.
    Alike workers (`alike_groups`) share one cost per layer."""
    names = [w.name for w in runner.workers]
    kernels = [spec.kernels for spec in network.conv]
    sizes = first_sizes(network, batch, len(names), quanta)
    points, kinds = calibrate(runner, network, batch,
                              {(n, layer): s for n in names for layer, s in enumerate(sizes)})
    groups = alike_groups(runner.workers, kinds)
    pooled = pool_points(points, groups)
    costs = shard_costs(pooled, names, len(kernels))
    choice = tie_counts(network, costs, quanta, names)
    again = far_from_measured(choice.counts, pooled, names)
    if again:
        extra, _ = calibrate(runner, network, batch,
                             {(n, layer): again.get((n, layer), [sizes[layer][-1]])
                              for n in names for layer in range(len(kernels))},
                             round_name="-again")
        for (name, layer) in again:
            points[name][layer] += extra[name][layer]
        costs = shard_costs(pool_points(points, groups), names, len(kernels))
        choice = tie_counts(network, costs, quanta, names)
    return Placement("calibrated", choice.counts, per_unit(costs, names),
                     calibration_record(choice, names, points, groups))


def calibration_record(choice: SplitChoice, names: list[str], points: Points,
                       groups: list[list[str]]) -> dict:
    """What a calibrated placement keeps: the choice, the points as timed, and the
    groups of alike workers that shared a cost."""
    return {**choice.record(names), "calibration_points": points,
            "alike_workers": [group for group in groups if len(group) > 1]}


def far_from_measured(counts: list[list[int]], points: Points, names: list[str]
                      ) -> dict[tuple[str, int], list[int]]:
    """The (worker, layer) shares more than `REMEASURE_FACTOR` away from every size the
    worker was timed at for that layer, with the size to time: its share."""
    again = {}
    for layer, row in enumerate(counts):
        for name, count in zip(names, row):
            measured = [int(k) for k, _ in points[name][layer]]
            if count and not any(k / REMEASURE_FACTOR <= count <= k * REMEASURE_FACTOR
                                 for k in measured):
                again[(name, layer)] = [count]
    return again


def recorded_summary(source: str, key: str | None) -> tuple[str, dict]:
    """The summary.json that `split_from` names (a run directory or the file itself)
    and its path; ConfigError if it cannot be read or (`key` given: ``kernel_split``
    or ``batch_split``) records no such split with its workers. Needs only the file,
    so `--check` asks it too (`pipeline.preflight.check_split_source`)."""
    path = os.path.join(source, "summary.json") if os.path.isdir(source) else source
    try:
        with open(path, encoding="utf-8") as handle:
            summary = json.load(handle)
    except (OSError, ValueError) as error:
        raise ConfigError(f"split_from: cannot read a run summary at {path} "
                          f"({type(error).__name__})") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"split_from: cannot read a run summary at {path} "
                          "(not a JSON object)")
    if key is not None and (key not in summary or "split_workers" not in summary):
        raise ConfigError(f"split_from: {path} records no {key} with its workers "
                          f"(a {summary.get('strategy')} run, or an older one)")
    return path, summary


def recorded_counts(config: RunConfig, names: list[str], key: str) -> list[list[int]]:
    """The split `placement: recorded` reuses over the workers `names`: `split_from`'s
    counts as given (one per worker, in order), or those in the summary.json of the
    run directory it names, matched to this run's workers by name (a worker the
    earlier run left out, or never had, gets nothing). `key` is the summary's
    split: ``kernel_split`` (one row per layer) or ``batch_split`` (one row)."""
    source = config.split_from
    if not isinstance(source, str):
        return [list(row) for row in source or []]
    path, summary = recorded_summary(source, key)
    rows = summary[key] if key == "kernel_split" else [summary[key]]
    recorded = summary["split_workers"]
    if any(len(row) != len(recorded) for row in rows):
        raise ConfigError(f"split_from: {path}'s {key} has {len(rows[0])} count(s) for the "
                          f"{len(recorded)} worker(s) of its split_workers ("
                          f"{', '.join(recorded)}): give the split itself, a count per "
                          "worker of this run (split_from=[[...]])")
    missing = [n for n, count in zip(recorded, zip(*rows)) if any(count) and n not in names]
    if missing:
        raise ConfigError(f"split_from: {path} gave work to {', '.join(missing)}, which "
                          f"this run does not have (its workers: {', '.join(names)})")
    return [[row[recorded.index(n)] if n in recorded else 0 for n in names] for row in rows]


def check_recorded_split(config: RunConfig, network: NetworkSpec, key: str,
                         counts: list[list[int]], workers: int | None) -> list[list[int]]:
    """`check_recorded` for the strategy's split, `key` (``kernel_split``: a row per
    conv layer, whose tied layers must split alike; ``batch_split``: the batch's row),
    over `workers` (None: not known yet). The placement and `--check`
    (`pipeline.preflight.check_split_source`) both ask it, so they refuse alike."""
    if key != "kernel_split":
        batch = config.train.batch
        return check_recorded(counts, [batch], workers, [f"the batch's {batch} samples"])
    layers = network.conv
    counts = check_recorded(counts, [s.kernels for s in layers], workers,
                            [f"conv layer {l}'s {s.kernels} kernels"
                             for l, s in enumerate(layers)])
    try:
        check_tied(network, counts)
    except PlacementError as untied:
        raise ConfigError(f"split_from: {untied}") from None
    return counts


def check_recorded(counts: list[list[int]], totals: list[int], workers: int | None,
                   rows: list[str]) -> list[list[int]]:
    """The recorded split, if it fits this run: one row per layer (or the batch), one
    count per worker (`workers`; None: any number), each row adding up; `rows` names
    what each row splits, for the message. Any counts will do, channel quanta or not: a checkpoint is chunked at its
    split's boundaries (`KernelLayout.checkpoint_chunks`), so no two shards ever share
    a chunk."""
    if len(counts) != len(totals):
        raise ConfigError(f"split_from: {len(counts)} row(s), but this run splits "
                          f"{len(totals)}: {', '.join(rows)}")
    for row, total, what in zip(counts, totals, rows):
        if workers is not None and len(row) != workers:
            problem = f"{len(row)} count(s), but this run has {workers} worker(s)"
        elif min(row) < 0:
            problem = "a negative count"
        elif sum(row) != total:
            problem = f"they add up to {sum(row)}"
        else:
            continue
        raise ConfigError(f"split_from: {row} splits {what}: {problem}")
    return counts
