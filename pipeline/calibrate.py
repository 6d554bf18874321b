"""Choosing the split of a run: even, calibrated on the workers, by the model, or recorded.

The split is chosen here, before the engine exists, and handed to it as a
`Placement`. `calibrated` times every layer's forward+backward on every worker (all
at once, as they will run) at two shard sizes, fits each shard's fixed cost and cost
per kernel, and takes the fastest predicted of the even, proportional, min-max and
single-device splits (`pipeline.placement.choose_calibrated`); workers measured far
from the share they get are measured again at that share. `model` asks the
performance model (pipeline/model_placement.py); `recorded` reuses a split given in
the config or kept by an earlier run, so a run can be repeated exactly. Workers
left with no kernels (or no samples) in every layer leave the run.
"""

from __future__ import annotations

import json
import os

from distributed import Client

from pipeline.cluster import WorkerSlot
from pipeline.config import RunConfig
from pipeline.model_placement import model_placement
from pipeline.placement import (Placement, ShardCost, calibration_kernels,
                                choose_calibrated, fit_shard_cost, rough_seconds, split_even)
from pipeline.runner import TaskRunner
from pipeline.schema import ConfigError
from tasks.conv_shard import calibrate_layer
from tasks.data_ops import calibrate_replica
from tasks.specs import NetworkSpec

#: A worker whose chosen share is this many times off the sizes it was timed at is
#: timed again at its share (small shards run far below a device's rate).
REMEASURE_FACTOR = 2.0

#: Rounds per shard size that must agree (within 10 %) after the warm-up; more are
#: timed, up to three times as many, until they do (`WorkerProfile.time_rounds`).
STABLE_ROUNDS = 3

Points = dict[str, list[list[list[float]]]]  # worker -> layer -> [[kernels, seconds], ...]


def calibrate(runner: TaskRunner, network: NetworkSpec, batch: int,
              sizes: dict[tuple[str, int], list[int]], round_name: str = "") -> Points:
    """Median seconds of each layer's forward, backward and update per worker, at
    the shard sizes asked for (``sizes[(worker name, layer)]``); all workers
    measure at once, as they will run during training. `round_name` keeps the
    task keys of a second round apart from the first's."""
    futures = {}
    for layer, spec in enumerate(network.conv):
        for index, slot in enumerate(runner.workers):
            futures[(slot.name, layer)] = runner.submit(
                calibrate_layer, index, spec, batch, sizes[(slot.name, layer)], network.dtype,
                layer > 0, STABLE_ROUNDS, name=f"calibrate{round_name}-{layer}-{slot.name}")
    results = runner.gather(list(futures.values()), "calibration")
    points: Points = {slot.name: [[] for _ in network.conv] for slot in runner.workers}
    for (name, layer), result in zip(futures, results):
        points[name][layer] = result["points"]
    return points


def first_sizes(network: NetworkSpec, batch: int, workers: int, quanta: list[int]
                ) -> list[list[int]]:
    """Per layer, the shard sizes every worker is timed at first: one quantum and its
    share of an even split (halved while a round would take over half a second)."""
    return [sorted({min(q, spec.kernels), calibration_kernels(spec, batch, workers, q)})
            for spec, q in zip(network.conv, quanta)]


def shard_costs(points: Points, names: list[str], layers: int) -> list[list[ShardCost]]:
    """``costs[layer][worker]`` fitted to the measured points."""
    return [[fit_shard_cost([(int(k), t) for k, t in points[name][layer]]) for name in names]
            for layer in range(layers)]


def per_unit(costs: list[list[ShardCost]], names: list[str]) -> dict[str, list[float]]:
    """Seconds per kernel (or sample) of every layer, per worker name: what the run
    records as its calibration."""
    return {name: [row[d].per_kernel for row in costs] for d, name in enumerate(names)}


def calibrated_placement(runner: TaskRunner, network: NetworkSpec, batch: int,
                         quanta: list[int]) -> Placement:
    """`placement: calibrated` (see the module doc)."""
    names = [w.name for w in runner.workers]
    kernels = [spec.kernels for spec in network.conv]
    sizes = first_sizes(network, batch, len(names), quanta)
    points = calibrate(runner, network, batch,
                       {(n, layer): s for n in names for layer, s in enumerate(sizes)})
    costs = shard_costs(points, names, len(kernels))
    choice = choose_calibrated(kernels, costs, quanta, names)
    again = {}
    for layer, row in enumerate(choice.counts):
        for name, count in zip(names, row):
            measured = [int(k) for k, _ in points[name][layer]]
            if count and not any(k / REMEASURE_FACTOR <= count <= k * REMEASURE_FACTOR
                                 for k in measured):
                again[(name, layer)] = [count]
    if again:
        extra = calibrate(runner, network, batch,
                          {(n, layer): again.get((n, layer), [sizes[layer][-1]])
                           for n in names for layer in range(len(kernels))},
                          round_name="-again")
        for (name, layer) in again:
            points[name][layer] += extra[name][layer]
        costs = shard_costs(points, names, len(kernels))
        choice = choose_calibrated(kernels, costs, quanta, names)
    return Placement("calibrated", choice.counts, per_unit(costs, names),
                     {**choice.record(names), "calibration_points": points})


