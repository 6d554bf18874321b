"""Turn measurements into model parameters.

The training engine measures per-layer times, store bandwidths and Dask
latencies; these plain functions turn those numbers into
:class:`DeviceSpec`, :class:`StoreSpec`, :class:`LinkSpec` and
:class:`DaskOverhead` so the model predicts from what the cluster really
does (Paleo's efficiency factors, measured instead of guessed).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from .devices import DaskOverhead, DeviceSpec, LinkSpec, StoreSpec
from .network import ConvLayer

__all__ = [
    "conv_layer_flops",
    "effective_rate",
    "device_from_layer_timings",
    "fit_hockney",
    "store_from_measurements",
    "overhead_from_measurements",
]


def conv_layer_flops(layer: ConvLayer, batch: int, kernels: int, passes: str = "train", first: bool = False) -> float:
    """FLOPs of ``kernels`` channels of ``layer`` at ``batch``.

    ``passes``: ``"forward"``, ``"backward"`` or ``"train"`` (both).
    ``first``: the layer is the network's first (no input gradient).
    """
    fwd = layer.forward(batch, kernels).flops
    bwd = layer.backward_weight(batch, kernels).flops
    if not first:
        bwd += layer.backward_input(batch, kernels).flops
    return {"forward": fwd, "backward": bwd, "train": fwd + bwd}[passes]


def effective_rate(
    layer: ConvLayer, batch: int, kernels: int, seconds: float, passes: str = "train", first: bool = False
) -> float:
    """Effective FLOP/s of a device from one timed run of a layer slice.

    Parameters
    ----------
    layer : ConvLayer
        The layer timed.
    batch, kernels : int
        Batch and number of kernels of the timed run.
    seconds : float
        Measured time (warm-up excluded, median of repeats).
    passes, first
        What was timed; see :func:`conv_layer_flops`.
    """
    if seconds <= 0:
        raise ValueError("measured time must be positive")
    return conv_layer_flops(layer, batch, kernels, passes, first) / seconds


def device_from_layer_timings(
    timings: Mapping[str, tuple[ConvLayer, int, int, float]],
    dense_rate: float | None = None,
    mem_bw: float = math.inf,
    link: LinkSpec | None = None,
    name: str = "",
    first_layer: str | None = None,
) -> DeviceSpec:
    """A device whose conv rates are measured per layer.

    Parameters
    ----------
    timings : mapping
        ``layer name -> (layer, batch, kernels, seconds of forward+backward)``.
    dense_rate : float, optional
        Measured FLOP/s of the dense head; default the mean conv rate.
    mem_bw : float
        Memory bandwidth for element-wise work (``inf``: ignore it).
    link : LinkSpec, optional
        The device's own link.
    name : str
        Label.
    first_layer : str, optional
        Name of the network's first layer (timed without input gradient).
    """
    rates = {
        n: effective_rate(layer, b, k, t, "train", first=(n == first_layer))
        for n, (layer, b, k, t) in timings.items()
    }
    mean = float(np.mean(list(rates.values())))
    dense_eff = 1.0 if dense_rate is None else dense_rate / mean
    return DeviceSpec(
        flops=mean, mem_bw=mem_bw, dense_efficiency=dense_eff,
        layer_rates=rates, link=link, name=name,
    )


def fit_hockney(sizes: Sequence[float], seconds: Sequence[float]) -> LinkSpec:
    """Least-squares ``t = alpha + n beta`` from timed transfers of ``sizes`` bytes.

    Negative fits (noise at tiny sizes) are clipped to zero.
    """
    n = np.asarray(sizes, float)
    t = np.asarray(seconds, float)
    A = np.stack([np.ones_like(n), n], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(A, t, rcond=None)
    return LinkSpec(alpha=max(float(alpha), 0.0), beta=max(float(beta), 0.0))


def store_from_measurements(
    write_bw: float,
    read_bw: float,
    latency: float = 0.0,
    concurrent_write_bw: float | None = None,
    concurrent_read_bw: float | None = None,
) -> StoreSpec:
    """A store from one client's bandwidths (B/s) and per-operation latency (s).

    ``concurrent_*_bw``: aggregate bandwidth measured with several writers
    (readers) at once; without it the store is assumed fully shared (the
    aggregate equals one client's bandwidth).
    """
    return StoreSpec(
        write_bw=concurrent_write_bw or write_bw,
        read_bw=concurrent_read_bw or read_bw,
        latency=latency,
        client_write_bw=write_bw,
        client_read_bw=read_bw,
    )


def overhead_from_measurements(
    task_gap: float,
    sync: float = 0.0,
    hop: float | None = None,
) -> DaskOverhead:
    """Dask costs from measured seconds: the gap between a worker's queued tasks,
    the marker latency, and (default: ten task gaps) a scheduler hop."""
    return DaskOverhead(task=task_gap, sync=sync, hop=10 * task_gap if hop is None else hop)
