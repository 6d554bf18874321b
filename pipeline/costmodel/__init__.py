"""Analytical performance model of distributed CNN training.

Predicts the step time of ``single``, ``kernel`` (Marques et al.),
``data`` and ``hybrid`` (Krizhevsky) training from a network description,
device rates, links and the shared store, following Castelló et al.
(PDP 2021) with Paleo-style efficiency factors.  Pure Python + numpy; it
imports nothing else of the project, so placement can use it to choose
splits and experiments can sweep it.
"""

from .calibration import (
    conv_layer_flops,
    device_from_layer_timings,
    effective_rate,
    fit_hockney,
    overhead_from_measurements,
    store_from_measurements,
)
from .collectives import (
    allreduce,
    alltoall,
    binomial_broadcast,
    linear_broadcast,
    rhd_allreduce,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
)
from .devices import (IDEAL_LINK, DaskOverhead, DeviceSpec, LayerTable, LinkSpec, StoreSpec,
                      TrunkTime)
from .krizhevsky import krizhevsky_k20_setup, krizhevsky_speedups
from .builders import alexnet, conv_net, marques_cifar, sequential
from .network import ConvLayer, DenseLayer, Gemm, Network, Pool
from .prediction import Options, Prediction
from .splits import apportion, split_kernels_minmax, split_kernels_proportional
from .strategies import STRATEGIES, predict, speedup

__all__ = [
    "ConvLayer", "DenseLayer", "Gemm", "Network", "Pool", "alexnet", "conv_net", "marques_cifar", "sequential",
    "DeviceSpec", "LayerTable", "TrunkTime", "LinkSpec", "StoreSpec", "DaskOverhead", "IDEAL_LINK",
    "allreduce", "alltoall", "binomial_broadcast", "linear_broadcast", "rhd_allreduce",
    "ring_allgather", "ring_allreduce", "ring_reduce_scatter",
    "Options", "Prediction", "STRATEGIES", "predict", "speedup",
    "apportion", "split_kernels_minmax", "split_kernels_proportional",
    "conv_layer_flops", "device_from_layer_timings", "effective_rate", "fit_hockney",
    "overhead_from_measurements", "store_from_measurements",
    "krizhevsky_k20_setup", "krizhevsky_speedups",
]
