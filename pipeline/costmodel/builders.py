"""Networks built by hand for the cost model: a chain of conv layers whose shapes
follow one another (`sequential`, `conv_net`), Marques et al.'s CIFAR network and
single-column AlexNet as the publications give them (the scaling sweeps and the
Krizhevsky check use these; the engine's networks come from
`pipeline.probe.tables.costmodel_network`)."""

from __future__ import annotations

from typing import Sequence

from .network import ConvLayer, DenseLayer, Network

__all__ = ["sequential", "conv_net", "marques_cifar", "alexnet"]


def sequential(
    in_channels: int,
    in_hw: tuple[int, int],
    conv_specs: Sequence[dict],
    dense_sizes: Sequence[int],
    name: str = "",
) -> Network:
    """Build a network whose shapes chain automatically.

    Parameters
    ----------
    in_channels, in_hw : int, tuple of int
        Image channels and size.
    conv_specs : sequence of dict
        Keyword arguments of :class:`ConvLayer` other than ``in_channels`` and
        ``in_hw`` (``out_channels`` is required).
    dense_sizes : sequence of int
        Output sizes of the dense layers; the first takes the flattened
        conv output.
    name : str
        Network label.
    """
    conv: list[ConvLayer] = []
    c, hw = in_channels, tuple(in_hw)
    for i, spec in enumerate(conv_specs):
        spec = {"name": f"conv{i + 1}", **spec}
        layer = ConvLayer(in_channels=c, in_hw=hw, **spec)  # type: ignore[arg-type]
        conv.append(layer)
        c, hw = layer.out_channels, layer.out_hw
    feats = c * hw[0] * hw[1]
    dense: list[DenseLayer] = []
    for j, size in enumerate(dense_sizes):
        dense.append(DenseLayer(feats, size, name=f"fc{j + 1}"))
        feats = size
    return Network(tuple(conv), tuple(dense), name=name)


def conv_net(
    widths: Sequence[int],
    in_channels: int = 3,
    image: int = 32,
    kernel: int = 5,
    padding: int = 2,
    pool: int = 2,
    hidden: Sequence[int] = (),
    classes: int = 10,
    name: str = "",
) -> Network:
    """Generic CIFAR-style network from a list of conv widths.

    Every conv layer is ``kernel x kernel`` with ``padding``, ReLU and a
    ``pool x pool`` max-pool (the project's reading of Marques et al.);
    then optional hidden dense layers and a classifier.
    """
    specs = [dict(out_channels=w, kernel=kernel, padding=padding, pool=pool) for w in widths]
    return sequential(in_channels, (image, image), specs, [*hidden, classes], name=name)


def marques_cifar(k1: int = 500, k2: int = 1500, hidden: Sequence[int] = ()) -> Network:
    """Marques et al.'s CIFAR-10 network: two 5x5 conv layers, one dense layer.

    With the defaults: 38,000 + 18,751,500 conv parameters and a
    ``1500*8*8 -> 10`` classifier (960,010), 19,749,510 in all.
    """
    return conv_net([k1, k2], hidden=hidden, name=f"marques_{k1}_{k2}")


def alexnet(classes: int = 1000) -> Network:
    """Single-column AlexNet of "one weird trick" (torchvision's variant).

    conv 64 11x11/4 pad 2, pool 3/2; 192 5x5 pad 2, pool 3/2; 384, 256, 256
    3x3 pad 1, pool 3/2; dense 9216-4096-4096-1000 on 3x224x224.  This is the
    variant with 61,100,840 parameters; its convolutions cost 655.6 M MACs per
    image (714.2 M with the dense layers).
    """
    specs = [
        dict(out_channels=64, kernel=11, stride=4, padding=2, pool=3, pool_stride=2),
        dict(out_channels=192, kernel=5, padding=2, pool=3, pool_stride=2),
        dict(out_channels=384, kernel=3, padding=1),
        dict(out_channels=256, kernel=3, padding=1),
        dict(out_channels=256, kernel=3, padding=1, pool=3, pool_stride=2),
    ]
    return sequential(3, (224, 224), specs, [4096, 4096, classes], name="alexnet")
