"""`data` and `hybrid`: every worker a replica of the conv layers with a share of the
batch; `hybrid` (Krizhevsky's "one weird trick") also splits every dense layer's
neurons over the workers.

The batch shares come from `pipeline.placement.split_choice.choose_batch_split` (even,
calibrated or recorded; the model places kernels only); workers given no sample
leave the run. Worker side: tasks/data_ops.py and tasks/hybrid_ops.py; layouts and
exchanged slices: tasks/replica_layout.py; batch norm over the replicas
(``train.batch_norm``): tasks/sync_batch_norm.py.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from distributed import Client

from pipeline.placement.split_choice import choose_batch_split
from pipeline.cluster.workers import ClusterWorker
from pipeline.config.run_config import RunConfig
from pipeline.costmodel import (IDEAL_LINK, DeviceSpec, LinkSpec, Network, Options, Prediction,
                                StoreSpec)
from pipeline.costmodel.memory import DEFAULT_CONSTANTS, DevicePeak, Footprint, MemoryConstants
from pipeline.costmodel.replica_memory import (hybrid_device_peak, replica_device_peak,
                                               replica_footprint)
from pipeline.costmodel.strategies import MODELS
from pipeline.placement.split import Placement, split_even
from pipeline.probe import ClusterProbe, MasterProbe
from pipeline.records.record import jsonable
from pipeline.config.schema import ConfigError, to_dict
from pipeline.engine.step_engine import RunPlan
from pipeline.strategies.base import PLACEMENTS, Strategy
from tasks.data_ops import DATA_SIDE
from tasks.hybrid_ops import HYBRID_SIDE
from tasks.layout import Layout
from tasks.replica_layout import DataLayout, HybridLayout, dense_widths, split_counts
from tasks.specs import Arithmetic, NetworkSpec


def has_batch_norm(config: RunConfig) -> bool:
    """Whether the config's network has a batch norm (which does not depend on the
    image size: built at a size every network fits; a network that does not build is
    named by the run itself)."""
    try:
        return any(layer.batch_norm for layer in config.network_spec((3, 256, 256)).conv)
    except ConfigError:
        return False


class DataStrategy(Strategy):
    """Data parallel: a full replica per worker, gradients summed through the workspace."""

    name = "data"
    arithmetic_settings = ("train.batch_norm",)
    placements = tuple(p for p in PLACEMENTS if p != "model")
    split_key = "batch_split"
    worker_side = DATA_SIDE
    memory_model = True
    split_unit = "sample"
    #: The memory count of one of its devices (pipeline/costmodel/memory.py).
    device_peak: DevicePeak = staticmethod(replica_device_peak)

    def plan(self, client: Client, config: RunConfig, network: NetworkSpec,
             offered: list[ClusterWorker], run_id: str) -> RunPlan:
        if config.placement != "recorded":  # which may leave workers out: asked of the rest
            self.check_workers(config, network, len(offered))
        placement = choose_batch_split(client, config, self, network, list(offered), run_id)
        gone = placement.left_out([w.name for w in offered])
        workers = [w for w in offered if w.name not in gone]
        shares = [count for w, count in zip(offered, placement.counts[0]) if w.name not in gone]
        layout = self.layout(config, network, [w.name for w in workers], shares)
        return self.make_plan(config, workers, layout, placement)

    def check(self, config: RunConfig) -> None:
        """Besides the placement: sync batch norm has the replicas exchange statistics
        inside one op, which `workspace.sync: scheduler` cannot order
        (pipeline/engine/step_graph.py)."""
        super().check(config)
        if (config.train.batch_norm == "sync" and config.workspace.sync == "scheduler"
                and has_batch_norm(config)):
            raise ConfigError("train.batch_norm: sync has the replicas exchange batch norm's "
                              "statistics inside one op, which workspace.sync: scheduler "
                              "cannot order (it cuts tasks at every read): use "
                              "workspace.sync: markers, or train.batch_norm: local")

    def layout(self, config: RunConfig, network: NetworkSpec, workers: list[str],
               shares: list[int]) -> Layout:
        """Its layout over `workers` with these batch shares."""
        return DataLayout(tuple(workers), tuple(shares), batch_norm=config.train.batch_norm)

    def split_of(self, layout: Layout, placement: Placement) -> dict[str, Any]:
        """Samples of each batch per worker of the run (`split_workers`), as `kernel`
        records its kernels: a worker left out (no samples) has no column."""
        assert isinstance(layout, DataLayout | HybridLayout)
        return {"batch_split": list(layout.shares)}

    def record_attrs(self, config: RunConfig) -> dict[str, Any]:
        return {"gradient_reduction": "workspace: reduce-scatter by range ownership, "
                                      "then all-gather",
                "batch_norm": config.train.batch_norm}

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        return MODELS[self.name](network, batch, list(devices), link, store, options)

    def peak_memory(self, network: Network, batch: int,
                    split: Sequence[Sequence[int]] | None = None, s: int = 4,
                    master: int | None = 0, constants: MemoryConstants = DEFAULT_CONSTANTS,
                    gpu: Sequence[bool] | None = None) -> Footprint:
        """Each worker's replica on its rows of the batch (``[[rows per worker]]``)."""
        return replica_footprint(self.device_peak, network, batch, split[0] if split else None,
                                 s, constants, gpu)

    def predict_run(self, config: RunConfig, probe: ClusterProbe | MasterProbe,
                    network: Network, split: dict[str, Any]) -> Prediction:
        """The engine's replicas on the probed workers, with the recorded batch shares
        (an even split if none) and the run's batch norm (sync: its exchanges)."""
        probe = self.cluster_probe(probe)
        active = self.workers_used(config, probe)
        shares = split.get("batch_split") or split_even(config.train.batch, active, 1)
        if len(shares) != active:  # a recorded split that left workers out: they get 0
            names = [w.name for w in probe.workers[:active]]
            used = split.get("split_workers") or names[:len(shares)]
            shares = [shares[used.index(n)] if n in used else 0 for n in names]
        options = probe.kernel_options(batch_shares=shares, scheme=config.hybrid.scheme,
                                       dense_batch=config.hybrid.dense_batch,
                                       sync=config.workspace.sync,
                                       batch_norm=config.train.batch_norm)
        return self.model(network, config.train.batch, probe.device_specs(active), IDEAL_LINK,
                          probe.store_spec(active), options)

    def infeasible(self, batch: int, devices: int) -> str:
        if batch < devices:
            return (f"batch {batch} is smaller than the {devices} devices: every "
                    f"{self.name}-parallel replica needs at least one sample")
        return ""


