"""`reference`: plain in-process PyTorch (pipeline/reference.py), no cluster.

The baseline a user would otherwise run, and the arithmetic every distributed
strategy must reproduce. Its model is one device's step (`single`'s).
"""

from __future__ import annotations

from typing import Sequence

from pipeline.costmodel import DeviceSpec, LinkSpec, Network, Options, Prediction, StoreSpec
from pipeline.costmodel.strategies import MODELS
from pipeline.strategies.base import Strategy


class ReferenceStrategy(Strategy):
    """Plain PyTorch in the client's process, `reference.threads` threads."""

    name = "reference"
    uses_cluster = False
    one_worker = True

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        return MODELS["single"](network, batch, list(devices), link, store, options)
