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
from .network import ConvLayer, DenseLayer, Network, update_accesses

__all__ = ["LayerTime", "conv_time", "dense_time", "after_conv_elements", "UPDATE_ACCESSES",
           "update_accesses", "DEFAULT_UPDATE_ACCESSES",
           "GATHER_ACCESSES", "FLATTEN_ACCESSES", "REPLICA_UPDATE_ACCESSES", "sum_accesses",
           "dense_stream_elements"]

#: The update's accesses at the config's defaults (momentum, weight decay): what a
#: model call prices where it is not told the run's optimizer.
DEFAULT_UPDATE_ACCESSES = update_accesses()

#: Element accesses per parameter of the update the probe times for a worker's memory
#: rate (tasks/update_rate.py: SGD with momentum, no weight decay).
UPDATE_ACCESSES = update_accesses(momentum=True, weight_decay=False)

#: Element accesses per element of a concatenation (read each part, write the whole):
#: a replica's summed ranges into one flat gradient before its update
#: (``grad-update``), a kernel holder's shards of a layer input into the whole input
#: (tasks/kernel_ops.py, ``_gather``: `KernelContext.gather_time`).
GATHER_ACCESSES = 2

#: A replica's update in all, as the probe times it to find a worker's memory rate
#: (tasks/update_rate.py); a run's is `GATHER_ACCESSES` plus its own `update_accesses`.
REPLICA_UPDATE_ACCESSES = GATHER_ACCESSES + UPDATE_ACCESSES

#: Element accesses per parameter of copying a replica's gradients out into the flat
#: ranges it hands on (read, write: ``replica-step``'s hand-on).
FLATTEN_ACCESSES = 2


def sum_accesses(parts: int) -> int:
    """Element accesses per element of summing ``parts`` tensors one after the other,
    as the engine's reductions do: each addition reads two and writes one."""
    return 3 * max(parts - 1, 0)

#: Element accesses per conv-output element of batch norm in training mode: forward, a
#: statistics pass (read) and the normalisation (read, write); backward, a pass for
#: the per-channel sums (read the gradient and the input) and one for the input
#: gradient (read both, write it).
BATCH_NORM_FORWARD, BATCH_NORM_BACKWARD = 3, 5

#: Element accesses per element of a residual sum forward (read both, write); its
#: backward hands the same gradient to both operands and costs nothing.
RESIDUAL_FORWARD = 3

#: Element accesses per dense-input element of dropout: forward, draw the mask, read
#: the input, write the output; backward, read the gradient, write it masked.
DROPOUT_FORWARD, DROPOUT_BACKWARD = 3, 2


def after_conv_elements(layer: ConvLayer, batch: float, kernels: float,
                        backward: bool = False) -> float:
    """Element accesses of what follows a conv on ``kernels`` channels: batch norm,
    the residual sum, ReLU and the poolings, forward or ``backward``.

    Each is a stream through memory (the roofline's memory side). A ReLU followed by a
    pooling is fused into the pooling's read (forward: read + write the pre-pool map,
    write the pooled one; backward: read the pooled gradient, write and mask the
    pre-pool one), as the paper family's layers have always been priced.
    """
    conv_el = layer.conv_elements(batch, kernels)
    pooled = layer.pooled_elements(batch, kernels)
    inputs = [conv_el, *pooled[:-1]]
    total = 0.0
    if layer.batch_norm:
        total += (BATCH_NORM_BACKWARD if backward else BATCH_NORM_FORWARD) * conv_el
    if layer.residual is not None and not backward:
        total += RESIDUAL_FORWARD * conv_el
    if layer.relu:
        total += 2 * conv_el
    for i, (seen, out) in enumerate(zip(inputs, pooled)):
        fused = i == 0 and layer.relu  # the pool's read of the ReLU's output
        total += out + (0.0 if fused else seen)
    return total


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

    def scaled(self, factor: float) -> "LayerTime":
        """The forward and backward times `factor` times as long (a measured rate in
        place of a modelled one); the update, bound by the parameters, as it is."""
        return LayerTime(self.forward * factor, self.backward * factor, self.update,
                         self.backward_input * factor)


