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
traffic included, stays least, and may leave a device out.  The even and the
calibrated splits and every device alone are predicted too and the fastest is
taken, so the model's choice is never predicted worse than the alternatives nor
than the best single device; every prediction is recorded with the run.

On this machine's CPU workers (one store, equal I/O per worker, slowness
emulated on compute only) proportional is already close to the optimum:
the model's split is predicted a few percent faster, within run-to-run noise
(``python -m benchmarks.prediction_error placement``); the gain is large where
per-shard costs do not scale with speed (``tests/test_prediction.py``).

The model's split gives every layer of a tied group (a residual sum's layers) one
row of counts (`pipeline.costmodel.splits`), as the engine needs.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pipeline.cluster.workers import ClusterWorker
from pipeline.config.run_config import RunConfig
from pipeline.costmodel import predict, split_kernels_minmax
from pipeline.placement.split import (ShardCost, align_to_quanta, pick_fastest,
                                      single_device_splits, split_even)
from pipeline.placement.ties import tie_counts
from pipeline.probe import (ClusterProbe, cached_probe, costmodel_network, links_key,
                            probe_workspace_dir)
from tasks.specs import NetworkSpec

__all__ = ["calibrated_split", "choose_split", "model_placement",
           "predicted_step"]


def predicted_step(probe: ClusterProbe, counts: list[list[int]]) -> float:
    """The model's step time on the first ``len(counts[0])`` probed workers with ``counts``."""
    active = len(counts[0])
    return predict("kernel", probe.costmodel_network(), probe.batch, probe.device_specs(active),
                   store=probe.store_spec(active),
                   options=probe.kernel_options(kernel_counts=counts)).step_time


def calibrated_split(probe: ClusterProbe, active: int) -> list[list[int]]:
    """What ``placement: calibrated`` would choose from the probe's speeds."""
    per_kernel = probe.calibration(active)
    names = [w.name for w in probe.workers[:active]]
    spec = probe.network_spec()
    costs = [[ShardCost(0.0, per_kernel[n][i]) for n in names] for i in range(len(spec.conv))]
    return tie_counts(spec, costs, probe.quanta, names).counts


def choose_split(probe: ClusterProbe, active: int | None = None) -> dict[str, Any]:
    """The split of the first ``active`` probed workers the model predicts fastest.

    Candidates: the min-max split (workers may get nothing), the calibrated and the
    even split, and every worker alone; so the chosen split is never predicted
    slower than the best single device.

    Returns
    -------
    dict
        ``kernel_split`` (the chosen counts), ``chosen`` (the candidate's name),
        ``predicted_step_time`` of the chosen, the best single device and its
        prediction, and ``alternatives`` (each candidate's split and prediction).
    """
    active = len(probe.workers) if active is None else active
    spec = probe.network_spec()
    quanta = probe.quanta
    names = [w.name for w in probe.workers[:active]]
    minmax = split_kernels_minmax(costmodel_network(spec), probe.batch,
                                  probe.device_specs(active), store=probe.store_spec(active),
                                  quantum=quanta, options=probe.kernel_options(), min_units=0)
    kernels = [layer.kernels for layer in spec.conv]
    candidates = {
        "minmax": [align_to_quanta(row, q) for row, q in zip(minmax, quanta)],
        "calibrated": calibrated_split(probe, active),
        "even": [split_even(k, active, q) for k, q in zip(kernels, quanta)],
        **single_device_splits(kernels, names),
    }
    times = {name: predicted_step(probe, counts) for name, counts in candidates.items()}
    choice = pick_fastest(candidates, times, tolerance=0.0)
    return {"kernel_split": choice.counts, **choice.record(names), "probe_key": probe.key}


def model_placement(client: Any, config: RunConfig, network: NetworkSpec,
                    workers: list[ClusterWorker]
                    ) -> tuple[list[list[int]], dict[str, list[float]], dict[str, Any]]:
    """``placement: model``: probe the workers (or reuse a cached probe), choose, record.

    Returns the counts, the probe's seconds per kernel per worker and the record
    for the run's attrs: the choice, every candidate's predicted step time and the
    probe itself.
    """
    dataset = config.built_dataset()
    links = links_key(config.cluster.link_rates())  # over links: probed across them
    probe = cached_probe(client, workers, network, config.train.batch,
                         config.channel_quanta(network), probe_workspace_dir(config), dataset,
                         links=links, output_root=config.output_dir if links else None,
                         batch_norm=config.train.batch_norm)
    choice = choose_split(probe)
    for layer, row in zip(network.conv, choice["kernel_split"]):
        assert sum(row) == layer.kernels and min(row) >= 0, (row, layer.kernels)
    return choice["kernel_split"], probe.calibration(), {**choice, "probe": asdict(probe)}
