"""Measuring the workers before a split is chosen: each conv layer's shard timed on
every worker at chosen sizes, and a whole replica's step at two batch shares.

Only measuring lives here: every worker times at once, as they will run during
training, and the points become fitted shard costs (`shard_costs`). Workers that are
the same hardware as far as the run can tell (`alike_groups`) share one cost, fitted
to all their points (`pool_points`): what tells them apart is only which of them the
host's scheduler ran while they were timed. What to do with the costs, which split to
take, is decided in pipeline/placement/split_choice.py.
"""

from __future__ import annotations

from typing import Sequence

from distributed.comm import get_address_host

from pipeline.cluster.workers import ClusterWorker
from pipeline.placement.split import ShardCost, calibration_kernels, fit_shard_cost, rough_seconds
from pipeline.engine.runner import TaskRunner
from tasks.conv_shard import calibrate_layer
from tasks.data_ops import calibrate_replica
from tasks.specs import NetworkSpec, batch_norm_rows

#: Rounds per shard size that must agree (within 10 %) after the warm-up; more are
#: timed, up to three times as many, until they do (`WorkerProfile.time_rounds`).
STABLE_ROUNDS = 3

Points = dict[str, list[list[list[float]]]]  # worker -> layer -> [[kernels, seconds], ...]
#: What each worker said it is while it timed: name -> (device, torch threads, speed).
Kinds = dict[str, tuple[str, int, float]]


def _kind(result: dict) -> tuple[str, int, float]:
    return (str(result["device"]), int(result["threads"]), float(result["speed"]))


def calibrate(runner: TaskRunner, network: NetworkSpec, batch: int,
              sizes: dict[tuple[str, int], list[int]], round_name: str = ""
              ) -> tuple[Points, Kinds]:
    """Median seconds of each layer's forward, backward and update per worker, at
    the shard sizes asked for (``sizes[(worker name, layer)]``), and what each
    worker is; all workers measure at once, as they will run during training.
    `round_name` keeps the task keys of a second round apart from the first's."""
    futures = {}
    for layer, spec in enumerate(network.conv):
        for index, worker in enumerate(runner.workers):
            futures[(worker.name, layer)] = runner.submit(
                calibrate_layer, index, spec, batch, sizes[(worker.name, layer)], network.dtype,
                layer > 0, STABLE_ROUNDS, name=f"calibrate{round_name}-{layer}-{worker.name}")
    results = runner.gather(list(futures.values()), "calibration")
    points: Points = {worker.name: [[] for _ in network.conv] for worker in runner.workers}
    kinds: Kinds = {}
    for (name, layer), result in zip(futures, results):
        points[name][layer] = result["points"]
        kinds[name] = _kind(result)
    return points, kinds


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


def alike_groups(workers: Sequence[ClusterWorker], kinds: Kinds) -> list[list[str]]:
    """Names of workers that are the same hardware as far as a run can tell: the same
    host (address), and the same device, torch threads and emulated speed as each
    said while it timed (`kinds`); each group in worker order, groups in order of
    their first worker. Two GPUs are alike only under one device name.

    Why: such workers time the same shard differently only by which of them the
    host's scheduler happened to run. Two alike single-thread workers on this
    project's 2-core machine were timed up to 30 % apart for a whole calibration,
    either way round; four on two cores gave one of them 1.7x an even share of the
    paper network's kernels (and of its memory) for a split no faster. Workers behind
    their own links each have their own address, so they stay apart.
    """
    groups: dict[tuple, list[str]] = {}
    for worker in workers:
        key = (get_address_host(worker.address), kinds[worker.name])
        groups.setdefault(key, []).append(worker.name)
    return list(groups.values())


def pool_points(points: Points, groups: list[list[str]]) -> Points:
    """`points` with every worker of a group given all its group's points (per layer),
    so that `shard_costs` fits the group one cost. `points` is left as measured."""
    pooled: Points = {name: [list(layer) for layer in layers] for name, layers in points.items()}
    for group in groups:
        members = [name for name in group if name in points]
        if len(members) < 2:
            continue
        for layer in range(len(points[members[0]])):
            together = [point for name in members for point in points[name][layer]]
            for name in members:
                pooled[name][layer] = list(together)
    return pooled


def per_unit(costs: list[list[ShardCost]], names: list[str]) -> dict[str, list[float]]:
    """Seconds per kernel (or sample) of every layer, per worker name: what the run
    records as its calibration."""
    return {name: [row[d].per_kernel for row in costs] for d, name in enumerate(names)}


def replica_rows(network: NetworkSpec, batch: int, workers: int, budget_s: float = 0.5) -> int:
    """Samples a worker times a replica on: its even share, halved until a round of the
    conv layers fits the budget, never below `batch_norm_rows` (`replica_sizes`)."""
    least = batch_norm_rows(network)
    rows = max(least, -(-batch // workers))
    while rows > least and sum(rough_seconds(layer, rows, layer.kernels)
                               for layer in network.conv) > budget_s:
        rows = max(least, rows // 2)
    return rows


def replica_sizes(network: NetworkSpec, batch: int, workers: int) -> list[int]:
    """The two batch shares a replica is timed at: `replica_rows` and a quarter of it,
    neither below `batch_norm_rows`.

    Why the floor: the timing trains the network as it is (`tasks.data_ops.time_replica`,
    batch norm over the rows timed), and where a batch norm's input is 1x1 one row is
    one value per channel, which PyTorch refuses: a quarter of a 13-sample batch's
    share over 3 workers is one row, and ResNet-18 on 32-pixel images failed its
    calibration on every worker. Where the run gives a worker one row (synchronised
    batch norm normalises over the whole batch), its cost is read off the line fitted
    through the sizes timed."""
    rows = replica_rows(network, batch, workers)
    return sorted({max(batch_norm_rows(network), rows // 4), rows})


def calibrate_replicas(runner: TaskRunner, network: NetworkSpec, batch: int
                       ) -> tuple[Points, Kinds]:
    """Seconds of a whole replica's step at two batch shares (`replica_sizes`), per
    worker name (all at once): ``{name: [[[rows, seconds], [rows, seconds]]]}``."""
    points: Points = {worker.name: [[]] for worker in runner.workers}
    kinds: Kinds = {}
    for size in replica_sizes(network, batch, len(runner.workers)):
        futures = [runner.submit(calibrate_replica, index, network, size,
                                 name=f"calibrate-replica-{worker.name}-{size}")
                   for index, worker in enumerate(runner.workers)]
        for worker, result in zip(runner.workers, runner.gather(futures, "calibration")):
            points[worker.name][0].append([result["rows"], result["seconds"]])
            kinds[worker.name] = _kind(result)
    return points, kinds