def conv_time(
    dev: DeviceSpec,
    layer: ConvLayer,
    batch: float,
    kernels: float | None = None,
    input_grad: bool = True,
    accesses: int = DEFAULT_UPDATE_ACCESSES,
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
    accesses : int
        Element accesses per parameter of the update (`Network.update_accesses`).
    """
    k = layer.out_channels if kernels is None else kernels
    if k <= 0 or batch <= 0:
        return LayerTime()
    name = layer.name or None
    table = dev.layer_tables.get(name) if name is not None else None
    if table is not None:  # measured at the real shapes, update included
        fwd, bwd = table.times(k, batch)
        # the probe's runs step with the config's default SGD: another's passes differ
        bwd += dev.stream_time((accesses - DEFAULT_UPDATE_ACCESSES) * layer.params(int(round(k))))
        return LayerTime(fwd, bwd, 0.0, table.input_time(k, batch) if input_grad else 0.0)
    fwd = dev.gemm_time(layer.forward(batch, k), "conv", name) + dev.stream_time(
        after_conv_elements(layer, batch, k))
    # backward: what follows the conv backwards (pool, ReLU, batch norm), the
    # kernel grads, and the col2im input grad.
    first = dev.stream_time(after_conv_elements(layer, batch, k, backward=True))
    if input_grad:
        first += dev.gemm_time(layer.backward_input(batch, k), "conv", name)
        first += dev.stream_time(layer.input_elements(batch))
    bwd = first + dev.gemm_time(layer.backward_weight(batch, k), "conv", name)
    upd = dev.stream_time(accesses * layer.params(int(round(k))))
    return LayerTime(fwd, bwd, upd, first if input_grad else 0.0)


def dense_time(
    dev: DeviceSpec,
    layers: Sequence[DenseLayer],
    batch: float,
    fraction: float = 1.0,
    input_grad: bool = True,
    dropout: Sequence[float] = (),
    accesses: int = DEFAULT_UPDATE_ACCESSES,
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
    dropout : sequence of float
        Dropout probability on each layer's input (`Network.dropout`; empty: none).
    accesses : int
        Element accesses per parameter of the update (`Network.update_accesses`).
    """
    if batch <= 0 or fraction <= 0:
        return LayerTime()
    fwd, bwd, upd = (dev.stream_time(n) for n in
                     dense_stream_elements(layers, batch, fraction, dropout, accesses))
    for i, layer in enumerate(layers):
        name = layer.name or None
        fwd += dev.gemm_time(layer.forward(batch, fraction), "dense", name)
        bwd += dev.gemm_time(layer.backward_weight(batch, fraction), "dense", name)
        if i > 0 or input_grad:
            bwd += dev.gemm_time(layer.backward_input(batch, fraction), "dense", name)
    return LayerTime(fwd, bwd, upd)


def dense_stream_elements(layers: Sequence[DenseLayer], batch: float, fraction: float = 1.0,
                          dropout: Sequence[float] = (),
                          accesses: int = DEFAULT_UPDATE_ACCESSES
                          ) -> tuple[float, float, float]:
    """Element accesses of a dense head's element-wise work, forward, backward and
    update: dropout on each layer's input (whole in every slice) and the SGD step of
    the ``fraction`` of each layer's parameters held."""
    fwd = bwd = upd = 0.0
    for i, layer in enumerate(layers):
        if i < len(dropout) and dropout[i] > 0:
            fwd += DROPOUT_FORWARD * batch * layer.in_features
            bwd += DROPOUT_BACKWARD * batch * layer.in_features
        upd += accesses * layer.params(fraction)
    return fwd, bwd, upd


def dense_slice_time(dev: DeviceSpec, network: Network, j: int, rows: float,
                     fraction: float) -> LayerTime:
    """A ``hybrid`` device's slice (``fraction`` of the neurons) of dense layer ``j`` on
    ``rows`` samples, at the modelled rates: its dropout, its products, its update."""
    return dense_time(dev, [network.dense[j]], rows, fraction,
                      dropout=(network.dense_dropout(j),), accesses=network.update_accesses())


def dense_slices_time(dev: DeviceSpec, network: Network, neurons: Sequence[int],
                      rows: float) -> LayerTime:
    """A ``hybrid`` device's `neurons` of every dense layer on ``rows`` samples, at the
    modelled rates (none of a layer it holds no neuron of)."""
    return sum((dense_slice_time(dev, network, j, rows, n / layer.out_features)
                for j, (layer, n) in enumerate(zip(network.dense, neurons))), LayerTime())


def measured_head_factor(dev: DeviceSpec, network: Network) -> float:
    """The device's measured dense head over the modelled one, on a replica's rows
    with every replica at once (`TrunkTime.dense`), by which a ``hybrid`` device's
    slices of the dense layers are scaled; 1 where the probe timed no head.

    Why: the dense rate is timed on the master, alone, at the whole batch. A hybrid
    device runs its slice (``1/P`` of the neurons) on the whole batch with every other
    device at once: per row it streams the same weights as a ``data`` replica's whole
    head on ``B/P`` rows, which the probe times as such. On VGG-11 at a quarter width
    (batch 128, 2 workers, AMD EPYC) the slices took 34 ms a step where the master's
    rate gave 26, and the replica's head 35 ms."""
    if dev.trunk is None or not network.dense:
        return 1.0
    measured = dev.trunk.dense_time(dev.trunk.batch)
    modelled = dense_time(dev, network.dense, dev.trunk.batch,
                          dropout=tuple(network.dense_dropout(j)
                                        for j in range(len(network.dense))),
                          accesses=network.update_accesses())
    total = modelled.forward + modelled.backward
    return measured / total if measured and total > 0 else 1.0


def hybrid_head_factor(dev: DeviceSpec, network: Network, neurons: Sequence[int]) -> float:
    """A ``hybrid`` device's measured dense work over the modelled, by which its slices
    (`neurons` of each dense layer) are scaled. Where the probe timed its hybrid dense
    ops (`TrunkTime.hybrid_head`: its neurons on the whole batch, as runs run them),
    those over the modelled slices at that batch; else `measured_head_factor`.

    Why the ops themselves: each has a fixed cost (its Python, autograd's set-up, the
    gather of its input) that a product as small as the small network's one dense
    layer (4096 x 10, batch 64) does not cover: there, on 2 workers (Intel Xeon), the
    ops took 1.1 ms a step where the replica's head gave 0.4."""
    trunk = dev.trunk
    if trunk is None or not trunk.hybrid_head or trunk.hybrid_head_batch <= 0:
        return measured_head_factor(dev, network)
    modelled = dense_slices_time(dev, network, neurons, trunk.hybrid_head_batch)
    total = modelled.forward + modelled.backward
    return trunk.hybrid_head / total if total > 0 else 1.0