def recorded_counts(config: RunConfig, names: list[str], key: str) -> list[list[int]]:
    """The split `placement: recorded` reuses over the workers `names`: `split_from`'s
    counts as given (one per worker, in order), or those in the summary.json of the
    run directory it names, matched to this run's workers by name (a worker the
    earlier run left out, or never had, gets nothing). `key` is the summary's
    split: ``kernel_split`` (one row per layer) or ``batch_split`` (one row)."""
    source = config.split_from
    if not isinstance(source, str):
        return [list(row) for row in source or []]
    path = os.path.join(source, "summary.json") if os.path.isdir(source) else source
    try:
        with open(path, encoding="utf-8") as handle:
            summary = json.load(handle)
    except (OSError, ValueError) as error:
        raise ConfigError(f"split_from: cannot read a run summary at {path} "
                          f"({type(error).__name__})") from None
    if key not in summary or "split_workers" not in summary:
        raise ConfigError(f"split_from: {path} records no {key} with its workers "
                          f"(a {summary.get('strategy')} run, or an older one)")
    rows = summary[key] if key == "kernel_split" else [summary[key]]
    recorded = summary["split_workers"]
    missing = [n for n, count in zip(recorded, zip(*rows)) if any(count) and n not in names]
    if missing:
        raise ConfigError(f"split_from: {path} gave work to {', '.join(missing)}, which "
                          f"this run does not have (its workers: {', '.join(names)})")
    return [[row[recorded.index(n)] if n in recorded else 0 for n in names] for row in rows]


def check_recorded(counts: list[list[int]], totals: list[int], workers: int, what: str,
                   quanta: list[int] | None = None) -> list[list[int]]:
    """The recorded split, if it fits this run: one row per layer (or the batch),
    one count per worker, each row adding up, and every shard but the last holder's
    whole channel quanta (shards own whole chunks of the workspace and checkpoints:
    two shards in one chunk would overwrite each other's part of it)."""
    if len(counts) != len(totals):
        raise ConfigError(f"split_from: {len(counts)} rows, but this run has {len(totals)} "
                          f"{what}")
    for layer, (row, total) in enumerate(zip(counts, totals)):
        if len(row) != workers or sum(row) != total or min(row) < 0:
            raise ConfigError(f"split_from: {row} does not split {total} {what} over this "
                              f"run's {workers} worker(s)")
        held = [k for k in row if k]
        if quanta and any(k % quanta[layer] for k in held[:-1]):
            raise ConfigError(f"split_from: {row}: every shard but the last must hold whole "
                              f"channel quanta of {quanta[layer]} (workspace.channel_quantum)")
    return counts


def choose_placement(client: Client, config: RunConfig, network: NetworkSpec,
                     workers: list[WorkerSlot], run_id: str) -> Placement:
    """The kernel split over `workers` that `config.placement` asks for."""
    quanta = config.channel_quanta(network)
    layers = network.conv
    if config.placement == "recorded":
        names = [w.name for w in workers]
        counts = check_recorded(recorded_counts(config, names, "kernel_split"),
                                [s.kernels for s in layers],
                                len(workers), "kernel counts for its conv layers", quanta)
        return Placement("recorded", counts)
    if config.placement == "even" or len(workers) == 1:
        counts = [split_even(s.kernels, len(workers), q) for s, q in zip(layers, quanta)]
        return Placement("even" if len(workers) > 1 else "single", counts)
    if config.placement == "model":
        counts, calibration, record = model_placement(client, config, network, workers)
        return Placement("model", counts, calibration, record)
    return calibrated_placement(TaskRunner(client, workers, run_id), network,
                                config.train.batch, quanta)


def replica_rows(network: NetworkSpec, batch: int, workers: int, budget_s: float = 0.5) -> int:
    """Samples a worker times a replica on: its even share, halved until a round of the
    conv layers fits the budget."""
    rows = max(1, -(-batch // workers))
    while rows > 1 and sum(rough_seconds(layer, rows, layer.kernels)
                           for layer in network.conv) > budget_s:
        rows = max(1, rows // 2)
    return rows


def calibrate_replicas(runner: TaskRunner, network: NetworkSpec, batch: int) -> Points:
    """Seconds of a whole replica's step at two batch shares, per worker name (all at
    once): ``{name: [[[rows, seconds], [rows, seconds]]]}``."""
    rows = replica_rows(network, batch, len(runner.workers))
    sizes = sorted({max(1, rows // 4), rows})
    points: Points = {slot.name: [[]] for slot in runner.workers}
    for size in sizes:
        futures = [runner.submit(calibrate_replica, index, network, size,
                                 name=f"calibrate-replica-{slot.name}-{size}")
                   for index, slot in enumerate(runner.workers)]
        for slot, result in zip(runner.workers, runner.gather(futures, "calibration")):
            points[slot.name][0].append([result["rows"], result["seconds"]])
    return points


def choose_batch_shares(client: Client, config: RunConfig, network: NetworkSpec,
                        workers: list[WorkerSlot], run_id: str) -> Placement:
    """Samples of each step's batch per worker (`data`, `hybrid`): even, calibrated
    (the same choice as kernels, a sample for a kernel) or recorded."""
    batch = config.train.batch
    names = [w.name for w in workers]
    if config.placement == "recorded":
        counts = check_recorded(recorded_counts(config, names, "batch_split"), [batch],
                                len(workers), "batch (samples)")
        return Placement("recorded", counts)
    if config.placement == "even" or len(workers) == 1:
        return Placement("even" if len(workers) > 1 else "single",
                         [split_even(batch, len(workers), 1)])
    points = calibrate_replicas(TaskRunner(client, workers, run_id), network, batch)
    costs = shard_costs(points, names, 1)
    choice = choose_calibrated([batch], costs, [1], names)
    return Placement("calibrated", choice.counts, per_unit(costs, names),
                     {**choice.record(names), "calibration_points": points})
