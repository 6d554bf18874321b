"""Network descriptions reduced to matrix products.

Castelló et al. (PDP 2021) model every layer as matrix products: a convolution
becomes an im2col product, a dense layer a plain GEMM.  This module describes a
network as plain dataclasses and counts its parameters, multiply-accumulates
(MACs) and the ``m x n x k`` products of forward and backward, so the rest of
the cost model never looks at tensors.

Conventions: a product ``Gemm(m, n, k)`` multiplies an ``m x k`` matrix by a
``k x n`` one, costing ``m*n*k`` MACs (``2*m*n*k`` FLOPs).  ``n`` may be a
float where a layer is split fractionally (model-parallel dense slices).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = [
    "Gemm",
    "Pool",
    "ConvLayer",
    "DenseLayer",
    "Network",
]


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


@dataclass(frozen=True)
class Gemm:
    """An ``m x k`` by ``k x n`` matrix product.

    Attributes
    ----------
    m, n, k : float
        Product dimensions; MACs are ``m * n * k``.
    """

    m: float
    n: float
    k: float

    @property
    def macs(self) -> float:
        """Multiply-accumulates of the product."""
        return self.m * self.n * self.k

    @property
    def flops(self) -> float:
        """Floating-point operations (two per MAC)."""
        return 2.0 * self.macs

    def elements(self) -> float:
        """Elements touched at least once: both operands and the result.

        This is the ``mn + mk + nk`` term of the roofline's memory side.
        """
        return self.m * self.n + self.m * self.k + self.n * self.k


@dataclass(frozen=True)
class Pool:
    """One pooling over each channel apart, as PyTorch's: ``kind`` ``max``, ``avg``
    (window, stride, padding) or ``adaptive_avg`` (to a ``window`` x ``window`` map)."""

    kind: str = "max"
    window: int = 2
    stride: int = 2
    padding: int = 0

    def out_size(self, size: int) -> int:
        """The pooled side of a ``size``-long side."""
        if self.kind == "adaptive_avg":
            return self.window
        return (size + 2 * self.padding - self.window) // self.stride + 1


@dataclass(frozen=True)
class ConvLayer:
    """A 2-D convolution and what follows it on the same channels, in this order:
    batch norm, + the output of layer ``residual``, ReLU, each pooling.

    Its shapes (`pooling`, `conv_hw`, `out_hw`, `patch`) are computed once per layer
    and kept: a scaling sweep asks for them millions of times.

    Parameters
    ----------
    in_channels, out_channels : int
        ``C(l-1)`` and ``K(l)``; output channels are the kernels that
        kernel-parallel training shares out.
    in_hw : tuple of int
        Input height and width.
    kernel, stride, padding : int or tuple of int
        Convolution geometry.
    pool, pool_stride : int
        Max-pool window and stride after the ReLU (``pool=1``: no pooling;
        ``pool_stride=None``: same as the window).  Pooling runs on the device
        that owns the channels, so only pooled outputs travel.
    name : str
        Used to look up per-layer calibrated rates.
    bias : bool
        Whether the layer has a bias per kernel.
    pools : tuple of Pool, optional
        The poolings after the ReLU, replacing ``pool``/``pool_stride`` when given.
    batch_norm : bool
        Batch norm (training mode) on the conv's output.
    relu : bool
        ReLU after the batch norm and the residual sum.
    source : int, optional
        Index of the conv layer whose output this one reads (None: the one before;
        -1: the images), so that a residual block's shortcut reads the block's input.
    residual : int, optional
        Index of the conv layer whose (pre-pool) output is added to this one's before
        the ReLU: channel ``c`` to channel ``c``, which ties the two layers' splits.
    """

    in_channels: int
    out_channels: int
    in_hw: tuple[int, int]
    kernel: int | tuple[int, int] = 3
    stride: int | tuple[int, int] = 1
    padding: int | tuple[int, int] = 0
    pool: int = 1
    pool_stride: int | None = None
    name: str = ""
    bias: bool = True
    pools: tuple[Pool, ...] | None = None
    batch_norm: bool = False
    relu: bool = True
    source: int | None = None
    residual: int | None = None

    @cached_property
    def pooling(self) -> tuple[Pool, ...]:
        """The poolings after the ReLU, in order."""
        if self.pools is not None:
            return tuple(self.pools)
        if self.pool <= 1:
            return ()
        return (Pool("max", self.pool, self.pool_stride or self.pool),)

    @cached_property
    def conv_hw(self) -> tuple[int, int]:
        """Spatial size after the convolution, before pooling."""
        (kh, kw), (sh, sw), (ph, pw) = _pair(self.kernel), _pair(self.stride), _pair(self.padding)
        h, w = self.in_hw
        return ((h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1)

    @cached_property
    def out_hw(self) -> tuple[int, int]:
        """Spatial size after pooling (what the next layer sees)."""
        h, w = self.conv_hw
        for pool in self.pooling:
            h, w = pool.out_size(h), pool.out_size(w)
        return (h, w)

    @cached_property
    def patch(self) -> int:
        """Length of one im2col column: ``C_in * kh * kw``."""
        kh, kw = _pair(self.kernel)
        return self.in_channels * kh * kw

    def params(self, kernels: int | None = None) -> int:
        """Parameters of ``kernels`` output channels (all by default): weights, the
        bias and batch norm's scale and shift."""
        k = self.out_channels if kernels is None else kernels
        return k * self.patch + (k if self.bias else 0) + (2 * k if self.batch_norm else 0)

    def buffers(self, kernels: int | None = None) -> int:
        """Non-trained state of ``kernels`` channels: batch norm's running mean and
        variance (its counter is one number, left out)."""
        k = self.out_channels if kernels is None else kernels
        return 2 * k if self.batch_norm else 0

    def pooled_elements(self, batch: int, kernels: float | None = None) -> list[float]:
        """Elements of each pooling's output of ``kernels`` channels, in order."""
        k = self.out_channels if kernels is None else kernels
        h, w = self.conv_hw
        sizes = []
        for pool in self.pooling:
            h, w = pool.out_size(h), pool.out_size(w)
            sizes.append(batch * k * h * w)
        return sizes

    def macs(self, kernels: float | None = None) -> float:
        """Forward MACs per sample for ``kernels`` output channels."""
        return self.forward(1, kernels).macs

    def forward(self, batch: int, kernels: float | None = None) -> Gemm:
        """im2col product of the forward pass: ``(B*Ho*Wo) x K x (C*kh*kw)``."""
        k = self.out_channels if kernels is None else kernels
        ho, wo = self.conv_hw
        return Gemm(m=batch * ho * wo, n=k, k=self.patch)

    def backward_input(self, batch: int, kernels: float | None = None) -> Gemm:
        """Product giving the (partial) input gradient, before col2im."""
        k = self.out_channels if kernels is None else kernels
        ho, wo = self.conv_hw
        return Gemm(m=batch * ho * wo, n=self.patch, k=k)

    def backward_weight(self, batch: int, kernels: float | None = None) -> Gemm:
        """Product giving the kernel gradients: ``K x (C*kh*kw) x (B*Ho*Wo)``."""
        k = self.out_channels if kernels is None else kernels
        ho, wo = self.conv_hw
        return Gemm(m=k, n=self.patch, k=batch * ho * wo)

    def input_elements(self, batch: int) -> int:
        """Elements of the layer input ``B * C(l-1) * H * W``."""
        return batch * self.in_channels * self.in_hw[0] * self.in_hw[1]

    def conv_elements(self, batch: int, kernels: float | None = None) -> float:
        """Elements of the pre-pool output of ``kernels`` channels."""
        k = self.out_channels if kernels is None else kernels
        return batch * k * self.conv_hw[0] * self.conv_hw[1]

    def output_elements(self, batch: int, kernels: float | None = None) -> float:
        """Elements of the pooled output of ``kernels`` channels."""
        k = self.out_channels if kernels is None else kernels
        return batch * k * self.out_hw[0] * self.out_hw[1]


