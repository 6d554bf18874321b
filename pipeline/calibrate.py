"""Choosing the kernel split of a run: even, calibrated on the workers, or by the model.

The split is chosen here, before the engine exists, and handed to it as a
`Placement`. `calibrated` times every layer's forward+backward on every worker (all
at once, as they will run) and shares each layer's kernels in proportion to the
measured speed; `model` asks the performance model for the split that minimises the
predicted step (pipeline/model_placement.py).
"""

from __future__ import annotations

from distributed import Client

from pipeline.cluster import WorkerSlot
from pipeline.config import RunConfig
from pipeline.model_placement import model_placement
from pipeline.placement import Placement, split_even, split_proportional
from pipeline.runner import TaskRunner
from tasks.conv_shard import calibrate_layer
from tasks.specs import NetworkSpec


def calibrate(runner: TaskRunner, network: NetworkSpec, batch: int, quanta: list[int]
              ) -> dict[str, list[float]]:
    """Seconds per kernel of every layer's forward+backward, per worker name.

    All workers measure at once, as they will run during training, on about a
    quarter of an even share of kernels at the real batch size and shapes.
    """
    futures = {}
    workers = runner.workers
    for layer, spec in enumerate(network.conv):
        share = spec.kernels / len(workers) / 4
        kernels = int(min(spec.kernels, max(quanta[layer], round(share))))
        for index, slot in enumerate(workers):
            futures[(slot.name, layer)] = runner.submit(
                calibrate_layer, index, spec, batch, kernels, network.dtype,
                needs_input_grad=layer > 0, name=f"calibrate-{layer}-{slot.name}")
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
    counts = [split_proportional(spec.kernels, [1.0 / calibration[w.name][layer]
                                                for w in workers], quanta[layer])
              for layer, spec in enumerate(layers)]
    return Placement("calibrated", counts, calibration)
