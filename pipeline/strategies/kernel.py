"""`kernel` (Marques et al.): every worker holds a share of every conv layer's
kernels; the master worker runs the dense head. `single` is its one-worker case.

The split comes from `pipeline.placement.split_choice.choose_kernel_split` (even, calibrated, by the
model, or recorded); workers it gives no kernel of any layer leave the run, the
master stays (a master outside the kernel workers holds none: `cluster.add_master`).
Worker side: tasks/kernel_ops.py; layout and exchanged slices: tasks/layout.py.
"""

from __future__ import annotations

from typing import Any, Sequence

from distributed import Client

from pipeline.placement.split_choice import choose_kernel_split
from pipeline.cluster.workers import ClusterWorker, add_master
from pipeline.config.run_config import RunConfig
from pipeline.costmodel import (IDEAL_LINK, DeviceSpec, LinkSpec, Network, Options, Prediction,
                                StoreSpec)
from pipeline.costmodel.memory import DEFAULT_CONSTANTS, Footprint, MemoryConstants
from pipeline.costmodel.kernel_memory import kernel_footprint
from pipeline.costmodel.strategies import MODELS
from pipeline.placement.model_placement import calibrated_split, choose_split
from pipeline.placement.split import Placement, PlacementError, split_even
from pipeline.probe import ClusterProbe, MasterProbe
from pipeline.engine.step_engine import RunPlan
from pipeline.strategies.base import Strategy
from tasks.kernel_ops import KERNEL_SIDE
from tasks.layout import KernelLayout, Layout, check_tied, layout_from_counts
from tasks.specs import NetworkSpec


class KernelStrategy(Strategy):
    """Kernel-parallel conv layers, dense head on a master (docs/methods.md §1)."""

    name = "kernel"
    arithmetic_settings = ()
    worker_side = KERNEL_SIDE
    memory_model = True

    def plan(self, client: Client, config: RunConfig, network: NetworkSpec,
             offered: list[ClusterWorker], run_id: str) -> RunPlan:
        workers, master = add_master(client, config.cluster, offered)
        if self.one_worker:  # the master alone
            workers, master = [workers[master]], 0
        conv_workers = workers[:len(offered)]  # a master added beyond them holds no kernels
        placement = choose_kernel_split(client, config, self, network, conv_workers, run_id,
                                        master if master < len(conv_workers) else None)
        names = [w.name for w in workers]
        gone = placement.left_out([w.name for w in conv_workers], master)
        padding = [0] * (len(workers) - len(conv_workers))  # a master holding no kernels
        counts = [[count for name, count in zip(names, row + padding) if name not in gone]
                  for row in placement.counts]
        master_name = names[master]
        workers = [w for w in workers if w.name not in gone]
        names = [w.name for w in workers]
        layout = layout_from_counts(names, counts, names.index(master_name))
        try:
            check_tied(layout, network)
        except ValueError as problem:
            raise PlacementError(f"placement {placement.method}: {problem}") from None
        return self.make_plan(config, workers, layout, placement)

    def split_of(self, layout: Layout, placement: Placement) -> dict[str, Any]:
        """Kernels per layer and worker of the run (a master holding none included)."""
        assert isinstance(layout, KernelLayout)
        return {"kernel_split": layout.counts()}

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        return MODELS["kernel"](network, batch, list(devices), link, store, options)

    def peak_memory(self, network: Network, batch: int,
                    split: Sequence[Sequence[int]] | None = None, s: int = 4,
                    master: int | None = 0, constants: MemoryConstants = DEFAULT_CONSTANTS,
                    gpu: Sequence[bool] | None = None) -> Footprint:
        """Each worker's shards (kernels ``[layer][worker]``), the master's dense head."""
        return kernel_footprint(network, batch, split, s, -1 if master is None else master,
                                constants, gpu)

    def predict_run(self, config: RunConfig, probe: ClusterProbe | MasterProbe,
                    network: Network, split: dict[str, Any]) -> Prediction:
        """The engine's kernel step on the probed workers (`single`: on one), with the
        recorded split (``split_workers`` names its columns where it left some workers
        out) or the one the config's placement would choose."""
        probe = self.cluster_probe(probe)
        active = self.workers_used(config, probe)
        counts = split.get("kernel_split") or placement_split(config, probe, active)
        names = [w.name for w in probe.workers[:active]]
        if len(counts[0]) != active:  # a recorded split that left workers out: they get 0
            used = split.get("split_workers") or names[:len(counts[0])]
            counts = [[row[used.index(n)] if n in used else 0 for n in names] for row in counts]
        master = names.index(config.cluster.master) if config.cluster.master in names else 0
        options = probe.kernel_options(kernel_counts=counts, master=master,
                                       sync=config.workspace.sync)
        return MODELS["kernel"](network, config.train.batch, probe.device_specs(active),
                                IDEAL_LINK, probe.store_spec(active), options)


def placement_split(config: RunConfig, probe: ClusterProbe, active: int) -> list[list[int]]:
    """The split the engine's placement would choose on the probed workers.

    ``even`` (and one worker): equal quanta; ``calibrated``: proportional to
    the probed speed at the even share (the engine measures its own, which
    differs by noise); ``model``: :func:`pipeline.placement.model_placement.choose_split`.
    """
    spec = probe.network_spec()
    quanta = probe.quanta
    if config.placement == "even" or active == 1:
        return [split_even(layer.kernels, active, q) for layer, q in zip(spec.conv, quanta)]
    if config.placement == "model":
        return choose_split(probe, active)["kernel_split"]
    return calibrated_split(probe, active)


class SingleStrategy(KernelStrategy):
    """The whole network on one worker (the master), through the same machinery."""

    name = "single"
    one_worker = True

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        return MODELS["single"](network, batch, list(devices), link, store, options)
