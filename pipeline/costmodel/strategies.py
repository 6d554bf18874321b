"""Entry point: predicted step time of a strategy on given devices.

Four strategies, after docs/methods.md:

- ``single``: the whole network on ``devices[0]``;
- ``kernel``: Marques et al.'s kernel-parallel conv layers through the
  shared store, dense head on a master (:mod:`.kernel`);
- ``data``: data parallel with gradient allreduce over links (:mod:`.data`), or
  through a shared store as the engine runs it (:mod:`.replicas`);
- ``hybrid``: Krizhevsky's data-parallel conv + model-parallel dense
  (:mod:`.hybrid` over links, :mod:`.replicas` through a store).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from .data import predict_data, predict_single
from .devices import IDEAL_LINK, DeviceSpec, LinkSpec, StoreSpec
from .hybrid import predict_hybrid
from .kernel import predict_kernel
from .network import Network
from .prediction import Options, Prediction
from .replicas import predict_data_store, predict_hybrid_store
from .splits import split_kernels_minmax, split_kernels_proportional

__all__ = ["MODELS", "STRATEGIES", "predict", "speedup"]

STRATEGIES = ("single", "kernel", "data", "hybrid")


def predict(
    strategy: str,
    network: Network,
    batch: int,
    devices: DeviceSpec | Sequence[DeviceSpec],
    link: LinkSpec = IDEAL_LINK,
    store: StoreSpec | None = None,
    options: Options | None = None,
    **overrides: Any,
) -> Prediction:
    """Predict one training step.

    Parameters
    ----------
    strategy : str
        One of :data:`STRATEGIES`.
    network : Network
        What is trained.
    batch : int
        Samples per step (the whole mini-batch over all devices).
    devices : DeviceSpec or sequence of DeviceSpec
        The workers, possibly unequal.
    link : LinkSpec
        Link used where a device has none of its own.
    store : StoreSpec, optional
        The shared store ``kernel`` moves activations through; ``None``:
        direct transfers over the links.
    options : Options, optional
        Strategy knobs; keyword ``overrides`` replace its fields.

    Returns
    -------
    Prediction
    """
    devs = [devices] if isinstance(devices, DeviceSpec) else list(devices)
    if not devs:
        raise ValueError("need at least one device")
    opts = dataclasses.replace(options or Options(), **overrides)
    if strategy not in MODELS:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    return MODELS[strategy](network, batch, devs, link, store, opts)


def _single(network: Network, batch: int, devices: list[DeviceSpec], link: LinkSpec,
            store: StoreSpec | None, opts: Options) -> Prediction:
    return predict_single(network, batch, devices[0], opts.dataset)


def _data(network: Network, batch: int, devices: list[DeviceSpec], link: LinkSpec,
          store: StoreSpec | None, opts: Options) -> Prediction:
    if store is not None:
        return predict_data_store(network, batch, devices, link, store, opts)
    return predict_data(network, batch, devices, link, opts)


def _hybrid(network: Network, batch: int, devices: list[DeviceSpec], link: LinkSpec,
            store: StoreSpec | None, opts: Options) -> Prediction:
    if store is not None:
        return predict_hybrid_store(network, batch, devices, link, store, opts)
    return predict_hybrid(network, batch, devices, link, opts)


def _kernel(network: Network, batch: int, devices: list[DeviceSpec], link: LinkSpec,
            store: StoreSpec | None, opts: Options) -> Prediction:
    counts = opts.kernel_counts
    if counts is None:
        if opts.split == "proportional":
            counts = split_kernels_proportional(network, devices, opts.quantum)
        elif opts.split == "minmax":
            counts = split_kernels_minmax(network, batch, devices, link, store, opts.quantum,
                                          opts, opts.min_units)
        else:
            raise ValueError(f"unknown split {opts.split!r}")
    return predict_kernel(network, batch, devices, link, store, opts, counts)


#: The model of each strategy: ``model(network, batch, devices, link, store, options)``.
MODELS: dict[str, Callable[..., Prediction]] = {
    "single": _single, "kernel": _kernel, "data": _data, "hybrid": _hybrid}


def speedup(
    strategy: str,
    network: Network,
    batch: int,
    devices: Sequence[DeviceSpec],
    link: LinkSpec = IDEAL_LINK,
    store: StoreSpec | None = None,
    options: Options | None = None,
    baseline: DeviceSpec | None = None,
    **overrides: Any,
) -> float:
    """Single-device step time over the strategy's step time, same batch.

    ``baseline`` is the single device (``devices[0]`` by default).
    """
    one = predict("single", network, batch, baseline or devices[0])
    many = predict(strategy, network, batch, devices, link, store, options, **overrides)
    return one.step_time / many.step_time