class HybridStrategy(DataStrategy):
    """Conv layers data-parallel, dense layers split by neurons (docs/methods.md §2)."""

    name = "hybrid"
    arithmetic_settings = ("train.batch_norm", "hybrid.dense_batch", "hybrid.conv_lr_scaling")
    worker_side = HYBRID_SIDE
    device_peak: DevicePeak = staticmethod(hybrid_device_peak)

    def layout(self, config: RunConfig, network: NetworkSpec, workers: list[str],
               shares: list[int]) -> Layout:
        self.check_workers(config, network, len(workers))
        widths = [out for _in, out in dense_widths(network)]
        neurons = tuple(tuple(split_counts(width, len(workers))) for width in widths)
        return HybridLayout(tuple(workers), tuple(shares), neurons, config.hybrid.scheme,
                            config.hybrid.dense_batch, batch_norm=config.train.batch_norm)

    def check_workers(self, config: RunConfig, network: NetworkSpec, workers: int) -> None:
        """Every dense layer's neurons are split over the workers, at least one each."""
        widths = [out for _in, out in dense_widths(network)]
        narrow = widths.index(min(widths))
        if widths[narrow] < workers:
            field = (f"network.hidden.{narrow}" if narrow < len(network.hidden)
                     else "network.classes")
            raise ConfigError(f"{field}: strategy hybrid splits every dense layer's neurons "
                              f"over its workers, at least one each, and this layer has "
                              f"{widths[narrow]} for {workers} workers: widen it, or use fewer "
                              "workers (cluster.use_workers)")

    def arithmetic(self, config: RunConfig, workers: int) -> Arithmetic:
        """Krizhevsky scaled the conv layers' learning rate with the workers."""
        scaling = config.hybrid.conv_lr_scaling
        scale = {"none": 1.0, "linear": float(workers), "sqrt": math.sqrt(workers)}[scaling]
        return Arithmetic(config.optimizer_spec(), scale, config.train.check_replicas,
                          config.train.seed, config.data.augmentation(config.train.seed))

    def split_of(self, layout: Layout, placement: Placement) -> dict[str, Any]:
        assert isinstance(layout, HybridLayout)
        return {**super().split_of(layout, placement),
                "dense_split": [list(row) for row in layout.neurons]}

    def record_attrs(self, config: RunConfig) -> dict[str, Any]:
        return {**super().record_attrs(config), "hybrid": jsonable(to_dict(config.hybrid))}
