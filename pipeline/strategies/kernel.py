"""`kernel` (Marques et al.): every worker holds a share of every conv layer's
kernels; the master worker runs the dense head. `single` is its one-worker case.

The split comes from `pipeline.calibrate.choose_placement` (even, calibrated, by the
model, or recorded); workers it gives no kernel of any layer leave the run, the
master stays (a master outside the kernel workers holds none: `cluster.add_master`).
Worker side: tasks/kernel_ops.py; layout and exchanged slices: tasks/layout.py.
"""

from __future__ import annotations

from typing import Any, Sequence

from distributed import Client

from pipeline.calibrate import choose_placement
from pipeline.cluster import WorkerSlot, add_master
from pipeline.config import RunConfig
from pipeline.costmodel import DeviceSpec, LinkSpec, Network, Options, Prediction, StoreSpec
from pipeline.costmodel.strategies import MODELS
from pipeline.placement import Placement
from pipeline.engine import RunPlan
from pipeline.strategies.base import Strategy
from tasks.kernel_ops import KERNEL_SIDE
from tasks.layout import KernelLayout, Layout, layout_from_counts
from tasks.specs import NetworkSpec


class KernelStrategy(Strategy):
    """Kernel-parallel conv layers, dense head on a master (METHODS.md §1)."""

    name = "kernel"
    worker_side = KERNEL_SIDE

    def plan(self, client: Client, config: RunConfig, network: NetworkSpec,
             slots: list[WorkerSlot], run_id: str) -> RunPlan:
        workers, master = add_master(client, config.cluster, slots)
        if self.one_worker:  # the master alone
            workers, master = [workers[master]], 0
        conv_workers = workers[:len(slots)]  # a master added beyond them holds no kernels
        placement = choose_placement(client, config, network, conv_workers, run_id)
        names = [w.name for w in workers]
        gone = placement.left_out([w.name for w in conv_workers], master)
        padding = [0] * (len(workers) - len(conv_workers))  # a master holding no kernels
        counts = [[count for name, count in zip(names, row + padding) if name not in gone]
                  for row in placement.counts]
        master_name = names[master]
        workers = [w for w in workers if w.name not in gone]
        names = [w.name for w in workers]
        layout = layout_from_counts(names, counts, names.index(master_name))
        return self.make_plan(config, workers, layout, placement)

    def split_of(self, layout: Layout, placement: Placement) -> dict[str, Any]:
        """Kernels per layer and worker of the run (a master holding none included)."""
        assert isinstance(layout, KernelLayout)
        return {"kernel_split": layout.counts()}

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        return MODELS["kernel"](network, batch, list(devices), link, store, options)


class SingleStrategy(KernelStrategy):
    """The whole network on one worker (the master), through the same machinery."""

    name = "single"
    one_worker = True

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        return MODELS["single"](network, batch, list(devices), link, store, options)