@dataclass(frozen=True)
class DenseLayer:
    """A fully-connected layer ``in_features -> out_features``."""

    in_features: int
    out_features: int
    name: str = ""
    bias: bool = True

    def params(self, fraction: float = 1.0) -> float:
        """Parameters of a slice holding ``fraction`` of the output neurons."""
        return fraction * self.out_features * (self.in_features + (1 if self.bias else 0))

    def macs(self, fraction: float = 1.0) -> float:
        """Forward MACs per sample."""
        return self.forward(1, fraction).macs

    def forward(self, batch: int, fraction: float = 1.0) -> Gemm:
        """``B x out x in`` product (``fraction`` of the outputs)."""
        return Gemm(m=batch, n=fraction * self.out_features, k=self.in_features)

    def backward_input(self, batch: int, fraction: float = 1.0) -> Gemm:
        """``B x in x out`` product for the (partial) input gradient."""
        return Gemm(m=batch, n=self.in_features, k=fraction * self.out_features)

    def backward_weight(self, batch: int, fraction: float = 1.0) -> Gemm:
        """``out x in x B`` product for the weight gradient."""
        return Gemm(m=fraction * self.out_features, n=self.in_features, k=batch)


def update_accesses(momentum: bool = True, weight_decay: bool = True,
                    nesterov: bool = False) -> int:
    """Element accesses per parameter of an SGD step as the engine takes it
    (tasks/optim.py `WorkerSGD`, torch's single-tensor SGD): with weight decay, the
    weight added into the gradient (read both, write: 3); with momentum, the buffer
    scaled (read, write: 2) and the gradient added to it (3), and for Nesterov the
    gradient plus the scaled buffer into a new tensor (3); then the weight stepped
    (read both, write: 3). The config's defaults (momentum 0.9, weight decay 5e-4):
    11; the probe's timed update (`UPDATE_ACCESSES`, no weight decay): 8."""
    accesses = 3
    if weight_decay:
        accesses += 3
    if momentum:
        accesses += 5 + (3 if nesterov else 0)
    return accesses


