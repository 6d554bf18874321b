"""Compute time of layers on one device.

Every layer becomes its matrix products (roofline-timed on the device) plus
the element-wise work around them (ReLU, pooling, SGD update), which is
memory-bound and timed as a stream through memory.  The element-wise terms
are small on the networks of this project but keep "infinite FLOP/s" from
meaning "zero time".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .devices import DeviceSpec
from .network import ConvLayer, DenseLayer

__all__ = ["LayerTime", "conv_time", "dense_time", "UPDATE_ACCESSES"]

#: Element accesses per parameter of an SGD-with-momentum update:
#: read weight, gradient and momentum, write weight and momentum.
UPDATE_ACCESSES = 5


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one layer (or slice) on one device.

    Attributes
    ----------
    forward : float
        Forward products and element-wise work.
    backward : float
        Backward products and element-wise work (no update).
    update : float
        SGD update of the parameters held.
    backward_input : float
        The part of ``backward`` that comes first and yields the input gradient
        (pool/ReLU backward and the input-gradient product): the engine hands
        it on to the layer below before computing the weight gradient.
    """

    forward: float = 0.0
    backward: float = 0.0
    update: float = 0.0
    backward_input: float = 0.0

    @property
    def total(self) -> float:
        """Forward + backward + update."""
        return self.forward + self.backward + self.update

    def __add__(self, other: "LayerTime") -> "LayerTime":
        return LayerTime(
            self.forward + other.forward,
            self.backward + other.backward,
            self.update + other.update,
            self.backward_input + other.backward_input,
        )


def conv_time(
    dev: DeviceSpec,
    layer: ConvLayer,
    batch: float,
    kernels: float | None = None,
    input_grad: bool = True,
) -> LayerTime:
    """Time of ``kernels`` output channels of a conv layer at ``batch``.

    Parameters
    ----------
    dev : DeviceSpec
        The device.
    layer : ConvLayer
        The layer.
    batch : float
        Samples this device processes.
    kernels : float, optional
        Output channels held (all by default); zero costs zero.
    input_grad : bool
        Whether the (partial) input gradient is computed (not for layer 1).
        A measured :class:`~.devices.LayerTable` already reflects this.
    """
    k = layer.out_channels if kernels is None else kernels
    if k <= 0 or batch <= 0:
        return LayerTime()
    name = layer.name or None
    table = dev.layer_tables.get(name) if name is not None else None
    if table is not None:  # measured at the real shapes, update included
        fwd, bwd = table.times(k, batch)
        return LayerTime(fwd, bwd, 0.0, table.input_time(k, batch) if input_grad else 0.0)
    conv_el = layer.conv_elements(batch, k)
    out_el = layer.output_elements(batch, k)
    # forward: product, then ReLU fused into the pool's read (read + write
    # the pre-pool map, write the pooled map).
    fwd = dev.gemm_time(layer.forward(batch, k), "conv", name) + dev.stream_time(2 * conv_el + out_el)
    # backward: pool/ReLU backward (read pooled grad, write + mask the
    # pre-pool grad), kernel grads, and the col2im input grad.
    first = dev.stream_time(out_el + 2 * conv_el)
    if input_grad:
        first += dev.gemm_time(layer.backward_input(batch, k), "conv", name)
        first += dev.stream_time(layer.input_elements(batch))
    bwd = first + dev.gemm_time(layer.backward_weight(batch, k), "conv", name)
    upd = dev.stream_time(UPDATE_ACCESSES * layer.params(int(round(k))))
    return LayerTime(fwd, bwd, upd, first if input_grad else 0.0)


def dense_time(
    dev: DeviceSpec,
    layers: Sequence[DenseLayer],
    batch: float,
    fraction: float = 1.0,
    input_grad: bool = True,
) -> LayerTime:
    """Time of a dense head, or of a model-parallel slice of it.

    Parameters
    ----------
    dev : DeviceSpec
        The device.
    layers : sequence of DenseLayer
        The dense layers.
    batch : float
        Samples in the (sub-)step.
    fraction : float
        Share of each layer's output neurons this device holds.
    input_grad : bool
        Whether the first dense layer's input gradient is needed (it is
        whenever conv layers sit below).
    """
    if batch <= 0 or fraction <= 0:
        return LayerTime()
    fwd = bwd = upd = 0.0
    for i, layer in enumerate(layers):
        name = layer.name or None
        fwd += dev.gemm_time(layer.forward(batch, fraction), "dense", name)
        bwd += dev.gemm_time(layer.backward_weight(batch, fraction), "dense", name)
        if i > 0 or input_grad:
            bwd += dev.gemm_time(layer.backward_input(batch, fraction), "dense", name)
        upd += dev.stream_time(UPDATE_ACCESSES * layer.params(fraction))
    return LayerTime(fwd, bwd, upd)
