"""`placement: model`: kernel counts that minimise the model's predicted step.

Proportional placement shares each layer's kernels in proportion to measured
speed.  That ignores what a shard pays whatever its size and whatever the
device's speed (reading the whole layer input, writing a full-size partial
gradient, task latency; and a compute time far from linear in the kernel
count: a shard of 4 kernels costs nearly as much as one of 16 on a CPU), so
where those matter a slow device ends up the slowest.  Here the probe of the cluster
(:mod:`pipeline.probe`: shard times at the real shapes, store and Dask
costs) feeds :func:`pipeline.costmodel.split_kernels_minmax`, which hands out
quanta one at a time to the device whose predicted forward + backward time,
traffic included, stays least.  The even and the calibrated splits are
predicted too and the best of the three is taken, so the model's choice is
never predicted worse than the alternatives; all three predictions are
recorded with the run.

On this machine's CPU workers (one store, equal I/O per worker, slowness
emulated on compute only) proportional is already close to the optimum:
the model's split is predicted a few percent faster, within run-to-run noise
(``benchmarks/prediction_error.py placement``); the gain is large where
per-shard costs do not scale with speed (``tests/test_prediction.py``).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any

from pipeline.cluster import WorkerSlot
from pipeline.config import RunConfig
from pipeline.costmodel import predict, split_kernels_minmax
from pipeline.placement import _units, split_calibrated, split_even
from pipeline.probe import ClusterProbe, cached_probe, costmodel_network
from tasks.specs import NetworkSpec

__all__ = ["align_to_quanta", "calibrated_split", "choose_split", "model_placement",
           "predicted_step"]


def align_to_quanta(row: list[int], quantum: int) -> list[int]:
    """Move a layer's short unit (if any) to the last worker, keeping each one's quanta.

    Shards are contiguous in worker order and must start on a chunk boundary,
    so only the last shard may hold a partial quantum.
    """
    shares = [math.ceil(k / quantum) for k in row]
    units = _units(sum(row), quantum)
    counts, position = [], 0
    for share in shares:
        counts.append(sum(units[position:position + share]))
        position += share
    return counts


def predicted_step(probe: ClusterProbe, counts: list[list[int]]) -> float:
    """The model's step time on the first ``len(counts[0])`` probed workers with ``counts``."""
    active = len(counts[0])
    return predict("kernel", probe.costmodel_network(), probe.batch, probe.device_specs(active),
                   store=probe.store_spec(),
                   options=probe.kernel_options(kernel_counts=counts)).step_time


def calibrated_split(probe: ClusterProbe, active: int) -> list[list[int]]:
    """What ``placement: calibrated`` chooses, from the probe's speeds at the even share."""
    per_kernel = probe.calibration(active)
    names = [w.name for w in probe.workers[:active]]
    return [split_calibrated(layer.kernels, [per_kernel[n][i] for n in names], q)
            for i, (layer, q) in enumerate(zip(probe.network_spec().conv, probe.quanta))]


def choose_split(probe: ClusterProbe, active: int | None = None) -> dict[str, Any]:
    """The min-max split for the first ``active`` probed workers, and what it predicts.

    Returns
    -------
    dict
        ``kernel_split`` (the chosen counts), ``chosen`` (``minmax``,
        ``calibrated`` or ``even``), ``predicted_step_time`` of the chosen and
        ``alternatives`` (each candidate's split and predicted step time).
    """
    active = len(probe.workers) if active is None else active
    spec = probe.network_spec()
    quanta = probe.quanta
    devices = probe.device_specs(active)
    net = costmodel_network(spec)
    options = probe.kernel_options()
    minmax = split_kernels_minmax(net, probe.batch, devices, store=probe.store_spec(),
                                  quantum=quanta, options=options, min_units=1)
    minmax = [align_to_quanta(row, q) for row, q in zip(minmax, quanta)]
    candidates = {
        "minmax": minmax,
        "calibrated": calibrated_split(probe, active),
        "even": [split_even(layer.kernels, active, q) for layer, q in zip(spec.conv, quanta)],
    }
    times = {name: predicted_step(probe, counts) for name, counts in candidates.items()}
    chosen = min(times, key=lambda name: (times[name], name != "minmax"))
    return {"kernel_split": candidates[chosen], "chosen": chosen,
            "predicted_step_time": times[chosen],
            "alternatives": {name: {"kernel_split": candidates[name],
                                    "predicted_step_time": times[name]}
                             for name in candidates},
            "probe_key": probe.key}


def model_placement(client: Any, config: RunConfig, network: NetworkSpec,
                    workers: list[WorkerSlot]
                    ) -> tuple[list[list[int]], dict[str, list[float]], dict[str, Any]]:
    """``placement: model``: probe the workers (or reuse a cached probe), choose, record.

    Returns the counts, the probe's seconds per kernel per worker and the record
    for the run's attrs: the choice, every candidate's predicted step time and the
    probe itself.
    """
    dataset = config.dataset_path if os.path.exists(config.dataset_path) else None
    probe = cached_probe(client, workers, network, config.train.batch,
                         config.channel_quanta(network), config.workspace.path, dataset)
    choice = choose_split(probe)
    for layer, row in zip(network.conv, choice["kernel_split"]):
        assert sum(row) == layer.kernels and min(row) > 0, (row, layer.kernels)
    return choice["kernel_split"], probe.calibration(), {**choice, "probe": asdict(probe)}