@dataclass(frozen=True)
class Network:
    """Convolutional trunk followed by a dense head.

    Attributes
    ----------
    conv : tuple of ConvLayer
        Layers in order; each one's input shape is the previous one's output.
    dense : tuple of DenseLayer
        The head, starting from the flattened last conv output.
    name : str
        Free label.
    momentum : bool
        Whether training keeps a momentum buffer per parameter (SGD with momentum
        above 0; torch's SGD and the workers' keep none without): the memory model
        holds one beside the weights, the time model streams it at each update.
    weight_decay, nesterov : bool
        Whether the SGD step adds weight decay, and Nesterov's look-ahead: passes of
        the update over every parameter (`update_accesses`).
    """

    conv: tuple[ConvLayer, ...]
    dense: tuple[DenseLayer, ...]
    name: str = ""
    dropout: tuple[float, ...] = ()
    momentum: bool = True
    weight_decay: bool = True
    nesterov: bool = False

    def update_accesses(self) -> int:
        """Element accesses per parameter of this training's SGD step."""
        return update_accesses(self.momentum, self.weight_decay, self.nesterov)

    def momentum_elements(self, params: float) -> float:
        """The momentum buffers' elements for `params` parameters: as many, or none."""
        return params if self.momentum else 0.0

    def __post_init__(self) -> None:
        for l, b in enumerate(self.conv):
            src = self.source(l)
            if not -1 <= src < l:
                raise ValueError(f"conv layer {b.name!r} must read an earlier layer")
            if src >= 0:
                a = self.conv[src]
                if b.in_channels != a.out_channels or tuple(b.in_hw) != a.out_hw:
                    raise ValueError(f"conv layer {b.name!r} does not follow {a.name!r}")
            if b.residual is not None:
                if not 0 <= b.residual < l:
                    raise ValueError(f"conv layer {b.name!r}: the residual must be an "
                                     "earlier layer")
                added = self.conv[b.residual]
                if (added.out_channels, added.out_hw) != (b.out_channels, b.conv_hw):
                    raise ValueError(f"conv layer {b.name!r}: {added.name!r}'s output "
                                     "does not match its channels and size")
        if self.conv and self.dense and self.dense[0].in_features != self.features:
            raise ValueError("first dense layer must take the flattened conv output")
        for a, b in zip(self.dense, self.dense[1:]):
            if b.in_features != a.out_features:
                raise ValueError(f"dense layer {b.name!r} does not follow {a.name!r}")

    def source(self, l: int) -> int:
        """The conv layer whose output layer ``l`` reads (-1: the images)."""
        given = self.conv[l].source
        return l - 1 if given is None else given

    def readers(self, l: int) -> list[int]:
        """The conv layers that read the whole output of layer ``l`` (-1: the images)."""
        return [r for r in range(len(self.conv)) if self.source(r) == l]

    def adders(self, l: int) -> list[int]:
        """The conv layers that add layer ``l``'s output to theirs, channel by channel."""
        return [r for r, layer in enumerate(self.conv) if layer.residual == l]

    def tied_groups(self) -> list[list[int]]:
        """Layers that must share one kernel split (a residual sum adds their channels
        one to one), as lists of indices in order; a layer alone is its own group."""
        # a residual is an earlier layer, whose group is known by then
        group_of: list[int] = []
        for l, layer in enumerate(self.conv):
            group_of.append(l if layer.residual is None else group_of[layer.residual])
        return [[l for l, g in enumerate(group_of) if g == first]
                for first in sorted(set(group_of))]

    def dense_dropout(self, j: int) -> float:
        """The dropout probability on dense layer ``j``'s input (0: none)."""
        return self.dropout[j] if j < len(self.dropout) else 0.0

    @property
    def features(self) -> int:
        """Flattened size of the last conv layer's (pooled) output per sample."""
        last = self.conv[-1]
        return last.out_channels * last.out_hw[0] * last.out_hw[1]

    def conv_buffers(self) -> int:
        """Batch norm's running statistics of all conv layers."""
        return sum(c.buffers() for c in self.conv)

    def conv_params(self) -> int:
        """Parameters of all conv layers."""
        return sum(c.params() for c in self.conv)

    def dense_params(self) -> int:
        """Parameters of all dense layers."""
        return int(sum(d.params() for d in self.dense))

    def params(self) -> int:
        """Total parameter count."""
        return self.conv_params() + self.dense_params()

    def largest_tensor(self) -> int:
        """Elements of the largest weight tensor (a conv layer's kernels, a dense
        layer's matrix): what a loop over the tensors holds at most at once."""
        return max([c.out_channels * c.patch for c in self.conv]
                   + [d.in_features * d.out_features for d in self.dense])

    def conv_macs(self) -> float:
        """Forward MACs of the conv layers per sample."""
        return sum(c.macs() for c in self.conv)

    def dense_macs(self) -> float:
        """Forward MACs of the dense layers per sample."""
        return sum(d.macs() for d in self.dense)

    def macs(self) -> float:
        """Forward MACs per sample."""
        return self.conv_macs() + self.dense_macs()
