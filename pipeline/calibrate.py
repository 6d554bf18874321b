"""Choosing the kernel split of a run: even, calibrated on the workers, or by the model.

The split is chosen here, before the engine exists, and handed to it as a
`Placement`. `calibrated` times every layer's forward+backward on every worker (all
at once, as they will run) and shares each layer's kernels in proportion to the
measured speed where that clearly beats the even split (`split_calibrated`); `model` asks the performance model for the split that minimises the
predicted step (pipeline/model_placement.py).
"""

from __future__ import annotations

from distributed import Client

from pipeline.cluster import WorkerSlot
from pipeline.config import RunConfig
from pipeline.model_placement import model_placement
from pipeline.placement import (Placement, PlacementError, calibration_kernels, rough_seconds,
                                split_calibrated, split_even)
from pipeline.runner import TaskRunner
from pipeline.schema import ConfigError
from tasks.conv_shard import calibrate_layer
from tasks.replica_ops import calibrate_replica
from tasks.specs import NetworkSpec


def calibrate(runner: TaskRunner, network: NetworkSpec, batch: int, quanta: list[int]
              ) -> dict[str, list[float]]:
    """Seconds per kernel of every layer's forward, backward and update, per worker name.

    All workers measure at once, as they will run during training, at the share a
    worker gets of an even split (halved while a round would take over half a
    second), after a warm-up; the median of several rounds.
    """
    futures = {}
    workers = runner.workers
    for layer, spec in enumerate(network.conv):
        kernels = calibration_kernels(spec, batch, len(workers), quanta[layer])
        estimate = rough_seconds(spec, batch, kernels)
        repeats = 5 if estimate < 0.05 else 3 if estimate < 0.5 else 2
        for index, slot in enumerate(workers):
            futures[(slot.name, layer)] = runner.submit(
                calibrate_layer, index, spec, batch, kernels, network.dtype, layer > 0,
                repeats, name=f"calibrate-{layer}-{slot.name}")
    results = runner.gather(list(futures.values()), "calibration")
    per_kernel: dict[str, list[float]] = {slot.name: [] for slot in workers}
    for (name, _layer), result in zip(futures, results):
        per_kernel[name].append(result["seconds"] / result["kernels"])
    return per_kernel


def choose_placement(client: Client, config: RunConfig, network: NetworkSpec,
                     workers: list[WorkerSlot], run_id: str) -> Placement:
    """The kernel split over `workers` that `config.placement` asks for."""
    quanta = config.channel_quanta(network)
    layers = network.conv
    if config.placement == "even" or len(workers) == 1:
        counts = [split_even(s.kernels, len(workers), q) for s, q in zip(layers, quanta)]
        return Placement("even" if len(workers) > 1 else "single", counts)
    if config.placement == "model":
        counts, calibration, record = model_placement(client, config, network, workers)
        return Placement("model", counts, calibration, record)
    calibration = calibrate(TaskRunner(client, workers, run_id), network, config.train.batch,
                            quanta)
    counts = [split_calibrated(spec.kernels, [calibration[w.name][layer] for w in workers],
                               quanta[layer])
              for layer, spec in enumerate(layers)]
    return Placement("calibrated", counts, calibration)


def replica_rows(network: NetworkSpec, batch: int, workers: int, budget_s: float = 0.5) -> int:
    """Samples a worker times a replica on: its even share, halved until a round of the
    conv layers fits the budget."""
    rows = max(1, -(-batch // workers))
    while rows > 1 and sum(rough_seconds(layer, rows, layer.kernels)
                           for layer in network.conv) > budget_s:
        rows = max(1, rows // 2)
    return rows


def calibrate_replicas(runner: TaskRunner, network: NetworkSpec, batch: int
                       ) -> dict[str, list[float]]:
    """Seconds per sample of a whole replica's step, per worker name (all at once)."""
    rows = replica_rows(network, batch, len(runner.workers))
    futures = [runner.submit(calibrate_replica, index, network, rows,
                             name=f"calibrate-replica-{slot.name}")
               for index, slot in enumerate(runner.workers)]
    results = runner.gather(futures, "calibration")
    return {slot.name: [result["seconds"] / result["rows"]]
            for slot, result in zip(runner.workers, results)}


def choose_batch_shares(client: Client, config: RunConfig, network: NetworkSpec,
                        workers: list[WorkerSlot], run_id: str) -> Placement:
    """Samples of each step's batch per worker (`data`, `hybrid`): even or calibrated."""
    batch = config.train.batch
    try:
        if config.placement == "even" or len(workers) == 1:
            return Placement("even" if len(workers) > 1 else "single",
                             [split_even(batch, len(workers), 1)])
        calibration = calibrate_replicas(TaskRunner(client, workers, run_id), network, batch)
        shares = split_calibrated(batch, [calibration[w.name][0] for w in workers], 1)
    except PlacementError:
        raise ConfigError(f"train.batch: {batch} samples cannot feed {len(workers)} workers"
                          ) from None
    return Placement("calibrated", [shares], calibration)
