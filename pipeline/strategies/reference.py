"""`reference`: plain in-process PyTorch (pipeline/training/reference.py), no cluster.

The baseline a user would otherwise run, and the arithmetic every distributed
strategy must reproduce. Its model is one device's step (`single`'s).
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from pipeline.config.run_config import RunConfig
from pipeline.costmodel import (IDEAL_LINK, DeviceSpec, LinkSpec, Network, Options, Prediction,
                                StoreSpec)
from pipeline.costmodel.memory import DEFAULT_CONSTANTS, Footprint, MemoryConstants
from pipeline.costmodel.replica_memory import reference_footprint
from pipeline.costmodel.strategies import MODELS
from pipeline.probe import ClusterProbe, MasterProbe, dataset_store, master_device
from pipeline.strategies.base import Strategy


class ReferenceStrategy(Strategy):
    """Plain PyTorch in the client's process, `reference.threads` threads."""

    name = "reference"
    arithmetic_settings = ()
    uses_cluster = False
    one_worker = True
    memory_model = True
    split_unit = "sample"

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        return MODELS["single"](network, batch, list(devices), link, store, options)

    def peak_memory(self, network: Network, batch: int,
                    split: Sequence[Sequence[int]] | None = None, s: int = 4,
                    master: int | None = 0, constants: MemoryConstants = DEFAULT_CONSTANTS,
                    gpu: Sequence[bool] | None = None) -> Footprint:
        """The training process itself, the whole batch in it (no split, no device)."""
        return reference_footprint(network, batch, s, constants)

    def steps_per_task(self, config: RunConfig) -> int | Literal["auto"]:
        """One: it runs no tasks, its steps run in this process one by one."""
        return 1

    def predict_run(self, config: RunConfig, probe: ClusterProbe | MasterProbe,
                    network: Network, split: dict[str, Any]) -> Prediction:
        """The whole step in this process, from a probe of it at the run's threads."""
        if not isinstance(probe, MasterProbe):
            raise TypeError("strategy reference is predicted from a MasterProbe")
        return MODELS["single"](network, config.train.batch, [master_device(probe, network)],
                                IDEAL_LINK, None,
                                Options(dataset=dataset_store(probe.dataset_read_s)))
