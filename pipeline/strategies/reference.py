"""`reference`: plain in-process PyTorch (pipeline/training/reference.py), no cluster.

The baseline a user would otherwise run, and the arithmetic every distributed
strategy must reproduce. Its model is one device's step (`single`'s).
"""

from __future__ import annotations

from typing import Any, Sequence

from pipeline.config.run_config import RunConfig
from pipeline.costmodel import (IDEAL_LINK, DeviceSpec, LinkSpec, Network, Options, Prediction,
                                StoreSpec)
from pipeline.costmodel.strategies import MODELS
from pipeline.probe import ClusterProbe, MasterProbe, dataset_store, master_device
from pipeline.strategies.base import Strategy


class ReferenceStrategy(Strategy):
    """Plain PyTorch in the client's process, `reference.threads` threads."""

    name = "reference"
    uses_cluster = False
    one_worker = True

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        return MODELS["single"](network, batch, list(devices), link, store, options)

    def predict_run(self, config: RunConfig, probe: ClusterProbe | MasterProbe,
                    network: Network, split: dict[str, Any]) -> Prediction:
        """The whole step in this process, from a probe of it at the run's threads."""
        if not isinstance(probe, MasterProbe):
            raise TypeError("strategy reference is predicted from a MasterProbe")
        return MODELS["single"](network, config.train.batch, [master_device(probe, network)],
                                IDEAL_LINK, None,
                                Options(dataset=dataset_store(probe.dataset_read_s)))
